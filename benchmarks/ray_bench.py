"""Ray fan-out benchmark: push time, handle bytes and driver CPU, per-call vs stream.

    python benchmarks/ray_bench.py --counts 4,16,32 --size-mib 16 --repeats 3 [--markdown]
    python benchmarks/ray_bench.py --record      # append the run to benchmarks/RESULTS.md

Starts a local Ray cluster (``--address`` joins an existing one), one trainer actor and
max(counts) zero-CPU inference actors, each on its own virtual device (``cpu:00``,
``cpu:01``, ...), all on one node. For each count N and each variant it opens a
coordinator over the first N actors, pushes once to warm up and verifies every
actor's parameters bitwise, then times ``--repeats`` pushes. The variants:

- ``per-call filtered``: ``RayWorker(stream=False)``, one actor call per worker per
  bucket (``refit_load``), each actor sent only its own device's handle;
- ``per-call broadcast``: the same, every actor sent the handles of all N devices (the
  behaviour before filtering);
- ``stream filtered``: ``RayWorker()`` (the default), one actor call per worker for as
  long as the coordinator keeps it (``refit_stream``, made by the warm-up push), every
  push's requests and acks as frames on its TCP stream, handles by reference.
- ``direct filtered``: the stream, into a second set of actors started with
  ``init_refit(shared_parameters=True)``: the trainer actor writes every bucket into
  all of them (one actor call per bucket), and each actor gets a begin and a commit
  per push on its stream.

Reported per row: median push time, aggregate payload rate (bytes x N / time), handle
bytes per worker per push (as the coordinator accounts them), wall time per bucket,
and the driver's CPU time (the coordinator's process, Ray's threads included) per push,
per bucket and per worker per bucket.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

import anyio
import ray
import torch

from asyncrefit import RefitCoordinator
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.ray import RayTrainerSource, RayWorker, RefitTrainerMixin, RefitWorkerMixin
from asyncrefit.tools._machine import machine_info

MIB = 2**20
TENSOR_ELEMENTS = 256 * 1024  # 1 MiB of float32 per tensor


def make_params(size_mib: int, *, random: bool) -> dict[str, torch.Tensor]:
    """``size_mib`` float32 tensors of 1 MiB each (random, or zeros for the workers)."""
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(TENSOR_ELEMENTS, generator=gen)
        if random
        else torch.zeros(TENSOR_ELEMENTS)
        for i in range(size_mib)
    }


class BenchTrainer(RefitTrainerMixin):
    def __init__(self, size_mib: int) -> None:
        torch.set_num_threads(1)
        self.params = make_params(size_mib, random=True)
        self.init_refit_source(self.params)

    async def digests(self) -> dict[str, str]:
        return {n: tensor_digest(t) for n, t in self.params.items()}


class BenchWorker(RefitWorkerMixin):
    def __init__(self, size_mib: int, device: str, shared: bool = False) -> None:
        torch.set_num_threads(1)
        self.params = make_params(size_mib, random=False)
        self.init_refit(self.params, device=device, shared_parameters=shared)


def machine() -> dict[str, Any]:
    """The bench's machine description, plus Ray's version."""
    return {**machine_info(), "ray": ray.__version__}


#: (path, broadcast-all) of each variant, in the order run for each count. ``direct``:
#: the stream, into actors that export their parameters (written by the trainer actor).
VARIANTS = (("per-call", False), ("per-call", True), ("stream", False), ("direct", False))


async def measure(
    trainer: Any, actors: list[Any], path: str, broadcast: bool, args: argparse.Namespace
) -> dict[str, Any]:
    stream = path in ("stream", "direct")
    workers = [RayWorker(a, name=f"w{i:02d}", stream=stream) for i, a in enumerate(actors)]
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer),
        workers=workers,
        budget_bytes=2 * args.bucket_mib * MIB,
        bucket_bytes=args.bucket_mib * MIB,
        broadcast_all_handles=broadcast,
    ) as refit:
        warm = await refit.push(1)
        want = await trainer.digests.remote()
        for w in workers:
            if await w.parameter_digests() != want:
                raise SystemExit(f"VERIFICATION FAILED: {w.name} differs from the trainer")
        seconds = []
        cpu_start = time.process_time()
        for version in range(2, args.repeats + 2):
            report = await refit.push(version)
            seconds.append(report.seconds)
        cpu = time.process_time() - cpu_start
    pushes, buckets, n = args.repeats, warm.buckets, len(actors)
    median = statistics.median(seconds)
    per_worker = sorted(set(report.handle_bytes_per_worker.values()))
    return {
        "workers": n,
        "path": path,
        "mode": "broadcast" if broadcast else "filtered",
        "buckets": buckets,
        "payload_bytes": report.bytes,
        "push_s": median,
        "push_s_all": seconds,
        "aggregate_gbps": report.bytes * n / median / 1e9,
        "handle_bytes_per_worker": per_worker,
        "wall_ms_per_bucket": median / buckets * 1e3,
        "driver_cpu_ms_per_push": cpu / pushes * 1e3,
        "driver_cpu_ms_per_bucket": cpu / pushes / buckets * 1e3,
        "driver_cpu_us_per_bucket_per_worker": cpu / pushes / buckets / n * 1e6,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted(args.counts)
    started = time.perf_counter()
    trainer: Any = ray.remote(BenchTrainer).options(num_cpus=0).remote(args.size_mib)
    worker_cls = ray.remote(BenchWorker).options(num_cpus=0)
    actors: list[Any] = [
        worker_cls.remote(args.size_mib, f"cpu:{i:02d}") for i in range(counts[-1])
    ]
    shared: list[Any] = [
        worker_cls.remote(args.size_mib, f"cpu:{i:02d}", True) for i in range(counts[-1])
    ]
    await trainer.digests.remote()
    for a in [*actors, *shared]:
        await a.refit_weight_version.remote()
    start_s = time.perf_counter() - started
    print(
        f"started 1 trainer and {len(actors)} inference actors in {start_s:.1f} s", file=sys.stderr
    )
    rows = []
    for n in counts:
        for path, broadcast in VARIANTS:
            pool = shared if path == "direct" else actors
            row = await measure(trainer, pool[:n], path, broadcast, args)
            print(format_row(row), file=sys.stderr)
            rows.append(row)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "size_mib": args.size_mib,
        "bucket_mib": args.bucket_mib,
        "repeats": args.repeats,
        "actor_start_s": start_s,
        "rows": rows,
    }


HEADER = (
    f"{'workers':>7} {'path':<8} {'mode':<9} {'buckets':>7} {'push ms':>8} {'agg GB/s':>8} "
    f"{'handle B/worker':>15} {'ms/bucket':>9} {'drv CPU ms/push':>15} "
    f"{'ms/bucket':>9} {'us/bucket/worker':>16}"
)


def format_row(r: dict[str, Any]) -> str:
    per_worker = "/".join(str(b) for b in r["handle_bytes_per_worker"])
    return (
        f"{r['workers']:>7} {r['path']:<8} {r['mode']:<9} {r['buckets']:>7} "
        f"{r['push_s'] * 1e3:>8.1f} {r['aggregate_gbps']:>8.2f} {per_worker:>15} "
        f"{r['wall_ms_per_bucket']:>9.2f} {r['driver_cpu_ms_per_push']:>15.1f} "
        f"{r['driver_cpu_ms_per_bucket']:>9.2f} {r['driver_cpu_us_per_bucket_per_worker']:>16.0f}"
    )


def ratios(result: dict[str, Any]) -> list[str]:
    """Per count: driver CPU per push of the per-call path over the stream's (filtered)."""
    by = {(r["workers"], r["path"], r["mode"]): r for r in result["rows"]}
    lines = []
    for n in sorted({r["workers"] for r in result["rows"]}):
        old, new = by.get((n, "per-call", "filtered")), by.get((n, "stream", "filtered"))
        if old is not None and new is not None:
            lines.append(
                f"{n} workers: driver CPU per push {old['driver_cpu_ms_per_push']:.1f} ms "
                f"per-call, {new['driver_cpu_ms_per_push']:.1f} ms stream: "
                f"{old['driver_cpu_ms_per_push'] / new['driver_cpu_ms_per_push']:.1f}x less"
            )
        direct = by.get((n, "direct", "filtered"))
        if new is not None and direct is not None:
            lines.append(
                f"{n} workers: driver CPU per push {new['driver_cpu_ms_per_push']:.1f} ms "
                f"stream, {direct['driver_cpu_ms_per_push']:.1f} ms direct write: "
                f"{new['driver_cpu_ms_per_push'] / direct['driver_cpu_ms_per_push']:.1f}x less"
            )
    return lines


def format_table(result: dict[str, Any]) -> str:
    return "\n".join([HEADER, *(format_row(r) for r in result["rows"]), "", *ratios(result)])


def markdown(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    load = "/".join(str(x) for x in m.get("loadavg", []))
    return (
        f"### {result['date'][:10]}: Ray fan-out, {m['cpu']}, {m['cores']} cores, "
        f"load average {load}, torch {m['torch']}, ray {m['ray']}\n\n"
        f"`{command}` ({result['size_mib']} MiB, {result['bucket_mib']} MiB buckets, "
        f"median of {result['repeats']})\n\n```\n{format_table(result)}\n```\n"
    )


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
SECTION = "## Ray fan-out"


def record(section: str, path: str = RESULTS) -> None:
    """Insert ``section`` at the end of RESULTS.md's Ray fan-out section."""
    with open(path) as f:
        text = f.read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    end = len(text) if end < 0 else end + 1
    with open(path, "w") as f:
        f.write(text[:end].rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n\n" + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto)")
    parser.add_argument("--counts", default="4,16,32", help="inference actor counts (4,16,32)")
    parser.add_argument("--size-mib", type=int, default=16, help="parameter set size (16)")
    parser.add_argument("--bucket-mib", type=int, default=2, help="bucket size (2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per row (3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--markdown", action="store_true", help="print a RESULTS.md section")
    parser.add_argument(
        "--record", action="store_true", help="also add the section to benchmarks/RESULTS.md"
    )
    args = parser.parse_args()
    args.counts = [int(c) for c in args.counts.split(",")]
    if min(args.counts) < 1 or args.size_mib < 1 or args.bucket_mib < 1 or args.repeats < 1:
        parser.error("counts, sizes and repeats must be positive")
    if args.address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.address, log_to_driver=False)
    try:
        result = anyio.run(run, args)
    finally:
        ray.shutdown()
    section = markdown(result, "python benchmarks/ray_bench.py " + " ".join(sys.argv[1:]))
    if args.record:
        record(section)
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.markdown or args.record:
        print(section)
    else:
        print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
