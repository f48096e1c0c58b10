"""Coordinator fan-out: the cost of a push per worker per bucket, at 2 and 64 devices.

    python benchmarks/fanout_bench.py --repeats 5 [--no-local] [--json] [--record LABEL]

One run, all in one process (the coordinator's), torch at one thread (``--threads``):

- **parameter set**: ``--buckets`` buckets (16) of ``--tensors`` float32 tensors each
  (4), aligned, planned with bucket size = budget / 2 = the bucket's bytes, so the plan
  has exactly ``--buckets`` buckets and two are in flight;
- **devices**: every worker is on its own virtual device ``cpu:i``, filtered dispatch;
- **same bytes**: the 64-device variant has buckets of ``--bucket-kib`` KiB (256); the
  2-device variant delivers the same total bytes (64/2 = 32x larger buckets, 8 MiB),
  so the ratio 64-device / 2-device push compares the same bytes copied into workers.
  A third row, 2 devices with the small buckets, shows the per-worker cost at few
  workers for the same bytes per device;
- **in-process workers**: :class:`~asyncrefit.tools._inprocess.InProcessWorker`, the
  ``Worker`` protocol over a :class:`~asyncrefit.ParameterReceiver` (shared memory,
  copies for real, on the coordinator's loop: the copies serialize with the
  coordinator's own work);
- **local processes**: ``asyncrefit.local.spawn_local_workers`` (one thread each);
- one warm-up push, verified bitwise on every worker against the trainer, then
  ``--repeats`` timed pushes (wall clock around ``refit.push``, median), verified
  again after the last one.

**Coordinator CPU per worker per bucket** is the coordinator process's CPU time
(``time.process_time``: every thread, so the trainer's pack thread too) over a push,
less the CPU time of the byte copies the push makes in this process, divided by
workers x buckets; median over the timed pushes. The copies are measured by the
**copy replay**, run in one thread right before each timed push (so both see the same
machine; CPU time, ``time.thread_time``, so being descheduled on a shared machine
counts on neither side): the exact copies of one push (each bucket's tensors packed
into a bucket-sized flat buffer, two alternating like the slots, then, for in-process
workers, copied out of it into each worker's own parameter tensors, bucket after
bucket, worker after worker, as the push orders them), with every view made before
the clock starts; the two slot buffers are shared memory, as the trainer's are. For
local processes only the pack is subtracted (the workers'
copies are in their own processes). What is left is the coordinator's own work:
dispatch, bookkeeping, serialization, the receivers' validation and views (for
in-process workers), the event loop. The **memcpy limit** of a push is the whole
replay (pack and every worker's copies; scratch destinations for local workers),
wall clock, best of ``--replays`` (5), one thread: local workers copy in parallel on
the machine's cores, so their limit may be up to that many times lower.

The in-process rows also report the time spent inside ``ParameterReceiver.load`` (wall
clock per call, summed; it includes the copies) per worker per bucket.

``--record LABEL`` appends the run, headed by LABEL (``BEFORE``, ``AFTER``), to the
fan-out section of ``benchmarks/RESULTS.md``; ``--profile`` runs cProfile over the
64-device in-process pushes instead and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit import (
    LocalTrainer,
    ParamSpec,
    RefitCoordinator,
    cpu_device,
)
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.planning import plan_buckets
from asyncrefit.tools._inprocess import InProcessWorker
from asyncrefit.tools._machine import machine_info, machine_line
from asyncrefit.tools._table import append_to_section
from asyncrefit.tools.bench import module_from_specs
from asyncrefit.transport.shm import SharedMemoryExporter

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## Coordinator fan-out"
KIB = 1024
FLOAT32 = 4
ALIGNMENT = 256
TIMEOUT = 600.0


# --- the parameter set -----------------------------------------------------------------


def fanout_specs(buckets: int, tensors: int, bucket_bytes: int) -> list[ParamSpec]:
    """``buckets x tensors`` float32 tensors that fill buckets of ``bucket_bytes``."""
    each = bucket_bytes // tensors
    if each % ALIGNMENT or each < ALIGNMENT:
        raise ValueError(f"a bucket of {bucket_bytes} B cannot hold {tensors} aligned tensors")
    return [
        ParamSpec(name=f"layer{b}.t{t}", shape=(each // FLOAT32,), dtype="float32")
        for b in range(buckets)
        for t in range(tensors)
    ]


def zero_model(specs: Sequence[ParamSpec]) -> torch.nn.Module:
    """The workers' zeroed copy (picklable as a ``functools.partial``: a factory)."""
    torch.set_num_threads(1)
    return module_from_specs(specs)


# --- the in-process worker -------------------------------------------------------------


# --- the copy replay (the limit, and what is subtracted) -------------------------------


class CopyReplay:
    """The exact copies of one push, in one thread, without any coordination.

    Each bucket's tensors are packed into a bucket-sized flat buffer (two, alternating
    like the slots), then copied out of it into every destination's tensors
    (``destinations``: the in-process workers' parameters, or scratch sets as many
    as local workers), bucket after bucket, destination after destination, as a push
    orders them. The two buffers are shared memory, as the trainer's slots are. Every
    view is made here, before any clock starts. :meth:`close` frees the buffers.
    """

    def __init__(
        self,
        trainer: dict[str, torch.Tensor],
        specs: Sequence[ParamSpec],
        bucket_bytes: int,
        destinations: Sequence[dict[str, torch.Tensor]],
    ) -> None:
        plan = plan_buckets(specs, bucket_bytes=bucket_bytes, alignment=ALIGNMENT)
        # Shared memory like the trainer's slots (its pages are not huge pages).
        self._exporter = SharedMemoryExporter()
        self._exporter.allocate(2, bucket_bytes)
        slots = [self._exporter.buffer(i) for i in range(2)]
        self._packs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._loads: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for bucket in plan.buckets:
            slot = slots[bucket.index % 2]
            views = {
                e.name: slot[e.offset : e.offset + e.nbytes].view(torch.float32).view(e.shape)
                for e in bucket.entries
            }
            self._packs.append([(views[e.name], trainer[e.name]) for e in bucket.entries])
            self._loads.append(
                [(d[e.name], views[e.name]) for d in destinations for e in bucket.entries]
            )
        self.run(loads=True)  # warm: every destination touched

    def close(self) -> None:
        self._packs, self._loads = [], []
        self._exporter.close()

    def run(self, *, loads: bool) -> tuple[float, float]:
        """Replay the pack (and the loads); returns (thread CPU seconds, wall seconds)."""
        c, t = time.thread_time(), time.perf_counter()
        with torch.no_grad():
            for pack, load in zip(self._packs, self._loads, strict=True):
                for dst, src in pack:
                    dst.copy_(src)
                if loads:
                    for dst, src in load:
                        dst.copy_(src)
        return time.thread_time() - c, time.perf_counter() - t


# --- one variant -----------------------------------------------------------------------


@dataclass
class Variant:
    kind: str  # "in-process" or "local"
    workers: int
    bucket_bytes: int

    @property
    def key(self) -> str:
        return f"{self.kind} {self.workers} x {self.bucket_bytes // KIB} KiB"


async def _verify(trainer: dict[str, torch.Tensor], workers: Sequence[Any], key: str) -> None:
    want = {n: tensor_digest(t) for n, t in trainer.items()}
    for w in workers:
        got = await w.parameter_digests()
        if got != want:
            raise SystemExit(f"{key}: worker {w.name} does not hold the trainer's bytes")


async def run_variant(variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
    specs = fanout_specs(args.buckets, args.tensors, variant.bucket_bytes)
    gen = torch.Generator().manual_seed(variant.workers)
    trainer = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    inprocess = variant.kind == "in-process"
    if inprocess:
        workers: list[Any] = [
            InProcessWorker(
                name=f"w{i:02d}",
                device=cpu_device(i),
                parameters={s.name: torch.zeros(s.shape) for s in specs},
            )
            for i in range(variant.workers)
        ]
        return await _measure(variant, args, specs, trainer, workers)
    from asyncrefit.local import spawn_local_workers

    async with spawn_local_workers(
        functools.partial(zero_model, specs), variant.workers, start_timeout=TIMEOUT
    ) as local:
        return await _measure(variant, args, specs, trainer, local)


async def _measure(
    variant: Variant,
    args: argparse.Namespace,
    specs: list[ParamSpec],
    trainer: dict[str, torch.Tensor],
    workers: list[Any],
) -> dict[str, Any]:
    inprocess = variant.kind == "in-process"
    async with RefitCoordinator(
        trainer=LocalTrainer(trainer),
        workers=workers,
        budget_bytes=2 * variant.bucket_bytes,
        bucket_bytes=variant.bucket_bytes,
        alignment=ALIGNMENT,
        timeout=TIMEOUT,
    ) as refit:
        report = await refit.push(version=1)
        assert report.buckets == args.buckets, report.buckets
        await _verify(trainer, workers, variant.key)
        replay = CopyReplay(
            trainer,
            specs,
            variant.bucket_bytes,
            [w.parameters for w in workers] if inprocess else _scratch(specs, variant.workers),
        )
        walls: list[float] = []
        cpus: list[float] = []
        worker_cpus: list[float] = []  # local: the worker processes' CPU over a push
        copies: list[float] = []
        loads: list[float] = []
        handle_bytes = 0
        profiler = cProfile.Profile() if args.profile else None
        for r in range(args.repeats):
            # The copies to subtract, replayed right before each push: the pack and,
            # for in-process workers, their loads (local workers copy elsewhere).
            copies.append(replay.run(loads=inprocess)[0])
            for w in workers if inprocess else ():
                w.load_seconds = 0.0
            w0 = _workers_cpu(workers) if not inprocess else 0.0
            c, t = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            report = await refit.push(version=2 + r)
            if profiler is not None:
                profiler.disable()
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            if not inprocess:
                worker_cpus.append(_workers_cpu(workers) - w0)
            if inprocess:
                loads.append(sum(w.load_seconds for w in workers))
            handle_bytes = report.handle_bytes_per_worker[workers[0].name]
        await _verify(trainer, workers, variant.key)
        limit = min(replay.run(loads=True)[1] for _ in range(args.replays))
        replay.close()
    n, b = variant.workers, args.buckets
    own = [cpu - copy for cpu, copy in zip(cpus, copies, strict=True)]
    result: dict[str, Any] = {
        "kind": variant.kind,
        "workers": n,
        "buckets": b,
        "bucket_bytes": variant.bucket_bytes,
        "bytes_delivered": n * b * variant.bucket_bytes,
        "push_seconds": statistics.median(walls),
        "push_seconds_all": walls,
        "cpu_seconds": statistics.median(cpus),
        "copy_seconds": statistics.median(copies),
        "memcpy_limit_seconds": limit,
        "coordinator_us_per_worker_bucket": max(0.0, statistics.median(own)) / (n * b) * 1e6,
        "handle_bytes_per_worker": handle_bytes,
        "verified": True,
    }
    if inprocess:
        result["load_us_per_worker_bucket"] = statistics.median(loads) / (n * b) * 1e6
    else:
        result["workers_cpu_seconds"] = statistics.median(worker_cpus)
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
        result["profile"] = out.getvalue()
    return result


def _scratch(specs: Sequence[ParamSpec], n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` sets of destination tensors, as ``n`` workers hold them."""
    return [{s.name: torch.zeros(s.shape) for s in specs} for _ in range(n)]


# --- the run ---------------------------------------------------------------------------


def variants(args: argparse.Namespace) -> list[Variant]:
    small = args.bucket_kib * KIB
    many = max(args.workers)
    kinds = ["in-process"] + ([] if args.no_local else ["local"])
    out = []
    for kind in kinds:
        for n in sorted(args.workers):
            out.append(Variant(kind, n, small * many // n))  # same bytes delivered
            if n != many:
                out.append(Variant(kind, n, small))  # same bytes per device
    return out


async def run_all(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    machine = machine_info()  # the load before this run's own processes
    rows = []
    for v in variants(args):
        progress(f"{v.key} ...")
        rows.append(await run_variant(v, args))
    many = max(args.workers)
    ratios = {}
    for kind in {r["kind"] for r in rows}:
        delivered = rows[0]["bytes_delivered"]
        same = [r for r in rows if r["kind"] == kind and r["bytes_delivered"] == delivered]
        big = next(r for r in same if r["workers"] == many)
        for r in same:
            if r["workers"] != many:
                ratios[f"{kind} {many}/{r['workers']}"] = big["push_seconds"] / r["push_seconds"]
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "buckets": args.buckets,
        "tensors_per_bucket": args.tensors,
        "repeats": args.repeats,
        "rows": rows,
        "ratios": ratios,
    }


def format_table(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    lines = [
        f"fanout bench, {result['date']}",
        machine_line(m),
        f"{result['buckets']} buckets of {result['tensors_per_bucket']} float32 tensors, "
        f"budget 2 buckets, filtered, each worker on its own cpu:i; median of "
        f"{result['repeats']} timed pushes after 1 warm-up; verified bitwise",
        "",
        f"{'workers':<22}{'bucket':>9}{'MiB out':>9}{'push ms':>9}{'ms/bucket':>10}"
        f"{'x limit':>8}{'limit ms':>9}{'CPU ms':>8}{'copy ms':>8}{'coord us/w/b':>13}"
        f"{'load us/w/b':>12}{'handle B/w':>11}{'workers CPU ms':>15}",
    ]
    for r in result["rows"]:
        limit = r["memcpy_limit_seconds"]
        load = r.get("load_us_per_worker_bucket")
        lines.append(
            f"{r['kind'] + ' ' + str(r['workers']):<22}"
            f"{_size(r['bucket_bytes']):>9}{r['bytes_delivered'] / 2**20:>9.0f}"
            f"{r['push_seconds'] * 1e3:>9.1f}{r['push_seconds'] / r['buckets'] * 1e3:>10.2f}"
            f"{r['push_seconds'] / limit:>8.1f}{limit * 1e3:>9.1f}"
            f"{r['cpu_seconds'] * 1e3:>8.1f}{r['copy_seconds'] * 1e3:>8.1f}"
            f"{r['coordinator_us_per_worker_bucket']:>13.1f}"
            f"{(f'{load:.1f}' if load is not None else '-'):>12}"
            f"{r['handle_bytes_per_worker']:>11,}"
            + (
                f"{r['workers_cpu_seconds'] * 1e3:>15.0f}"
                if "workers_cpu_seconds" in r
                else f"{'-':>15}"
            )
        )
    lines.append("")
    lines.append(
        "ratio of pushes, same bytes delivered: "
        + ", ".join(f"{k} = {v:.2f}x" for k, v in sorted(result["ratios"].items()))
    )
    lines.append(
        "CPU: coordinator process CPU per push; copy: the replayed copies subtracted "
        "(in-process: pack + loads; local: pack); limit: the replay of every copy, one thread;"
    )
    lines.append(
        "workers CPU: the local worker processes' CPU over a push, all together (/proc, "
        "10 ms ticks)"
    )
    return f"`{command}`\n\n```\n" + "\n".join(lines) + "\n```\n"


def _workers_cpu(workers: Sequence[Any]) -> float:
    """CPU seconds (user + system) the worker processes used so far, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for w in workers:
        with open(f"/proc/{w.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n // KIB} KiB"


INTRO = f"""
{SECTION} (`benchmarks/fanout_bench.py`)

    .venv/bin/python benchmarks/fanout_bench.py --repeats 5 --record LABEL

What one run measures (see the script's docstring): 16 buckets of 4 float32 tensors,
budget 2 buckets, filtered dispatch, each worker on its own virtual device `cpu:i`;
in-process workers (the `Worker` protocol over `ParameterReceiver`, copying on the
coordinator's loop) and local worker processes, at 64 devices with 256 KiB buckets
and at 2 devices with the same bytes delivered (8 MiB buckets) and with the same bytes
per device (256 KiB buckets). Coordinator CPU per worker per bucket: the coordinator
process's `time.process_time()` over a push less the replayed copies of that push
(pack + in-process loads; pack only for local workers), over workers x buckets. Limit:
the replay of every copy of the push in one thread. Targets (issue 13): in-process
coordinator cost <= 50 us per worker per bucket at 64 x 16; 64-device push <= 3x the
2-device push for the same bytes (in-process and local).
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 64])
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--bucket-kib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-local", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--record", metavar="LABEL")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        args.workers, args.no_local = [max(args.workers)], True
    result = anyio.run(run_all, args, lambda s: print(s, file=sys.stderr, flush=True))
    command = "python benchmarks/fanout_bench.py " + " ".join(sys.argv[1:])
    for r in result["rows"]:
        if "profile" in r:
            print(r.pop("profile"))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result, command))
    if args.record:
        m = result["machine"]
        heading = (
            f"### {result['date'][:10]}, {args.record}: {m['cpu']}, {m['cores']} cores, "
            f"torch {m['torch']}, load {m['loadavg']}"
        )
        recorded = command.replace(f" --record {args.record}", " --record LABEL")
        text = f"\n{heading}\n\n{format_table(result, recorded)}"
        if SECTION not in RESULTS.read_text():
            text = INTRO + text
        append_to_section(RESULTS, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
