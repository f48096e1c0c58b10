"""The cost of the cast on one GPU: a one-rank DTensor source (fp32 -> bf16) against bf16.

    python benchmarks/sharded_gpu_bench.py --out sharded_gpu.json       # one GPU, Llama-2-7B
    python benchmarks/sharded_gpu_bench.py --device cpu --layers 2 --hidden 256 \\
        --inter 688 --vocab 1000 --repeats 2                         # the code path, on the CPU
    python benchmarks/sharded_gpu_bench.py --record-from sharded_gpu.json   # to RESULTS.md

The trainer (this process) is rank 0 of a world of one (NCCL on the GPU, gloo with
``--device cpu``): the parameters of Llama-2-7B (291 tensors) in float32, sharded by
FSDP2's ``fully_shard`` over a device mesh of size 1 (one unit per layer), behind a
``DTensorSource``; beside it the same shapes as a plain bfloat16 module behind a
``LocalTrainer``. Both push, in the same run and into the same consumer process on the
same GPU (CUDA IPC; shared memory with ``--device cpu``), holding the set in bf16:
the DTensor source casts fp32 to bf16 as it packs each bucket, the plain one copies.
Buckets of ``--bucket-mib`` (1024), 2 slots (ping-pong).

Each variant runs in ``--rounds`` rounds (2; the order alternates), each a fresh
coordinator with one warm-up push and ``--repeats`` timed pushes, each after a
stand-in for an optimizer step (every parameter + 0.25) and a device synchronize:
wall clock around the whole ``refit.push`` on the trainer's side; median over all
rounds. After each round the consumer's parameters are compared with the trainer's
(cast to bf16) by a checksum per tensor. In the same run, the limits, by CUDA events
(perf_counter on the CPU): the bf16 tensors copied once into one flat buffer (pack),
that and copied out again (pack + load: the two-copy limit), and the fp32 tensors
cast into the flat bf16 buffer (the cast pack); the cast's two-copy limit is the cast
pack plus the load.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
from cuda_ipc_bench import checksums, flat_views, median_ms

from asyncrefit import DeviceId, LocalTrainer, RefitCoordinator, RefitReport, cpu_device
from asyncrefit._core._plan import ParamSpec, plan_buckets
from asyncrefit._loop import backend_options
from asyncrefit.local import LocalWorker, spawn_local_workers
from asyncrefit.tools._machine import free_port, machine_info
from asyncrefit.tools._table import Column, append_to_section, results_section, table
from asyncrefit.tools.bench import llama_specs, median_push, module_from_specs
from asyncrefit.trainer import DTensorSource
from asyncrefit.transport._base import Exporter

MIB = 2**20
RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## Sharded (DTensor) source on one GPU"
STEP = 0.25  # what the stand-in optimizer step adds to every parameter


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """The Llama-2 shapes (defaults: Llama-2-7B)."""

    layers: int = 32
    vocab: int = 32000
    hidden: int = 4096
    inter: int = 11008

    def specs(self, dtype: str) -> list[ParamSpec]:
        return llama_specs(self.layers, self.vocab, self.hidden, self.inter, dtype=dtype)


# --- the models -------------------------------------------------------------------------


class Consumer(torch.nn.Module):
    """The engine's copy; ``forward`` returns the checksums of its parameters."""

    def forward(self, x: Any = None) -> torch.Tensor:
        return checksums(list(self.parameters()))


def consumer_model(shape: Shape, device: str) -> torch.nn.Module:
    """The consumer's bf16 parameters, zeroed, on ``device`` (the worker's factory)."""
    return module_from_specs(
        shape.specs("bfloat16"), dtype=torch.bfloat16, device=device, root=Consumer()
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = p.to_local() if hasattr(p, "to_local") else p
    return local


def fill(module: torch.nn.Module, seed: int, device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            _local(p).normal_(generator=gen)


def step_parameters(module: torch.nn.Module) -> None:
    """The stand-in optimizer step: every parameter (its local shard) + ``STEP``."""
    with torch.no_grad():
        for p in module.parameters():
            _local(p).add_(STEP)


def sharded_model(shape: Shape, device: str, mesh: Any) -> torch.nn.Module:
    """The fp32 set under ``fully_shard`` on ``mesh`` (one unit per layer), random."""
    from torch.distributed.fsdp import fully_shard

    model = module_from_specs(shape.specs("float32"), device="meta")
    for i in range(shape.layers):
        fully_shard(model.get_submodule(f"model.layers.{i}"), mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    fill(model, 1, device)
    return model


def expected_checksums(module: torch.nn.Module) -> torch.Tensor:
    """:func:`checksums` of every parameter as the engine must hold it (bf16)."""
    with torch.no_grad():
        return torch.cat([checksums([_local(p).to(torch.bfloat16)]) for p in module.parameters()])


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


# --- the limits -------------------------------------------------------------------------


def measure_limits(
    bf16: Sequence[torch.Tensor], fp32: Sequence[torch.Tensor], repeats: int, device: str
) -> dict[str, float]:
    """Copy times (ms) of the payload on ``device``: one pack, pack + load, cast pack.

    The flat buffer is packed as the planner packs (256-byte aligned); it and the
    second set of bf16 tensors (the load's destination) are freed afterwards.
    """
    one, two, cast = _limit_times(bf16, fp32, repeats, device)
    if device != "cpu":
        torch.cuda.empty_cache()
    return {
        "one_copy_ms": one,
        "two_copies_ms": two,
        "cast_copy_ms": cast,
        "cast_two_copies_ms": cast + (two - one),  # the cast pack, then the same load
    }


def _limit_times(
    bf16: Sequence[torch.Tensor], fp32: Sequence[torch.Tensor], repeats: int, device: str
) -> tuple[float, float, float]:
    _, views = flat_views(bf16, device)
    second = [torch.empty_like(p) for p in bf16]

    def pack() -> None:
        for v, p in zip(views, bf16, strict=True):
            v.copy_(p)

    def pack_and_load() -> None:
        pack()
        for s, v in zip(second, views, strict=True):
            s.copy_(v)

    def cast_pack() -> None:
        for v, p in zip(views, fp32, strict=True):
            v.copy_(p)

    with torch.no_grad():
        return (
            median_ms(pack, repeats, device),
            median_ms(pack_and_load, repeats, device),
            median_ms(cast_pack, repeats, device),
        )


# --- the variants -----------------------------------------------------------------------


async def run_round(
    name: str,
    source: LocalTrainer,
    module: torch.nn.Module,
    worker: LocalWorker,
    *,
    bucket_bytes: int,
    budget_bytes: int,
    repeats: int,
    device: str,
) -> list[tuple[float, RefitReport]]:
    """One coordinator: a warm-up push and ``repeats`` timed pushes; then verify."""
    timed: list[tuple[float, RefitReport]] = []
    async with RefitCoordinator(
        trainer=source,
        workers=[worker],
        budget_bytes=budget_bytes,
        bucket_bytes=bucket_bytes,
        timeout=300.0,
    ) as refit:
        for push in range(1 + repeats):
            step_parameters(module)
            synchronize(device)
            start = time.perf_counter()
            report = await refit.push(1 + push)
            seconds = time.perf_counter() - start
            if push:  # the first push is the warm-up
                timed.append((seconds, report))
    want = expected_checksums(module)
    got = await worker.forward(None)
    if not torch.equal(got, want):
        bad = int((got != want).any(dim=1).sum())
        raise RuntimeError(f"{name}: the consumer differs from the trainer in {bad} tensors")
    return timed


def _summary(timed: list[tuple[float, RefitReport]], limits: dict[str, float]) -> dict[str, Any]:
    seconds = [s for s, _ in timed]
    median, report = median_push(timed)
    ms = median * 1e3
    return {
        "ms": ms,
        "ms_all": [s * 1e3 for s in seconds],
        "min_ms": min(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "gbps": report.bytes / median / 1e9,
        "x_two_copy_limit": limits["two_copies_ms"] / ms,
        "bytes": report.bytes,
        "buckets": report.buckets,
        "slots": report.slots,
        "slot_bytes": report.slot_bytes,
        "stages_ms": {k: v * 1e3 for k, v in dataclasses.asdict(report.stages).items()},
        "verified": True,
    }


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device: str = args.device
    shape = Shape(args.layers, args.vocab, args.hidden, args.inter)
    backend = args.backend or ("gloo" if device == "cpu" else "nccl")
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(gpu=device != "cpu"),
        "device": device,
        "backend": backend,
        "shape": dataclasses.asdict(shape),
        "repeats": args.repeats,
        "rounds": args.rounds,
        "bucket_bytes": args.bucket_mib * MIB,
    }
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        say("building the trainer's parameters (fp32 DTensor, plain bf16)")
        sharded = sharded_model(shape, device, mesh)
        plain = module_from_specs(shape.specs("bfloat16"), device=device)
        fill(plain, 2, device)
        fp32 = [_local(p).detach() for p in sharded.parameters()]
        bf16 = [p.detach() for p in plain.parameters()]
        placements = {str(getattr(p, "placements", None)) for p in sharded.parameters()}
        result.update(
            tensors=len(bf16),
            bytes=sum(p.nbytes for p in bf16),
            fp32_bytes=sum(p.nbytes for p in fp32),
            placements=sorted(placements),
            mesh=str(mesh),
        )
        say("measuring the copy limits")
        result["limit"] = limits = measure_limits(bf16, fp32, max(5, args.repeats), device)
        del fp32, bf16

        exporters: dict[str, Exporter | None] = {"plain": None, "dtensor": None}
        dev: DeviceId = cpu_device(0)
        if device != "cpu":
            from asyncrefit.transport.cuda_ipc import CudaIpcExporter

            plain_exporter, dtensor_exporter = CudaIpcExporter(0), CudaIpcExporter(0)
            exporters = {"plain": plain_exporter, "dtensor": dtensor_exporter}
            dev = plain_exporter.device_id
        sources: dict[str, tuple[LocalTrainer, torch.nn.Module]] = {
            "plain": (LocalTrainer(plain, exporter=exporters["plain"], devices=[dev]), plain),
            "dtensor": (
                DTensorSource(sharded, exporter=exporters["dtensor"], devices=[dev]),
                sharded,
            ),
        }
        wire = shape.specs("bfloat16")
        bucket = args.bucket_mib * MIB
        budget = 2 * plan_buckets(wire, bucket).max_bucket_bytes
        result["budget_bytes"] = budget

        async def pushes() -> dict[str, list[tuple[float, RefitReport]]]:
            timed: dict[str, list[tuple[float, RefitReport]]] = {k: [] for k in sources}
            factory = functools.partial(consumer_model, shape, device)
            async with spawn_local_workers(factory, 1, devices=[dev]) as workers:
                for r in range(args.rounds):
                    order = list(sources) if r % 2 == 0 else list(reversed(sources))
                    for name in order:
                        say(f"round {r + 1}: {name}")
                        source, module = sources[name]
                        timed[name] += await run_round(
                            name,
                            source,
                            module,
                            workers[0],
                            bucket_bytes=bucket,
                            budget_bytes=budget,
                            repeats=args.repeats,
                            device=device,
                        )
            return timed

        timed = anyio.run(pushes, backend="asyncio", backend_options=backend_options())
        result["plain"] = _summary(timed["plain"], limits)
        result["dtensor"] = _summary(timed["dtensor"], limits)
        result["ratio"] = result["dtensor"]["ms"] / result["plain"]["ms"]
        result["limit_ratio"] = limits["cast_two_copies_ms"] / limits["two_copies_ms"]
    finally:
        dist.destroy_process_group()
    return result


# --- output -----------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    m, lim, shape = result["machine"], result["limit"], result["shape"]
    nbytes = result["bytes"]
    where = (
        f"{m['gpu']}, driver {m['driver']}, torch {m['torch']} (CUDA {m['cuda']}), "
        f"Python {m['python']}"
        if "gpu" in m
        else f"{m['cpu']} (CPU), torch {m['torch']}, Python {m['python']}"
    )
    pushes = result["repeats"] * result["rounds"]
    lines = [
        f"sharded (DTensor) source, {result['date']}: {where}",
        f"{result['tensors']} tensors (Llama-2 shapes, {shape['layers']} layers, hidden "
        f"{shape['hidden']}): trainer fp32 {result['fp32_bytes'] / 1e9:.2f} GB as DTensors "
        f"({', '.join(result['placements'])}) on a mesh of 1 ({result['backend']}); plain bf16 "
        f"{nbytes / 1e9:.2f} GB; 1 consumer on the same device; bucket "
        f"{result['bucket_bytes'] / MIB:.0f} MiB, {result['plain']['slots']} slots; median of "
        f"{pushes} pushes ({result['rounds']} rounds of {result['repeats']}, 1 warm-up each)",
        "",
    ]
    for label, key in (
        ("limit, 1 copy (bf16 pack)", "one_copy_ms"),
        ("limit, 1 cast copy (fp32 -> bf16 pack)", "cast_copy_ms"),
        ("limit, 2 copies (pack + load)", "two_copies_ms"),
        ("limit, cast pack + load", "cast_two_copies_ms"),
    ):
        ms = lim[key]
        lines.append(f"{label:<40}{ms:>9.2f} ms {nbytes / ms / 1e6:>7.0f} GB/s")
    columns = (
        Column("variant", 34, left=True),
        Column("ms", 9, ".2f"),
        Column("min", 9, ".2f"),
        Column("max", 9, ".2f"),
        Column("GB/s", 7, ".0f"),
        Column("x 2-copy limit", 16, ".2f"),
        Column("buckets", 9),
    )
    rows = [
        (label, r["ms"], r["min_ms"], r["max_ms"], r["gbps"], r["x_two_copy_limit"], r["buckets"])
        for label, r in (
            ("plain bf16, LocalTrainer", result["plain"]),
            ("DTensor fp32 -> bf16", result["dtensor"]),
        )
    ]
    lines += ["", *table(columns, rows)]
    lines += [
        "",
        f"cast cost: DTensor / plain push time = {result['ratio']:.2f}x "
        f"(limits: cast pack + load / 2 copies = {result['limit_ratio']:.2f}x)",
    ]
    for label, key in (("plain", "plain"), ("DTensor", "dtensor")):
        stages = ", ".join(f"{k} {v:.2f}" for k, v in result[key]["stages_ms"].items())
        lines.append(f"stages, {label}, median push (ms): {stages}")
    return "\n".join(lines)


def record(result: dict[str, Any], command: str, path: Path = RESULTS) -> None:
    """Add a dated section with ``result``'s table and JSON under :data:`SECTION`."""
    m = result["machine"]
    title = m.get("gpu", m.get("cpu", "?"))
    heading = f"{result['date'][:10]}: {title}, torch {m['torch']}"
    append_to_section(
        path, SECTION, results_section(heading, command, format_table(result), result)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=11008)
    parser.add_argument("--bucket-mib", type=int, default=1024, help="bucket size (1024)")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per round (5)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per variant (2)")
    parser.add_argument("--out", type=str, default=None, help="write the JSON here")
    parser.add_argument(
        "--record-from",
        type=str,
        default=None,
        help=f"append the results of this JSON file to {RESULTS.name} (runs nothing)",
    )
    parser.add_argument(
        "--command", type=str, default=None, help="the command to record (with --record-from)"
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help=f"where to record (the {RESULTS.name} here)"
    )
    args = parser.parse_args(argv)
    if args.record_from:
        with open(args.record_from) as f:
            result = json.load(f)
        command = args.command or "python benchmarks/sharded_gpu_bench.py --out sharded_gpu.json"
        record(result, command, args.results)
        print(format_table(result))
        print(f"recorded in {args.results}", file=sys.stderr)
        return 0
    if args.repeats < 1 or args.rounds < 1 or args.bucket_mib < 1:
        parser.error("--repeats, --rounds and --bucket-mib must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sharded_gpu_bench: needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2

    def say(message: str) -> None:
        print(f"[sharded-gpu-bench] {message}", file=sys.stderr, flush=True)

    result = run(args, say)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
