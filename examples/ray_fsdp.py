"""Refit from an FSDP2 trainer on Ray: one trainer actor per rank, inference actors in bf16.

Run:
    .venv/bin/python examples/ray_fsdp.py                    # starts a local cluster
    .venv/bin/python examples/ray_fsdp.py --address auto     # joins an existing one

Two trainer actors are the two ranks of one FSDP2 trainer: the driver forms their own
``torch.distributed`` group (``init_trainer_group``: gloo here, NCCL on GPUs), then
each shards a small language model with ``fully_shard`` (fp32 master weights). Each
rank's actor is a refit source: ``init_refit_source`` sees the DTensor parameters and
serves them with a ``DTensorSource``, which gathers each bucket into its staging slot,
cast to the engine's dtype. Inference actors hold the model in bfloat16, on the
ranks' (virtual CPU) devices. After every optimizer step (run on both ranks at once)
the driver awaits a refit; the coordinator drives both ranks through every bucket in
plan order, also a rank that serves no worker (``--all-on-rank0``). Each version is
checked bitwise against the full state both ranks gather, cast to bf16.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torch.nn import functional as F

from asyncrefit import RefitCoordinator
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.ray import (
    RayTrainerSource,
    RayWorker,
    RefitTrainerMixin,
    RefitWorkerMixin,
    destroy_trainer_group,
    init_trainer_group,
)

VOCAB = 257  # odd: the embedding's and the head's rows split unevenly over two ranks
HIDDEN = 64


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))  # type: ignore[no-any-return]


class LanguageModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)  # type: ignore[no-any-return]


def make_model() -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel()


class Rank(RefitTrainerMixin):
    """One rank of the FSDP2 trainer."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model: LanguageModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    async def setup(self, device: str) -> None:
        """Shard the model over the group (formed by the driver) and publish it."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # DTensor parameters: a DTensorSource, gathering each bucket (bounded by 30 s).
        self.init_refit_source(model, devices=[device], gather_timeout=30.0)

    async def train_step(self, step: int) -> float:
        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None

        def run() -> float:
            tokens = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(step))
            logits = model(tokens)  # your RL loss here
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            return float(loss.detach())

        return await anyio.to_thread.run_sync(run)  # the actor's loop stays responsive

    async def full_state_digests(self) -> dict[str, str]:
        """The full weights cast to bf16, digested: a collective, call it on every rank."""
        model = self.model
        assert model is not None

        def run() -> dict[str, str]:
            return {
                name: tensor_digest(p.full_tensor().to(torch.bfloat16))  # type: ignore[attr-defined]
                for name, p in model.named_parameters()
            }

        return await anyio.to_thread.run_sync(run)


class Policy(RefitWorkerMixin):
    """One inference actor: the model in bf16 (stands in for an engine) on a device."""

    def __init__(self, device: str) -> None:
        torch.set_num_threads(1)
        self.model = make_model().to(torch.bfloat16).eval()
        self.init_refit(self.model, device=device)


async def on_every_rank(refs: list[Any]) -> list[Any]:
    """Await one call on every rank at once (training steps and gathers are collectives)."""
    results: list[Any] = [None] * len(refs)

    async def one(i: int) -> None:
        results[i] = await refs[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(refs)):
            tg.start_soon(one, i)
    return results


async def run(workers_per_rank: int, all_on_rank0: bool, steps: int) -> None:
    # Everything on the driver's node: a worker is served by a rank on its own node.
    here = NodeAffinitySchedulingStrategy(
        node_id=ray.get_runtime_context().get_node_id(), soft=False
    )
    ranks: list[Any] = [  # Ray actor handles
        ray.remote(Rank).options(num_cpus=0, scheduling_strategy=here).remote() for _ in range(2)
    ]
    group = await init_trainer_group(ranks, backend="gloo")  # "nccl" with GPUs
    print(f"trainer group: {group.world_size} ranks, store at {group.host}:{group.port}")
    await on_every_rank([r.setup.remote(f"cpu:{i}") for i, r in enumerate(ranks)])

    devices = [f"cpu:{0 if all_on_rank0 else i % 2}" for i in range(2 * workers_per_rank)]
    policy_cls = ray.remote(Policy).options(num_cpus=0, scheduling_strategy=here)
    policies = [policy_cls.remote(d) for d in devices]
    sources = [RayTrainerSource(r, name=f"rank-{i}") for i, r in enumerate(ranks)]
    workers = [
        RayWorker(p, name=f"policy-{i}-{d}")
        for i, (p, d) in enumerate(zip(policies, devices, strict=True))
    ]
    try:
        async with RefitCoordinator(
            trainer=sources, workers=workers, budget_bytes=128 << 10, timeout=60
        ) as refit:
            for step in range(1, steps + 1):
                losses = await on_every_rank([r.train_step.remote(step) for r in ranks])
                report = await refit.push(version=step)  # every actor now holds `step`
                print(f"step {step}: loss {losses[0]:.4f}; {report}")
                want, also = await on_every_rank([r.full_state_digests.remote() for r in ranks])
                assert want == also, "the ranks gathered different states"
                for w in workers:
                    assert await w.parameter_digests() == want, f"{w.name} was not refit"
            print(f"verified: {len(workers)} actors hold version {refit.version}, bit for bit")
    finally:
        await destroy_trainer_group(ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--address", default=None, help="an existing cluster (e.g. auto)")
    parser.add_argument("--workers", type=int, default=1, help="inference actors per rank (1)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (3)")
    parser.add_argument(
        "--all-on-rank0", action="store_true", help="every worker on rank 0's device"
    )
    args = parser.parse_args()
    if args.address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
        ray.init(num_cpus=2, include_dashboard=False)
    else:
        ray.init(address=args.address)
    try:
        anyio.run(run, args.workers, args.all_on_rank0, args.steps)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
