"""FSDP2 trainer ranks for the sharded-trainer tests: module-level, so spawn can run them.

Each rank process joins a gloo group, shards a small transformer with ``fully_shard``
(fp32 parameters; some row counts are not divisible by the world size), and loops:
an optimizer step, the full state it expects the engine to get (gathered on every
rank, cast to bf16) sent to the test through a queue, then ``serve_push`` until the
coordinator ends the push. After its last step it serves until the coordinator closes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from torch.nn import functional as F

from asyncrefit.tools._machine import free_port

VOCAB = 97  # odd: lm_head's and the embedding's rows split 49 + 48 over two ranks


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden + 1)  # odd rows
        self.down = torch.nn.Linear(2 * hidden + 1, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=-1)
        q, k, v = (y.view(b, t, self.heads, h // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, h))
        y: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return y


class TinyTransformer(torch.nn.Module):
    def __init__(self, hidden: int = 48, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.lm_head(self.norm(x))
        return out


def make_transformer(hidden: int = 48) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(hidden)


def make_transformer_bf16() -> torch.nn.Module:
    """The engine's copy: the same transformer, held in bfloat16."""
    return make_transformer().to(torch.bfloat16)


def make_wide_transformer_bf16() -> torch.nn.Module:
    return make_transformer(256).to(torch.bfloat16)


@dataclass(frozen=True)
class RankPlan:
    """What a rank process does."""

    world: int
    port: int
    directory: str
    steps: int
    hidden: int = 48
    devices: dict[int, list[str]] = field(default_factory=dict)  # rank -> devices served
    kill_at_bucket: dict[int, int] = field(default_factory=dict)  # rank -> bucket
    gather_timeout: float = 30.0


def _digests(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter gathered (a collective: all ranks), cast to bf16, digested."""
    from asyncrefit._worker._receiver import tensor_digest

    return {
        name: tensor_digest(p.full_tensor().to(torch.bfloat16))  # type: ignore[attr-defined]
        for name, p in model.named_parameters()
    }


def rank_main(rank: int, plan: RankPlan, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncrefit import cpu_device
    from asyncrefit.tools._machine import reset_peak_rss, rss_bytes
    from asyncrefit.trainer import DTensorSource, RankServer, rank_path

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port))
    dist.init_process_group("gloo", rank=rank, world_size=plan.world)
    try:
        mesh = init_device_mesh("cpu", (plan.world,))
        model = make_transformer(plan.hidden)
        assert isinstance(model, TinyTransformer)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

        kill_at = plan.kill_at_bucket.get(rank)

        class Source(DTensorSource):
            def _pack_locked(self, bucket: Any, slot: int) -> int | None:
                if bucket.index == kill_at:
                    os._exit(9)  # a rank lost in the middle of a push's gathers
                return super()._pack_locked(bucket, slot)

        devices = plan.devices.get(rank, [f"cpu:{rank}"])
        source = Source(
            model, devices=[cpu_device(d) for d in devices], timeout=plan.gather_timeout
        )
        server = RankServer(source, rank_path(plan.directory, rank))

        async def serve() -> None:
            async with server:
                for step in range(1, plan.steps + 1):
                    gen = torch.Generator().manual_seed(step)
                    tokens = torch.randint(0, VOCAB, (4, 16), generator=gen)
                    logits = model(tokens)
                    loss = F.cross_entropy(
                        logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
                    )
                    loss.backward()  # type: ignore[no-untyped-call]
                    optimizer.step()
                    optimizer.zero_grad()
                    expected = _digests(model)
                    if rank == 0:
                        results.put(("expected", step, expected))
                    reset_peak_rss()
                    before, _ = rss_bytes()
                    outcome = await server.serve_push()
                    _, peak = rss_bytes()
                    results.put(("peak", rank, step, peak - before))
                    if rank == 0:
                        results.put(("served", step, outcome.version, outcome.ok))
                    if outcome.closed:
                        results.put(("closed", rank, step))
                        return
                while not (await server.serve_push()).closed:
                    pass
                results.put(("closed", rank, plan.steps))

        anyio.run(serve)
    finally:
        dist.destroy_process_group()


#: (name, mesh shape, placements, global shape): the layouts the gather must undo.
LAYOUTS: list[tuple[str, tuple[int, ...], tuple[str, ...], tuple[int, ...]]] = [
    ("shard0-even", (4,), ("S0",), (8, 5)),
    ("shard0-uneven", (4,), ("S0",), (7, 5)),
    ("shard0-fewer-rows-than-ranks", (4,), ("S0",), (3, 5)),
    ("shard1-uneven", (4,), ("S1",), (6, 9)),
    ("replicate", (4,), ("R",), (4, 3)),
    ("2d-shard0-shard1", (2, 2), ("S0", "S1"), (5, 7)),
    ("2d-shard0-shard0", (2, 2), ("S0", "S0"), (9, 3)),
    ("2d-replicate-shard0", (2, 2), ("R", "S0"), (5, 4)),
    ("1d-vector", (4,), ("S0",), (10,)),
    ("empty", (4,), ("S0",), (0, 4)),
]


def layouts_main(rank: int, world: int, port: int, results: Any) -> None:
    """Gather every layout of :data:`LAYOUTS` into fp32 and bf16 destinations; report."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from asyncrefit._exceptions import GatherError
    from asyncrefit.trainer._gather import gather_into, gather_rows_into

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
        for name, mesh_shape, placements, shape in LAYOUTS:
            mesh = init_device_mesh("cpu", mesh_shape)
            full = torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))
            dt = distribute_tensor(full, mesh, [kinds[p] for p in placements])
            for dtype in (torch.float32, torch.bfloat16):
                out = torch.full(shape, float("nan"), dtype=dtype)
                gather_into(dt, out, timeout=10, name=name)
                ok = torch.equal(out.view(torch.uint8), full.to(dtype).view(torch.uint8))
                results.put(("layout", rank, name, str(dtype), ok))
            # rows lo:hi only (a part, or one expert of a fused tensor): within one
            # rank's shard, across a shard boundary, the last rows, all of them
            rows_ok = True
            n = shape[0]
            for lo, hi in {(0, min(1, n)), (1, n - 1), (n // 2, n), (0, n)}:
                if not 0 <= lo <= hi <= n:
                    continue
                for dtype in (torch.float32, torch.bfloat16):
                    part = torch.full((hi - lo, *shape[1:]), float("nan"), dtype=dtype)
                    gather_rows_into(dt, lo, hi, part, timeout=10, name=name)
                    want = full[lo:hi].to(dtype)
                    rows_ok &= torch.equal(part.view(torch.uint8), want.view(torch.uint8))
            results.put(("rows", rank, name, "", rows_ok))
        mesh = init_device_mesh("cpu", (world,))
        partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        try:
            gather_into(partial, torch.empty(4), timeout=10, name="partial")
        except GatherError as exc:
            results.put(("refused", rank, str(exc)))
        else:
            results.put(("refused", rank, None))
    finally:
        dist.destroy_process_group()


def make_transformer_bf16_on(device: str) -> torch.nn.Module:
    """The engine's bf16 copy on ``device`` (``"cpu"`` or ``"cuda"``)."""
    return make_transformer_bf16().to(device)


def one_rank_main(device: str, results: Any) -> None:
    """A world of one rank: FSDP2 over a mesh of size 1 on ``device``, pushed twice.

    gloo on the CPU (shared memory), NCCL on a GPU (CUDA IPC); the fp32 parameters go
    cast to bf16 into one local worker process. No collective may run: a mesh of one
    rank has nothing to gather. Reports ``("one-rank", version, equal, bytes)`` per
    push, or ``("error", text)``.
    """
    import functools
    import traceback

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncrefit import DeviceId, RefitCoordinator, cpu_device
    from asyncrefit._exceptions import AsyncRefitError
    from asyncrefit._worker._receiver import tensor_digest
    from asyncrefit.local import spawn_local_workers
    from asyncrefit.trainer import DTensorSource, _gather
    from asyncrefit.transport._base import Exporter

    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AsyncRefitError("a mesh of one rank ran a collective")

    _gather._all_gather = no_collective
    try:
        backend = "gloo" if device == "cpu" else "nccl"
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group(backend, rank=0, world_size=1)
        try:
            mesh = init_device_mesh(device, (1,))
            model = make_transformer().to(device)
            assert isinstance(model, TinyTransformer)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            exporter: Exporter | None = None
            dev: DeviceId = cpu_device(0)
            if device != "cpu":
                from asyncrefit.transport.cuda_ipc import CudaIpcExporter

                cuda = CudaIpcExporter(0)
                exporter, dev = cuda, cuda.device_id
            source = DTensorSource(model, exporter=exporter, devices=[dev], timeout=10)
            factory = functools.partial(make_transformer_bf16_on, device)

            async def push() -> None:
                async with spawn_local_workers(factory, 1, devices=[dev]) as workers:
                    async with RefitCoordinator(
                        trainer=source, workers=workers, budget_bytes=64 << 10
                    ) as refit:
                        for version in (1, 2):
                            with torch.no_grad():
                                for p in model.parameters():
                                    p.to_local().mul_(1.5)  # type: ignore[attr-defined]
                            report = await refit.push(version)
                            expected = {
                                name: tensor_digest(
                                    p.to_local().to(torch.bfloat16)  # type: ignore[attr-defined]
                                )
                                for name, p in model.named_parameters()
                            }
                            got = await workers[0].parameter_digests()
                            results.put(("one-rank", version, got == expected, report.bytes))

            anyio.run(push)
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put(("error", traceback.format_exc()))
        raise
