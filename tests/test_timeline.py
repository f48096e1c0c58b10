"""A picture of a push: the Chrome trace and the PNG of real pushes, and the command."""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncrefit
from asyncrefit import PushError, RefitCoordinator
from asyncrefit.cli import main
from asyncrefit.events import (
    BucketAcked,
    BucketPacked,
    PushBegun,
    PushCommitted,
    PushEvent,
    WorkerFailed,
)
from asyncrefit.local import spawn_local_workers
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults
from asyncrefit.tools import timeline
from asyncrefit.tools.timeline import chrome_trace, draw_timeline

from .models import make_mlp

KIB = 1024
#: Two slots: the largest of make_mlp's 4 buckets is 64 KiB.
BUDGET, BUCKET = 64 * KIB, 32 * KIB  # two slots; 0.weight (64 KiB) in parts
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DOCUMENTED = set(re.findall(r"``([a-z][a-z ]*)``", timeline.__doc__ or ""))


@dataclass(frozen=True)
class Recorded:
    events: list[PushEvent]
    buckets: int
    slots: int
    workers: tuple[str, ...]
    seconds: dict[int, float]  # per version, as the report says


async def _record_pushes() -> Recorded:
    model = make_mlp()
    events: list[PushEvent] = []
    seconds: dict[int, float] = {}
    async with spawn_local_workers(make_mlp, 2) as workers:
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=BUDGET, bucket_bytes=BUCKET
        ) as refit:
            unsubscribe = refit.subscribe(events.append)
            for version in (1, 2):
                with anyio.fail_after(30):
                    report = await refit.push(version)
                seconds[version] = report.seconds
            unsubscribe()
    return Recorded(events, report.buckets, report.slots, report.workers, seconds)


async def _record_failed_push() -> list[PushEvent]:
    model = make_mlp()
    events: list[PushEvent] = []
    faults = {"worker-1": WorkerFaults(crash_at_bucket=2)}
    async with spawn_with_faults(make_mlp, 2, faults=faults) as workers:
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=BUDGET, bucket_bytes=BUCKET
        ) as refit:
            refit.subscribe(events.append)
            with anyio.fail_after(30), pytest.raises(PushError):
                await refit.push(1)
    return events


@pytest.fixture(scope="module")
def recorded() -> Recorded:
    """Two real pushes into two local worker processes, every event recorded."""
    return anyio.run(_record_pushes)


@pytest.fixture(scope="module")
def failed() -> list[PushEvent]:
    """The events of a real push that a worker's crash at bucket 2 ended."""
    return anyio.run(_record_failed_push)


def _lanes(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    lanes: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] != "M":
            lanes[e["pid"], e["tid"]].append(e)
    return lanes


def _names(trace: dict[str, Any], meta: str) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == meta
    }


def _check_well_formed(trace: dict[str, Any]) -> None:
    """Documented names, known phases, non-negative durations, time order per lane."""
    assert json.loads(json.dumps(trace)) == trace
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    phases = [e["ph"] for e in events]
    assert set(phases) <= {"M", "X", "i"}
    last_meta = max(i for i, p in enumerate(phases) if p == "M")
    assert all(p == "M" for p in phases[: last_meta + 1])  # metadata first
    threads = _names(trace, "thread_name")
    for e in events:
        if e["ph"] == "M":
            continue
        assert e["name"] in DOCUMENTED, e["name"]
        assert (e["pid"], e["tid"]) in threads, e
        assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        else:
            assert e["s"] in ("t", "p")
    for lane, lane_events in _lanes(trace).items():
        stamps = [e["ts"] for e in lane_events]
        assert stamps == sorted(stamps), threads[lane]
        bars = [e for e in lane_events if e["ph"] == "X"]
        for a, b in itertools.pairwise(bars):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (threads[lane], a, b)


@pytest.mark.timeout(90)
def test_trace_of_real_pushes_has_a_lane_per_slot_and_worker(recorded: Recorded) -> None:
    trace = chrome_trace(recorded.events)
    _check_well_formed(trace)
    processes = _names(trace, "process_name")
    assert sorted(processes.values()) == ["asyncrefit push 1", "asyncrefit push 2"]
    threads = _names(trace, "thread_name")
    assert recorded.buckets > 2 and recorded.slots == 2
    lanes = _lanes(trace)
    slot_lanes = [f"slot {s}" for s in range(recorded.slots)]
    worker_lanes = [f"worker {w}" for w in recorded.workers]
    for (pid, _), process in processes.items():
        version = int(process.rsplit(" ", 1)[1])
        mine = {tid: name for (p, tid), name in threads.items() if p == pid}
        assert list(mine.values()) == ["push", *slot_lanes, *worker_lanes]
        tid = {name: t for t, name in mine.items()}

        def on(lane: str, name: str, pid: int = pid, tid: dict[str, int] = tid) -> list[Any]:
            return [e for e in lanes[pid, tid[lane]] if e["name"] == name]

        packs = [e for lane in slot_lanes for e in on(lane, "pack")]
        assert sorted(e["args"]["bucket"] for e in packs) == list(range(recorded.buckets))
        for lane in slot_lanes:  # ping-pong: every slot packs buckets, its own
            assert on(lane, "pack")
            assert {e["args"]["slot"] for e in on(lane, "pack")} == {int(lane.split()[1])}
        for lane in worker_lanes:
            for name in ("notify", "copy", "ack"):
                got = sorted(e["args"]["bucket"] for e in on(lane, name))
                assert got == list(range(recorded.buckets)), (lane, name)
        assert [e["name"] for e in lanes[pid, tid["push"]]] == ["push begun", "push committed"]
        committed = on("push", "push committed")[0]
        assert committed["ts"] == pytest.approx(recorded.seconds[version] * 1e6, abs=1.0)
        for lane in slot_lanes + worker_lanes:
            assert max(e["ts"] + e.get("dur", 0) for e in lanes[pid, tid[lane]]) <= committed["ts"]

    # Each copy bar is at most the copy time the worker reported, ending at its ack.
    acks = {
        (e.version, e.worker, e.bucket): e for e in recorded.events if isinstance(e, BucketAcked)
    }
    version_of = {pid: int(name.rsplit(" ", 1)[1]) for (pid, _), name in processes.items()}
    copies = [e for e in trace["traceEvents"] if e["name"] == "copy"]
    assert len(copies) == 2 * recorded.buckets * len(recorded.workers)
    ack_ts = {
        (e["pid"], e["tid"], e["args"]["bucket"]): e["ts"]
        for e in trace["traceEvents"]
        if e["name"] == "ack"
    }
    for c in copies:
        worker = threads[c["pid"], c["tid"]].removeprefix("worker ")
        ack = acks[version_of[c["pid"]], worker, c["args"]["bucket"]]
        assert c["dur"] <= ack.seconds * 1e6 + 1e-2
        assert c["args"]["seconds"] == ack.seconds
        assert c["ts"] + c["dur"] == pytest.approx(ack_ts[c["pid"], c["tid"], c["args"]["bucket"]])


@pytest.mark.timeout(90)
def test_trace_of_a_failed_push_names_the_worker_and_the_abort(failed: list[PushEvent]) -> None:
    trace = chrome_trace(failed)
    _check_well_formed(trace)
    threads = _names(trace, "thread_name")
    marks = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "i"}
    assert threads[1, marks["worker failed"]["tid"]] == "worker worker-1"
    assert marks["worker failed"]["args"]["error"] == "WorkerDiedError"
    assert marks["push aborted"]["args"]["cause"] == "WorkerDiedError"
    assert "push committed" not in marks
    assert marks["push aborted"]["ts"] >= marks["worker failed"]["ts"]


@pytest.mark.timeout(90)
def test_draw_timeline_writes_a_png(recorded: Recorded, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image
    import numpy as np
    from matplotlib.colors import to_rgb

    path = tmp_path / "push.png"
    drawn = draw_timeline(recorded.events, path)
    assert drawn.version == 2 and drawn.outcome == "committed"  # the last push by default
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    lanes = 1 + recorded.slots + len(recorded.workers)
    assert image.shape[:2] == (round((1.2 + 0.45 * lanes) * 120), 11 * 120)
    pixels = image[..., :3].reshape(-1, 3)
    for name, colour in timeline.COLOURS.items():  # every kind of bar is drawn
        near = np.abs(pixels - np.array(to_rgb(colour))).max(axis=1) < 0.02
        assert near.sum() > 50, name
    assert "push 2" in timeline._title(drawn) and "MiB" in timeline._title(drawn)

    first = draw_timeline(recorded.events, tmp_path / "first.png", version=1)
    assert first.version == 1 and (tmp_path / "first.png").read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="version 7"):
        draw_timeline(recorded.events, tmp_path / "none.png", version=7)


@pytest.mark.timeout(90)
def test_draw_timeline_of_a_failed_push(failed: list[PushEvent], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    drawn = draw_timeline(failed, tmp_path / "failed.png")
    assert drawn.outcome == "aborted: WorkerDiedError"
    assert (tmp_path / "failed.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.timeout(10)
def test_pipelined_handles_never_overlap_on_a_worker_lane() -> None:
    # Bucket 1's handle goes out (t=12) while the worker still copies bucket 0 (acked
    # at t=15): its notify bar begins when that copy ended, the real send time kept.
    events: list[PushEvent] = [
        PushBegun(time=1.0, version=5, workers=("w",), buckets=2, bytes=200, started=0.0),
        BucketPacked(time=10.0, version=5, bucket=0, slot=0, bytes=100, started=2.0),
        BucketPacked(time=12.0, version=5, bucket=1, slot=1, bytes=100, started=10.0),
        BucketAcked(time=15.0, version=5, bucket=0, slot=0, worker="w", sent=10.0, seconds=4.0),
        BucketAcked(time=16.0, version=5, bucket=1, slot=1, worker="w", sent=12.0, seconds=2.0),
        PushCommitted(time=17.0, version=5, seconds=17.0, bytes=200, buckets=2, workers=("w",)),
    ]
    trace = chrome_trace(events)
    _check_well_formed(trace)
    bars = [
        (e["name"], e["args"]["bucket"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["name"] != "pack"
    ]
    assert bars == [
        ("notify", 0, 10.0, 11.0),
        ("copy", 0, 11.0, 15.0),
        ("notify", 1, 15.0, 15.0),  # waited behind bucket 0: an empty bar
        ("copy", 1, 15.0, 16.0),  # reported 2 s, clipped to begin after bucket 0's copy
    ]
    notify_1 = [e for e in trace["traceEvents"] if e["name"] == "notify"][1]
    assert notify_1["args"]["sent_ms"] == pytest.approx(12_000.0)


@pytest.mark.timeout(10)
def test_events_without_a_push_begun_start_at_the_first_event() -> None:
    events: list[PushEvent] = [
        BucketPacked(time=3.0, version=1, bucket=0, slot=0, bytes=1, started=2.0),
        WorkerFailed(time=4.0, version=1, worker="w", error="WorkerDiedError", message="gone"),
    ]
    trace = chrome_trace(events)
    _check_well_formed(trace)
    pack = next(e for e in trace["traceEvents"] if e["name"] == "pack")
    assert pack["ts"] == 0 and pack["dur"] == pytest.approx(1e6)
    assert set(_names(trace, "thread_name").values()) == {"push", "slot 0", "worker w"}
    with pytest.raises(ValueError, match="no push events"):
        chrome_trace([])


@pytest.mark.timeout(30)
def test_missing_matplotlib_is_a_clear_import_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    events: list[PushEvent] = [
        BucketPacked(time=3.0, version=1, bucket=0, slot=0, bytes=1, started=2.0)
    ]
    assert chrome_trace(events)["traceEvents"]  # the trace needs no matplotlib
    with pytest.raises(ImportError, match=re.escape("pip install 'asyncrefit[timeline]'")):
        draw_timeline(events, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    # The command refuses --timeline before running anything.
    status = main(["bench", "--size-mib", "1", "--timeline", str(tmp_path / "x.png")])
    assert status == 2
    assert "pip install 'asyncrefit[timeline]'" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"asyncrefit {asyncrefit.__version__}\n"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_writes_the_trace_and_the_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    trace_path, png_path = tmp_path / "push.json", tmp_path / "push.png"
    args = ["bench", "--size-mib", "4", "--repeats", "1", "--json"]
    status = main([*args, "--trace", str(trace_path), "--timeline", str(png_path)])
    out = capsys.readouterr().out
    assert status == 0
    result = json.loads(out)  # the bench's output is unchanged: one JSON object
    assert result["repeats"] == 1 and result["refit_gbps"] > 0
    trace = json.loads(trace_path.read_text())
    _check_well_formed(trace)
    # One push recorded: the extra one of the asyncrefit variant, after 1 + 1 pushes.
    assert list(_names(trace, "process_name").values()) == ["asyncrefit push 3"]
    packs = [e for e in trace["traceEvents"] if e["name"] == "pack"]
    assert len(packs) == result["buckets"]
    workers = {n for n in _names(trace, "thread_name").values() if n.startswith("worker ")}
    assert len(workers) == result["workers"]
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE
