"""Sharded trainer refit on the CPU: fp32 FSDP2 shards on 2 gloo ranks, against plain bf16.

    python benchmarks/sharded_bench.py --size-mib 1024 --repeats 3 --record

The parameter set has Llama-2's tensors (16 layers, 147 tensors) scaled to about
``--size-mib`` MiB in float32; the intermediate size and the vocabulary are odd, so two
ranks split the MLP's gate and up projections, the embedding and the LM head unevenly.
The engine holds it in bfloat16: the payload is half the trainer's bytes. In one run:

- **memcpy** (the limit): the bf16 payload's tensors copied once into one flat buffer
  (``asyncrefit.tools.bench.measure_memcpy``, best of 5);
- **plain bf16**: the set as a bf16 module in this process, pushed by
  ``LocalTrainer`` into 2 local worker processes (virtual devices ``cpu:0`` and
  ``cpu:1``);
- **sharded fp32**: 2 rank processes over gloo, each holding its ``fully_shard``
  shards of the fp32 set (one FSDP unit per layer) behind a ``DTensorSource`` served
  by a ``RankServer``; this process is the coordinator (one ``RankSource`` per rank)
  and pushes into the same 2 workers, rank *r* serving ``cpu:r``. Every rank gathers
  every bucket into its own slot, cast to bf16 before the shards travel.

Both use buckets of a quarter of the payload (at most 256 MiB), 2 slots; one warm-up
push, then ``--repeats`` timed pushes, each after a stand-in for an optimizer step
(every parameter + 0.25, outside the timing), timed by wall clock around
``refit.push``. Every variant is verified: each worker's parameter digests must equal
the trainer's (the ranks gather the full tensors and cast them for that). Inside each
rank: the time its source spent packing (gather incl. cast, per bucket, summed) and
its peak extra resident memory during a push (``VmHWM`` after ``clear_refs``, less
``VmRSS`` before), against the bound budget + the largest fp32 tensor. The first push
also maps the staging slots (the budget); later pushes reuse them. glibc's allocator
keeps freed blocks, so resident peaks include temporaries of earlier buckets that it
did not hand back; ``--rank-mmap-threshold BYTES`` starts the ranks with
``MALLOC_MMAP_THRESHOLD_`` (blocks above it go back to the system when freed), so the
peaks show live memory. ``--threads`` sets torch's threads of this process (the plain
trainer's packing, memcpy); each rank packs with one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing
import os
import queue
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit import LocalTrainer, ParamSpec, RefitCoordinator, RefitReport
from asyncrefit._loop import backend_options
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import LocalWorker, spawn_local_workers
from asyncrefit.planning import plan_buckets
from asyncrefit.tools._machine import (
    free_port,
    machine_info,
    machine_line,
    reset_peak_rss,
    rss_bytes,
)
from asyncrefit.tools._table import (
    Column,
    append_to_section,
    recorded_command,
    results_section,
    table,
)
from asyncrefit.tools._verify import module_digests, verify_workers
from asyncrefit.tools.bench import (
    MIB,
    bucket_bytes_for,
    fill_random,
    llama_specs,
    measure_memcpy,
    module_from_specs,
    progress_line,
)
from asyncrefit.trainer import DTensorSource, RankSource, rank_path

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## Sharded trainer on the CPU"
LAYERS = 16
RANKS = 2
STEP = 0.25  # what the stand-in optimizer step adds to every parameter
TIMEOUT = 300.0  # coordinator and rank requests (a loaded 2-core machine is slow)
GATHER_TIMEOUT = 120.0  # each collective, below TIMEOUT


# --- the parameter set -----------------------------------------------------------------


def llama_like_specs(size_mib: int) -> list[ParamSpec]:
    """Llama-2's tensors at 16 layers, float32, about ``size_mib`` MiB in all.

    The hidden size is a multiple of 64 chosen from the size, the intermediate size
    is ~8/3 of it plus one (odd), and the vocabulary fills the rest (odd). Deterministic.
    """
    if size_mib < 1:
        raise ValueError(f"size_mib must be at least 1, got {size_mib}")
    target = size_mib * MIB
    # ~12 d^2 values per layer (4 attention, 3 MLP matrices), ~16 d^2 for a vocab of 8 d.
    d = max(64, int(math.sqrt(target / 4 / (12 * LAYERS + 16))) // 64 * 64)
    inter = (8 * d // 3) // 64 * 64 + 1
    rest = sum(s.nbytes for s in llama_specs(LAYERS, 0, d, inter, dtype="float32"))
    vocab = max(1, (target - rest) // (2 * 4 * d)) | 1
    return llama_specs(LAYERS, vocab, d, inter, dtype="float32")


def engine_model(size_mib: int) -> torch.nn.Module:
    """The engine's copy of the set, zeroed, in bf16 (the workers' factory)."""
    return module_from_specs(llama_like_specs(size_mib), dtype=torch.bfloat16)


def step_parameters(module: torch.nn.Module) -> None:
    """The stand-in optimizer step: every parameter (a rank's shards) + ``STEP``."""
    with torch.no_grad():
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(STEP)


# --- the rank processes ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankConfig:
    """What a rank process does: its group, the set, and how many pushes it serves."""

    port: int
    directory: str
    size_mib: int
    pushes: int
    mmap_threshold: int | None = None  # glibc's MALLOC_MMAP_THRESHOLD_ for the ranks


class TimedDTensorSource(DTensorSource):
    """A :class:`DTensorSource` that sums the seconds and counts of its bucket packs
    (each one: gather of every parameter of the bucket, cast, seal)."""

    pack_seconds = 0.0
    packs = 0

    def _pack_locked(self, bucket: Any, slot: int) -> int | None:
        start = time.perf_counter()
        try:
            return super()._pack_locked(bucket, slot)
        finally:
            self.pack_seconds += time.perf_counter() - start
            self.packs += 1


def _sharded_model(size_mib: int, rank: int, mesh: Any) -> torch.nn.Module:
    """The fp32 set, one FSDP2 unit per layer and the root, this rank's shards random."""
    from torch.distributed.fsdp import fully_shard

    model = module_from_specs(llama_like_specs(size_mib), device="meta")
    for i in range(LAYERS):
        fully_shard(model.get_submodule(f"model.layers.{i}"), mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=gen)  # type: ignore[attr-defined]
    return model


def _cast_seconds(model: torch.nn.Module) -> float:
    """Seconds to cast this rank's shards to bf16, one at a time (the cast alone)."""
    start = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            cast = p.to_local().to(torch.bfloat16)  # type: ignore[attr-defined]
            del cast
    return time.perf_counter() - start


def rank_main(rank: int, config: RankConfig, results: Any) -> None:
    """One trainer rank: shard the set, then serve ``config.pushes`` pushes, reporting
    each (pack seconds, serve seconds, peak extra memory); then the gathered digests."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from asyncrefit import cpu_device
    from asyncrefit.trainer import RankServer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config.port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        mesh = init_device_mesh("cpu", (RANKS,))
        model = _sharded_model(config.size_mib, rank, mesh)
        local_bytes = sum(p.to_local().nbytes for p in model.parameters())  # type: ignore[attr-defined]
        results.put(("cast", rank, _cast_seconds(model), local_bytes))
        source = TimedDTensorSource(
            model, devices=[cpu_device(rank)], timeout=GATHER_TIMEOUT, name=f"rank-{rank}"
        )
        server = RankServer(source, rank_path(config.directory, rank))

        async def serve() -> None:
            async with server:
                for push in range(config.pushes):
                    step_parameters(model)
                    results.put(("ready", rank, push))
                    source.pack_seconds, source.packs = 0.0, 0
                    reset_peak_rss()
                    before, _ = rss_bytes()
                    modules = len(sys.modules)
                    start = time.perf_counter()
                    outcome = await server.serve_push()
                    serve_seconds = time.perf_counter() - start
                    after, peak = rss_bytes()
                    stats = {
                        "pack_seconds": source.pack_seconds,
                        "packs": source.packs,
                        "serve_seconds": serve_seconds,
                        "extra_bytes": peak - before,
                        "rss_bytes": before,
                        "rss_after_bytes": after,
                        # modules first imported during this push (their code is
                        # resident memory too, once)
                        "modules_imported": len(sys.modules) - modules,
                    }
                    results.put(("push", rank, push, stats))
                    if outcome.closed:
                        return
                expected = {
                    name: tensor_digest(p.full_tensor().to(torch.bfloat16))  # type: ignore[attr-defined]
                    for name, p in model.named_parameters()
                }
                if rank == 0:
                    results.put(("expected", expected))
                while not (await server.serve_push()).closed:
                    pass

        anyio.run(serve)
    finally:
        dist.destroy_process_group()


class Inbox:
    """The ranks' reports, taken by kind (others are kept for later)."""

    def __init__(self, results: Any) -> None:
        self._results = results
        self._pending: list[tuple[Any, ...]] = []

    def _take(self, kind: str, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            for i, item in enumerate(self._pending):
                if item[0] == kind:
                    return self._pending.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind!r} from the trainer ranks in {timeout} s")
            with contextlib.suppress(queue.Empty):
                self._pending.append(self._results.get(timeout=min(left, 1.0)))

    async def take(self, kind: str, within: float = TIMEOUT) -> tuple[Any, ...]:
        """The next report of ``kind``, waited for (off the event loop) up to ``within`` s."""
        return await anyio.to_thread.run_sync(self._take, kind, within)


@contextlib.contextmanager
def rank_processes(config: RankConfig) -> Iterator[tuple[list[Any], Inbox]]:
    """Start the rank processes; on exit wait for them (kill stragglers)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=rank_main, args=(r, config, results), daemon=True)
        for r in range(RANKS)
    ]
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    try:
        if config.mmap_threshold is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(config.mmap_threshold)
        for p in processes:
            p.start()  # spawned: a fresh interpreter, with this environment
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    try:
        yield processes, Inbox(results)
    finally:
        for p in processes:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
        results.close()
        results.join_thread()


# --- the variants ----------------------------------------------------------------------


def _median_index(times: Sequence[float]) -> int:
    return sorted(range(len(times)), key=lambda i: times[i])[(len(times) - 1) // 2]


def _summary(times: list[float], reports: list[RefitReport]) -> dict[str, Any]:
    i = _median_index(times)
    report = reports[i]
    return {
        "seconds": times[i],
        "seconds_all": times,
        "spread": (max(times) - min(times)) / times[i],
        "gbps": report.bytes / times[i] / 1e9,
        "bytes": report.bytes,
        "buckets": report.buckets,
        "slots": report.slots,
        "slot_bytes": report.slot_bytes,
        "stages": asdict(report.stages),
        "median_push": i,
        "verified": True,
    }


async def run_plain(
    size_mib: int, workers: Sequence[LocalWorker], bucket: int, budget: int, repeats: int
) -> dict[str, Any]:
    """The set as a bf16 module in this process, pushed by a LocalTrainer."""
    module = await anyio.to_thread.run_sync(engine_model, size_mib)
    await anyio.to_thread.run_sync(fill_random, module, 1)
    times: list[float] = []
    reports: list[RefitReport] = []
    async with RefitCoordinator(
        trainer=LocalTrainer(module),
        workers=workers,
        budget_bytes=budget,
        bucket_bytes=bucket,
        timeout=TIMEOUT,
    ) as refit:
        for push in range(1 + repeats):
            await anyio.to_thread.run_sync(step_parameters, module)
            start = time.perf_counter()
            report = await refit.push(1 + push)
            if push:  # the first one is the warm-up
                times.append(time.perf_counter() - start)
                reports.append(report)
    expected = await anyio.to_thread.run_sync(module_digests, module)
    await verify_workers(workers, expected, what="plain bf16")
    result = _summary(times, reports)
    memcpy = await anyio.to_thread.run_sync(
        measure_memcpy, [p.detach() for p in module.parameters()]
    )
    result["memcpy"] = asdict(memcpy)
    return result


async def run_sharded(
    size_mib: int,
    workers: Sequence[LocalWorker],
    bucket: int,
    budget: int,
    repeats: int,
    say: Any,
    mmap_threshold: int | None = None,
) -> dict[str, Any]:
    """The fp32 set as FSDP2 shards on 2 gloo rank processes, this process coordinating."""
    with tempfile.TemporaryDirectory() as directory:
        config = RankConfig(
            port=free_port(),
            directory=directory,
            size_mib=size_mib,
            pushes=1 + repeats,
            mmap_threshold=mmap_threshold,
        )
        with rank_processes(config) as (processes, inbox):
            casts = sorted([await inbox.take("cast") for _ in range(RANKS)])
            say("ranks are sharded; pushing")
            sources = [RankSource(rank_path(directory, r), timeout=TIMEOUT) for r in range(RANKS)]
            times: list[float] = []
            reports: list[RefitReport] = []
            ranks: list[list[dict[str, Any]]] = []
            async with RefitCoordinator(
                trainer=sources,
                workers=workers,
                budget_bytes=budget,
                bucket_bytes=bucket,
                timeout=TIMEOUT,
            ) as refit:
                for push in range(1 + repeats):
                    for _ in range(RANKS):
                        await inbox.take("ready")  # each rank made its step
                    start = time.perf_counter()
                    report = await refit.push(1 + push)
                    seconds = time.perf_counter() - start
                    stats = sorted([await inbox.take("push") for _ in range(RANKS)])
                    ranks.append([s[3] for s in stats])
                    if push:
                        times.append(seconds)
                        reports.append(report)
                say("gathering the ranks' full state to verify")
                _, expected = await inbox.take("expected")
                await verify_workers(workers, expected, what="sharded fp32")
        codes = [p.exitcode for p in processes]
        if codes != [0] * RANKS:
            raise RuntimeError(f"rank processes exited with {codes}")
    result = _summary(times, reports)
    i = result["median_push"]
    result["warmup_ranks"] = ranks[0]
    result["ranks"] = ranks[1:]
    result["median_ranks"] = ranks[1 + i]
    result["rank_cast_seconds"] = [c[2] for c in casts]
    result["rank_local_bytes"] = [c[3] for c in casts]
    return result


async def run_bench(
    size_mib: int,
    repeats: int,
    *,
    threads: int | None = None,
    mmap_threshold: int | None = None,
    say: Any = progress_line,
) -> dict[str, Any]:
    """The whole benchmark once; a JSON-ready dict.

    ``threads`` sets torch's intra-op threads of this process (the plain trainer's
    packing and memcpy) for the run; the ranks use one each. ``mmap_threshold`` sets
    glibc's ``MALLOC_MMAP_THRESHOLD_`` in the rank processes: allocations above it are
    returned to the system when freed, so the resident peak shows live memory only.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return await _run_bench(size_mib, repeats, mmap_threshold, say)
    finally:
        torch.set_num_threads(before)


async def _run_bench(
    size_mib: int, repeats: int, mmap_threshold: int | None, say: Any
) -> dict[str, Any]:
    import datetime

    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = machine_info()
    specs = llama_like_specs(size_mib)
    wire = [ParamSpec(name=s.name, shape=s.shape, dtype="bfloat16") for s in specs]
    payload = sum(s.nbytes for s in wire)
    bucket = bucket_bytes_for(payload)
    plan = plan_buckets(wire, bucket)
    budget = 2 * plan.max_bucket_bytes
    largest = max(s.nbytes for s in specs)
    odd = [s.name for s in specs if s.shape[0] % RANKS]
    say(
        f"{len(specs)} fp32 tensors, {sum(s.nbytes for s in specs) / MIB:.0f} MiB "
        f"({payload / MIB:.0f} MiB in bf16); starting 2 workers"
    )
    async with spawn_local_workers(
        functools.partial(engine_model, size_mib), 2, devices=["cpu:0", "cpu:1"]
    ) as workers:
        say("sharded fp32: starting 2 rank processes")
        sharded = await run_sharded(size_mib, workers, bucket, budget, repeats, say, mmap_threshold)
        say("plain bf16 module")
        plain = await run_plain(size_mib, workers, bucket, budget, repeats)
    extra_later = max(r["extra_bytes"] for push in sharded["ranks"] for r in push)
    extra_first = max(r["extra_bytes"] for r in sharded["warmup_ranks"])
    last = sharded["ranks"][-1]
    kept = max(
        r["rss_after_bytes"] - w["rss_bytes"]
        for r, w in zip(last, sharded["warmup_ranks"], strict=True)
    )
    return {
        "date": date,
        "machine": machine,
        "size_mib": size_mib,
        "tensors": len(specs),
        "layers": LAYERS,
        "hidden": specs[0].shape[1],
        "vocab": specs[0].shape[0],
        "intermediate": specs[5].shape[0],
        "uneven_tensors": len(odd),
        "trainer_bytes": sum(s.nbytes for s in specs),
        "payload_bytes": payload,
        "ranks": RANKS,
        "workers": 2,
        "bucket_bytes": bucket,
        "budget_bytes": budget,
        "largest_fp32_tensor_bytes": largest,
        "memory_bound_bytes": budget + largest,
        "peak_extra_first_push_bytes": extra_first,
        "peak_extra_later_pushes_bytes": extra_later,
        "rank_rss_growth_bytes": kept,
        "rank_mmap_threshold": mmap_threshold,
        "within_bound": max(extra_first, extra_later) <= budget + largest,
        "repeats": repeats,
        "memcpy_gbps": plain["memcpy"]["gbps"],
        "plain": plain,
        "sharded": sharded,
        "sharded_over_plain": sharded["seconds"] / plain["seconds"],
    }


# --- output ----------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    """The result as a plain-text table with the machine it ran on."""
    plain, sharded = result["plain"], result["sharded"]
    payload = result["payload_bytes"]
    memcpy = result["memcpy_gbps"]
    lines = [
        f"sharded refit bench, {result['date']}",
        machine_line(result["machine"]),
        f"set: {result['tensors']} fp32 tensors (Llama-2 layout, {result['layers']} layers, "
        f"hidden {result['hidden']}, intermediate {result['intermediate']}, vocab "
        f"{result['vocab']}; {result['uneven_tensors']} split unevenly over "
        f"{result['ranks']} ranks), {result['trainer_bytes'] / MIB:.0f} MiB; payload "
        f"{payload / MIB:.0f} MiB bf16; 2 worker processes; bucket "
        f"{result['bucket_bytes'] / MIB:.0f} MiB, {plain['slots']} slots; median of "
        f"{result['repeats']} timed pushes after 1 warm-up",
        "",
    ]
    columns = (
        Column("variant", 40, left=True),
        Column("push s", 8, ".3f"),
        Column("spread", 9, ".0%"),
        Column("GB/s", 7, ".2f"),
        Column("x memcpy", 10, ".2f"),
        Column("buckets", 9),
    )
    rows: list[tuple[object, ...]] = [
        ("memcpy, bf16 tensors into flat buffer", payload / memcpy / 1e9, "-", memcpy, 1.0, "-")
    ]
    rows += [
        (label, r["seconds"], r["spread"], r["gbps"], r["gbps"] / memcpy, r["buckets"])
        for label, r in (
            ("plain bf16 module, LocalTrainer", plain),
            (f"fp32 FSDP2 shards, {result['ranks']} gloo ranks -> bf16", sharded),
        )
    ]
    lines += table(columns, rows)
    lines += [
        "",
        "spread: (max - min) / median of the timed pushes; GB/s: bf16 payload / push seconds",
        f"sharded / plain push time: {result['sharded_over_plain']:.2f}x",
        "",
        "sharded, median push, per rank (s): "
        + "; ".join(
            f"rank {r}: gather incl. cast {s['pack_seconds']:.3f} ({s['packs']} buckets, "
            f"{s['pack_seconds'] / sharded['seconds']:.0%} of the push), other "
            f"{s['serve_seconds'] - s['pack_seconds']:.3f} (waiting for the coordinator "
            f"and the workers)"
            for r, s in enumerate(sharded["median_ranks"])
        ),
        "cast alone, each rank's fp32 shards to bf16 (s): "
        + ", ".join(f"{c:.3f}" for c in sharded["rank_cast_seconds"]),
    ]
    for label, r in (("plain", plain), ("sharded", sharded)):
        stages = ", ".join(f"{k} {v:.3f}" for k, v in r["stages"].items())
        lines.append(
            f"coordinator stages, {label} (s; pack and load are sums over buckets): {stages}"
        )
    bound = result["memory_bound_bytes"]

    def verdict(extra: int) -> str:
        return "within" if extra <= bound else "EXCEEDED"

    first = result["peak_extra_first_push_bytes"]
    later = result["peak_extra_later_pushes_bytes"]
    lines += [
        "",
        f"peak extra memory per rank during a push (MiB), bound {bound / MIB:.1f} = budget "
        f"{result['budget_bytes'] / MIB:.1f} + largest fp32 tensor "
        f"{result['largest_fp32_tensor_bytes'] / MIB:.1f}:",
        "  first push (maps the slots): "
        + ", ".join(f"{r['extra_bytes'] / MIB:.1f}" for r in sharded["warmup_ranks"])
        + f" ({verdict(first)}; modules first imported during it: "
        + ", ".join(str(r.get("modules_imported", "?")) for r in sharded["warmup_ranks"])
        + ")",
        "  later pushes, max: "
        + ", ".join(
            f"{max(p[r]['extra_bytes'] for p in sharded['ranks']) / MIB:.1f}"
            for r in range(result["ranks"])
        )
        + f" ({verdict(later)})",
        f"  resident after the last push, over before the first: "
        f"{result['rank_rss_growth_bytes'] / MIB:.1f} (the slots, and freed memory the "
        "allocator keeps)",
        "  rank allocator: "
        + (
            f"MALLOC_MMAP_THRESHOLD_={result['rank_mmap_threshold']} (freed blocks above it "
            "go back to the system: the peaks are live memory)"
            if result["rank_mmap_threshold"] is not None
            else "glibc's default (it keeps freed blocks; the peaks include them)"
        ),
    ]
    return "\n".join(lines)


def record(result: dict[str, Any], command: str, path: Path = RESULTS) -> None:
    """Add a dated section with ``result``'s table and JSON under :data:`SECTION`."""
    m = result["machine"]
    title = (
        f"{result['date'][:10]}: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
        f"load {m['loadavg']}"
    )
    append_to_section(path, SECTION, results_section(title, command, format_table(result), result))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print it, and record it if asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--size-mib", type=int, default=512, help="fp32 size of the trainer's set (512)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per variant (3)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads of the coordinator"
    )
    parser.add_argument(
        "--rank-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="glibc MALLOC_MMAP_THRESHOLD_ of the rank processes (peaks then show live memory)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--record", action="store_true", help=f"append to {RESULTS.name}")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be positive")
    result = anyio.run(
        functools.partial(
            run_bench,
            args.size_mib,
            args.repeats,
            threads=args.threads,
            mmap_threshold=args.rank_mmap_threshold,
        ),
        backend="asyncio",
        backend_options=backend_options(),
    )
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    if args.record:
        record(result, recorded_command("benchmarks/sharded_bench.py", argv))
        print(f"recorded in {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
