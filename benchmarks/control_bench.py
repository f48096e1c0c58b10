"""The control path: coordinator CPU per worker per bucket, staged against direct write.

    python benchmarks/control_bench.py --workers 16 256 1024 --buckets 100 --repeats 3 --record

All in one process, torch at one thread. The trainer holds ``--buckets`` float32
tensors of ``--floats`` values (256: 1 KiB) and the plan has one tensor per bucket,
so a push is ``--buckets`` buckets. ``n`` in-process workers, all on one device
(``cpu:0``), each a :class:`~asyncrefit.ParameterReceiver` called on the
coordinator's loop (they answer at once: what is measured is the coordinator's work
and the copies, not a transport's latency):

- **staged**: the worker protocol as every backend has it: a begin, a
  ``load_bucket`` request and its ack per worker per bucket, a commit;
- **direct**: the receivers hold their parameters in shared memory they export
  (``shared=True``); the coordinator's :class:`~asyncrefit.LocalTrainer` writes every
  bucket into all of them, and each worker is called twice per push (a begin, a
  commit).

For each row: the coordinator process's CPU time over a push (``time.process_time``,
every thread: the trainer's pack and write threads and the workers' copies included,
nothing subtracted), divided by workers x buckets; and the wall clock of a push.
Median over ``--repeats`` pushes after one warm-up; every worker's parameters are
compared with the trainer's after the last push.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit import (
    LocalTrainer,
    RefitCoordinator,
    cpu_device,
)
from asyncrefit.tools._inprocess import InProcessWorker
from asyncrefit.tools._machine import machine_info, machine_line
from asyncrefit.tools._table import (
    Column,
    append_to_section,
    recorded_command,
    results_section,
    table,
)

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## Control path"
DEVICE = cpu_device(0)


async def measure(path: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    trainer = {f"t{i}": torch.randn(args.floats) for i in range(args.buckets)}
    workers = [
        InProcessWorker(
            name=f"w{i}",
            device=DEVICE,
            parameters={k: torch.zeros_like(t) for k, t in trainer.items()},
            shared=path == "direct",
        )
        for i in range(n)
    ]
    bucket = args.floats * 4
    cpu, wall = [], []
    try:
        async with RefitCoordinator(
            trainer=LocalTrainer(trainer),
            workers=workers,
            budget_bytes=2 * bucket,
            bucket_bytes=bucket,
            timeout=600,
        ) as refit:
            assert refit.plan is not None and len(refit.plan.buckets) == args.buckets
            for v in range(1, args.repeats + 2):
                for t in trainer.values():
                    t.add_(1.0)
                c, w = time.process_time(), time.perf_counter()
                report = await refit.push(v)
                c, w = time.process_time() - c, time.perf_counter() - w
                if v > 1:
                    cpu.append(c)
                    wall.append(w)
        for worker in workers:
            for k, t in trainer.items():
                if not torch.equal(worker.parameters[k], t):
                    raise AssertionError(f"{worker.name} does not hold {k}")
    finally:
        for worker in workers:
            worker.close()
    return {
        "path": path,
        "workers": n,
        "buckets": args.buckets,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "transports": report.bytes_per_transport,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = []
    for n in args.workers:
        for path in ("staged", "direct"):
            if path == "staged" and n > args.max_staged:
                continue
            print(f"-- {path}, {n} workers", file=sys.stderr, flush=True)
            rows.append(await measure(path, n, args))
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "floats": args.floats,
        "repeats": args.repeats,
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    columns = [
        Column("path", 8, left=True),
        Column("workers", 8),
        Column("buckets", 8),
        Column("CPU us/worker/bucket", 21, ".2f"),
        Column("CPU ms/push", 12, ".1f"),
        Column("wall ms/push", 13, ".1f"),
    ]
    out = []
    for r in result["rows"]:
        cpu = statistics.median(r["cpu_seconds"])
        out.append(
            [
                r["path"],
                r["workers"],
                r["buckets"],
                cpu / (r["workers"] * r["buckets"]) * 1e6,
                cpu * 1e3,
                statistics.median(r["wall_seconds"]) * 1e3,
            ]
        )
    head = (
        f"{machine_line(result['machine'])}\n"
        f"in-process workers on one device, one {result['floats'] * 4} B float32 tensor per "
        f"bucket, torch at 1 thread, median of {result['repeats']} pushes\n"
    )
    return head + "\n".join(table(columns, out, gap=1, rule=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--buckets", type=int, default=100)
    parser.add_argument("--floats", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-staged", type=int, default=1024, help="skip the staged path above this many"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--record", action="store_true", help=f"append to {RESULTS.name}")
    args = parser.parse_args(argv)
    result = anyio.run(run, args)
    text = format_table(result)
    print(json.dumps(result, indent=2) if args.json else text)
    if args.record:
        m = result["machine"]
        title = f"{result['date'][:10]}: {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
        command = recorded_command("benchmarks/control_bench.py", argv)
        append_to_section(RESULTS, SECTION, results_section(title, command, text, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
