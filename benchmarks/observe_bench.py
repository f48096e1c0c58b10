"""What observing a push costs: events and metrics against no listener, in one run.

    python benchmarks/observe_bench.py --size-mib 256 --workers 2 --repeats 31 [--json]
        [--record LABEL]

One coordinator pushes the ``asyncrefit bench`` parameter set (``synthetic_specs``:
~200 float32/bfloat16 tensors, ``--size-mib``) into ``--workers`` local worker
processes (one thread each, ``cpu:i``), buckets of a quarter of the set (at most
256 MiB; ``--bucket-mib`` to choose), budget two buckets. After one warm-up push,
``--repeats`` rounds; each round pushes once under each of four listener set-ups, in
an order rotated every round (so drift of the shared machine spreads over all):

- **none**: nothing subscribed (the coordinator builds no event);
- **callback**: ``refit.subscribe(cb)`` with a callback that counts the events and
  turns the end of the push into :func:`asyncrefit.events.as_scalars` (what logging to
  a tracker costs before the tracker);
- **metrics**: :class:`asyncrefit.metrics.RefitMetrics` attached (on a registry of
  its own, not scraped);
- **stream**: a task iterating ``async with refit.events()`` for the push.

**Measured**: wall clock around ``refit.push``, median per set-up (``median_push``),
overhead = median / median(none) - 1, in % of the push ("wall %"); "paired %" is the
median over rounds of the same ratio within one round (drift of the machine cancels);
"CPU" is this process's CPU time over the push (``time.process_time``: every thread,
the trainer's pack too; being descheduled does not count), paired the same way. On a
shared 2-core machine the push's own noise is larger than the listeners' cost, so the
run also reports the **listener's own CPU**: the events of one real push (recorded
from the stream set-up) are dispatched through each set-up's listeners
``--dispatches`` times (default 2000), and the CPU time of one push's events
(``time.thread_time``, median of 5) is given in µs and in % of the median push (none).
The stream's row counts putting the events into its buffer and taking them out, not
the consumer task's wake-ups (those are in its measured row). Every push is verified
at the end: the workers' digests must equal the trainer's.

``--record LABEL`` appends the run to the "Observability overhead" section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit import RefitCoordinator, RefitReport
from asyncrefit._loop import backend_options
from asyncrefit.events import EventHub, PushCommitted, PushEvent, as_scalars
from asyncrefit.local import spawn_local_workers
from asyncrefit.tools._machine import machine_info, machine_line
from asyncrefit.tools._table import Column, append_to_section, recorded_command, table
from asyncrefit.tools._verify import module_digests, verify_workers
from asyncrefit.tools.bench import (
    bucket_bytes_for,
    fill_random,
    median_push,
    module_from_specs,
    synthetic_specs,
)

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## Observability overhead"
MIB = 2**20
SETUPS = ("none", "callback", "metrics", "stream")
TIMEOUT = 600.0


def worker_model(size_mib: int) -> torch.nn.Module:
    """The workers' zeroed copy of the set (a picklable factory with ``partial``)."""
    return module_from_specs(synthetic_specs(size_mib))


class Counting:
    """The callback listener: counts events, makes the tracker's scalars at the end."""

    def __init__(self) -> None:
        self.events = 0
        self.logged: dict[str, float] = {}

    def __call__(self, event: PushEvent) -> None:
        self.events += 1
        if isinstance(event, PushCommitted):
            self.logged = as_scalars(event)


def _new_metrics() -> Any:
    from prometheus_client import CollectorRegistry

    from asyncrefit.metrics import RefitMetrics

    return RefitMetrics(CollectorRegistry())


async def timed_push(
    refit: RefitCoordinator, version: int, setup: str, recorded: list[PushEvent]
) -> tuple[float, float, RefitReport]:
    """One push under ``setup``; returns its wall seconds, this process's CPU seconds
    over it (every thread: the trainer's pack too) and its report."""
    if setup == "none":
        c, t = time.process_time(), time.perf_counter()
        report = await refit.push(version)
        return time.perf_counter() - t, time.process_time() - c, report
    if setup in ("callback", "metrics"):
        metrics = _new_metrics() if setup == "metrics" else None
        undo = refit.subscribe(Counting()) if metrics is None else metrics.attach(refit)
        try:
            c, t = time.process_time(), time.perf_counter()
            report = await refit.push(version)
            return time.perf_counter() - t, time.process_time() - c, report
        finally:
            undo()
            if metrics is not None:
                metrics.close()
    seen: list[PushEvent] = []
    async with anyio.create_task_group() as tg, refit.events() as events:

        async def consume() -> None:
            seen.extend([event async for event in events])

        tg.start_soon(consume)
        c, t = time.process_time(), time.perf_counter()
        report = await refit.push(version)
        seconds, cpu = time.perf_counter() - t, time.process_time() - c
    recorded[:] = seen  # the stream closed with the block: every event was consumed
    return seconds, cpu, report


def dispatch_cpu(events: Sequence[PushEvent], setup: str, dispatches: int) -> float:
    """CPU seconds to hand one push's ``events`` to ``setup``'s listeners (median of 5)."""
    hub = EventHub()
    metrics = None
    if setup == "callback":
        hub.subscribe(Counting())
    elif setup == "metrics":
        metrics = _new_metrics()
        metrics.attach(_HubOwner(hub))
    times = []
    for _ in range(5):
        if setup == "stream":
            t = time.thread_time()
            for _ in range(dispatches):
                stream = _stream(hub, len(events))
                for event in events:
                    hub.emit(event)
                stream.drain()
                hub._streams.clear()
            times.append(time.thread_time() - t)
            continue
        t = time.thread_time()
        for _ in range(dispatches):
            if hub:
                for event in events:
                    hub.emit(event)
        times.append(time.thread_time() - t)
    if metrics is not None:
        metrics.close()
    return statistics.median(times) / dispatches


def _stream(hub: EventHub, maxlen: int) -> Any:
    from asyncrefit.events import EventStream

    stream = EventStream(max(1024, maxlen))
    hub._streams.append(stream)
    return stream


class _HubOwner:
    """Just enough of a coordinator for ``RefitMetrics.attach`` (subscribe; the gauges
    are read only when scraped, which this benchmark does not do)."""

    def __init__(self, hub: EventHub) -> None:
        self.subscribe = hub.subscribe


async def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    machine = machine_info()
    specs = synthetic_specs(args.size_mib)
    say(f"building {args.size_mib} MiB ({len(specs)} tensors)")
    module = await anyio.to_thread.run_sync(module_from_specs, specs)
    await anyio.to_thread.run_sync(fill_random, module, 0)
    size = sum(s.nbytes for s in specs)
    bucket = args.bucket_mib * MIB if args.bucket_mib else bucket_bytes_for(size)
    times: dict[str, list[tuple[float, RefitReport]]] = {s: [] for s in SETUPS}
    cpus: dict[str, list[float]] = {s: [] for s in SETUPS}
    recorded: list[PushEvent] = []
    say(f"starting {args.workers} workers")
    async with (
        spawn_local_workers(
            functools.partial(worker_model, args.size_mib), args.workers, start_timeout=TIMEOUT
        ) as workers,
        RefitCoordinator(
            trainer=module,
            workers=workers,
            budget_bytes=2 * bucket,
            bucket_bytes=bucket,
            timeout=TIMEOUT,
        ) as refit,
    ):
        report = await refit.push(1)  # warm-up
        version = 1
        for r in range(args.repeats):
            order = SETUPS[r % len(SETUPS) :] + SETUPS[: r % len(SETUPS)]
            for setup in order:
                version += 1
                seconds, cpu, pushed = await timed_push(refit, version, setup, recorded)
                times[setup].append((seconds, pushed))
                cpus[setup].append(cpu)
            say(f"round {r + 1}/{args.repeats}")
        digests = await anyio.to_thread.run_sync(module_digests, module)
        await verify_workers(workers, digests, what="observe bench")
        assert not refit._events, "a listener was left subscribed"
    base = statistics.median(s for s, _ in times["none"])
    walls = {k: [s for s, _ in v] for k, v in times.items()}
    rows = []
    for setup in SETUPS:
        median, _ = median_push(times[setup])
        cpu = dispatch_cpu(recorded, setup, args.dispatches) if setup != "none" else 0.0
        rows.append(
            {
                "setup": setup,
                "median_seconds": median,
                "seconds_all": walls[setup],
                "cpu_seconds": statistics.median(cpus[setup]),
                "cpu_seconds_all": cpus[setup],
                "measured_overhead_pct": (median / base - 1) * 100,
                "paired_overhead_pct": _paired(walls[setup], walls["none"]),
                "paired_cpu_overhead_pct": _paired(cpus[setup], cpus["none"]),
                "listener_cpu_us_per_push": cpu * 1e6,
                "listener_cpu_pct": cpu / base * 100,
            }
        )
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "size_bytes": size,
        "tensors": len(specs),
        "workers": args.workers,
        "bucket_bytes": bucket,
        "buckets": report.buckets,
        "events_per_push": len(recorded),
        "repeats": args.repeats,
        "dispatches": args.dispatches,
        "verified": True,
        "rows": rows,
    }


def _paired(these: Sequence[float], none: Sequence[float]) -> float:
    """Median over rounds of (this set-up's push / the same round's push with none) - 1, %."""
    return (statistics.median(a / b for a, b in zip(these, none, strict=True)) - 1) * 100


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"observe bench, {result['date']}",
        machine_line(result["machine"]),
        f"{result['size_bytes'] / MIB:.0f} MiB, {result['tensors']} tensors, "
        f"{result['buckets']} buckets of {result['bucket_bytes'] / MIB:.0f} MiB, "
        f"{result['workers']} local workers, {result['events_per_push']} events per push; "
        f"median of {result['repeats']} rounds (set-ups interleaved); verified",
        "",
    ]
    columns = (
        Column("listener", 9, left=True),
        Column("push ms", 8, ".1f"),
        Column("wall %", 7, "+.2f"),
        Column("paired %", 9, "+.2f"),
        Column("CPU ms", 7, ".1f"),
        Column("CPU paired %", 13, "+.2f"),
        Column("listener us/push", 17, ".1f"),
        Column("% of push", 10, ".4f"),
    )
    rows = [
        (
            r["setup"],
            r["median_seconds"] * 1e3,
            *(
                ("-",) * 2
                if r["setup"] == "none"
                else (r["measured_overhead_pct"], r["paired_overhead_pct"])
            ),
            r["cpu_seconds"] * 1e3,
            *(
                ("-",) * 3
                if r["setup"] == "none"
                else (
                    r["paired_cpu_overhead_pct"],
                    r["listener_cpu_us_per_push"],
                    r["listener_cpu_pct"],
                )
            ),
        )
        for r in result["rows"]
    ]
    lines += table(columns, rows, gap=2, rule=True)
    lines.append("")
    lines.append(
        "wall %: median push / median push with no listener - 1; paired %: the median over "
        "rounds of the same ratio within a round; CPU: this process's CPU time over the push "
        "(every thread); listener us/push: one push's events dispatched to the listeners "
        "alone (thread CPU time), and that in % of the median push with no listener"
    )
    return "\n".join(lines)


INTRO = f"""
{SECTION} (`benchmarks/observe_bench.py`)

    .venv/bin/python benchmarks/observe_bench.py --size-mib 256 --workers 2 --repeats 31 \\
        --record LABEL

The CPU refit push of `asyncrefit bench`'s parameter set into local workers, with no
listener, an events callback (counting, `as_scalars` at the end), `RefitMetrics`
attached, and an `async for` events stream consumer: set-ups interleaved round by round
in one run, median push per set-up (wall clock, and the coordinator process's CPU
time), and the median of the per-round ratios to the push with no listener. Because
the push's own noise on this shared machine is larger than a listener's cost, each
listener's CPU time for one push's events is also measured on its own (see the
script's docstring). Target (issue 14): under 2% of the push.
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=0, help="0: a quarter of the set")
    parser.add_argument("--repeats", type=int, default=21, help="rounds of the four set-ups")
    parser.add_argument("--dispatches", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--record", metavar="LABEL")
    args = parser.parse_args(argv)
    if min(args.size_mib, args.workers, args.repeats, args.dispatches) < 1:
        parser.error("--size-mib, --workers, --repeats and --dispatches must be positive")
    result = anyio.run(
        run,
        args,
        lambda s: print(s, file=sys.stderr, flush=True),
        backend="asyncio",
        backend_options=backend_options(),
    )
    text = format_table(result)
    print(json.dumps(result, indent=2) if args.json else text)
    if args.record:
        m = result["machine"]
        heading = (
            f"### {result['date'][:10]}, {args.record}: {m['cpu']}, {m['cores']} cores, "
            f"torch {m['torch']}, load {m['loadavg']}"
        )
        command = recorded_command("benchmarks/observe_bench.py", argv).replace(
            f"--record {args.record}", "--record LABEL"
        )
        section = f"\n{heading}\n\n`{command}`\n\n```\n{text}\n```\n"
        if SECTION not in RESULTS.read_text():
            section = INTRO + section
        append_to_section(RESULTS, SECTION, section)
        print(f"recorded in {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
