"""The recorder: a push's stage times, events and report, from what it is told; no I/O.

A fake clock that advances one second per reading makes every time exact: each test
tells a :class:`PushRecorder` what happened, in the order a push would, and checks
the tallies, the events (in order, with their times) and the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import pytest

from asyncrefit import ClosedError, PushError, WorkerDiedError
from asyncrefit._core import _recorder as recorder_module
from asyncrefit._core._recorder import PushRecorder
from asyncrefit._core._topology import Topology
from asyncrefit.events import (
    BucketAcked,
    BucketPacked,
    EventHub,
    PushAborted,
    PushBegun,
    PushCommitted,
    PushEvent,
    WorkerFailed,
)


class Clock:
    """Reads 0, 1, 2, ...: one second passes per reading."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@dataclass
class _Plan:
    buckets: tuple[object, ...]
    payload_bytes: int


@dataclass
class _Topology:
    plan: _Plan
    slots: int
    slot_bytes: int


TOPOLOGY = cast(
    Topology, _Topology(plan=_Plan(buckets=(1, 2), payload_bytes=300), slots=2, slot_bytes=256)
)


def listening() -> tuple[EventHub, list[PushEvent]]:
    hub = EventHub()
    seen: list[PushEvent] = []
    hub.subscribe(seen.append)
    return hub, seen


def test_a_committed_push_reports_every_stage_and_emits_in_order() -> None:
    hub, seen = listening()
    rec = PushRecorder(hub, 7, clock=Clock())  # started = 0
    rec.planned(["a", "b"])  # 1: plan 1 s
    with rec.beginning():  # 2 .. 3
        pass
    rec.begun(TOPOLOGY)  # PushBegun at 4
    with rec.waiting_for_budget():  # 5 .. 6
        pass
    first = rec.bucket(0, slot=1, payload=200)
    with first.packing():  # 7 .. 8, BucketPacked at 8
        pass
    with first.loading():  # sent 9 .. 12
        first.bucket_sent("a", "shm", 40)
        first.bucket_sent("b", "cuda_ipc", 50)
        first.acked("a", 0.5)  # 10
        first.acked("b", 0.25)  # 11
    second = rec.bucket(1, slot=0, payload=100)
    with second.packing():  # 13 .. 14
        pass
    with second.loading():  # 15 .. 16
        second.bucket_sent("a", "shm", 30)
        second.bucket_sent("b", "shm", 30)
    with rec.committing():  # 17 .. 18
        pass
    report = rec.committed(TOPOLOGY, peak_budget_bytes=512)  # 19

    assert seen == [
        PushBegun(time=4, version=7, workers=("a", "b"), buckets=2, bytes=300, started=0),
        BucketPacked(time=8, version=7, bucket=0, slot=1, bytes=200, started=7),
        BucketAcked(time=10, version=7, bucket=0, slot=1, worker="a", sent=9, seconds=0.5),
        BucketAcked(time=11, version=7, bucket=0, slot=1, worker="b", sent=9, seconds=0.25),
        BucketPacked(time=14, version=7, bucket=1, slot=0, bytes=100, started=13),
        PushCommitted(time=19, version=7, seconds=19, bytes=300, buckets=2, workers=("a", "b")),
    ]
    stages = report.stages
    assert (stages.plan, stages.begin, stages.wait_budget) == (1, 1, 1)
    assert (stages.pack, stages.load, stages.commit) == (2, 4, 1)
    assert report.version == 7 and report.seconds == 19 and report.workers == ("a", "b")
    assert (report.buckets, report.bytes, report.slots, report.slot_bytes) == (2, 300, 2, 256)
    assert report.handle_bytes_per_worker == {"a": 70, "b": 80}
    assert report.bytes_per_transport == {"shm": 400, "cuda_ipc": 200}
    assert report.peak_budget_bytes == 512


def test_a_stage_that_raises_is_not_tallied_and_the_error_passes_untouched() -> None:
    hub, seen = listening()
    rec = PushRecorder(hub, 1, clock=Clock())
    rec.planned(["a"])
    error = KeyboardInterrupt()  # a BaseException, as a cancellation is
    with pytest.raises(KeyboardInterrupt) as raised:
        with rec.beginning():
            raise error
    assert raised.value is error
    bucket = rec.bucket(0, slot=0, payload=10)
    with pytest.raises(ValueError, match="pack"):
        with bucket.packing():
            raise ValueError("pack")
    with pytest.raises(ValueError, match="wait"):
        with rec.waiting_for_budget():
            raise ValueError("wait")
    account = rec.account
    assert (account.begin, account.pack, account.wait_budget) == (0, 0, 0)
    assert seen == []


def test_nobody_listening_builds_no_event_but_still_tallies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(**_: object) -> None:
        raise AssertionError("an event was built with nobody listening")

    for name in (
        "PushBegun",
        "BucketPacked",
        "BucketAcked",
        "PushCommitted",
        "PushAborted",
        "WorkerFailed",
    ):
        monkeypatch.setattr(recorder_module, name, refuse)
    rec = PushRecorder(EventHub(), 1, clock=Clock())
    rec.planned(["a"])
    with rec.beginning():
        pass
    rec.begun(TOPOLOGY)
    bucket = rec.bucket(0, slot=0, payload=10)
    with bucket.packing():
        pass
    with bucket.loading():
        bucket.bucket_sent("a", "shm", 5)
        bucket.acked("a", 0.1)
    rec.worker_failed(WorkerDiedError("a", "gone"))
    rec.aborted(ValueError(), closed=False)
    report = rec.committed(TOPOLOGY, peak_budget_bytes=0)
    assert report.stages.begin == 1 and report.stages.pack == 1
    assert report.handle_bytes_per_worker == {"a": 5}


@pytest.mark.parametrize(
    ("exc", "closed", "cause", "incomplete"),
    [
        (
            PushError(3, WorkerDiedError("b", "gone"), ["b", "a"], "b"),
            False,
            "WorkerDiedError",
            ("a", "b"),
        ),
        (PushError(3, ClosedError("closed during"), ["a"], None), True, "closed", ("a",)),
        (ValueError("no workers"), False, "ValueError", ()),
        (KeyboardInterrupt(), False, "cancelled", ()),
        (KeyboardInterrupt(), True, "closed", ()),
    ],
)
def test_an_aborted_push_names_its_cause(
    exc: BaseException, closed: bool, cause: str, incomplete: tuple[str, ...]
) -> None:
    hub, seen = listening()
    rec = PushRecorder(hub, 3, clock=Clock())  # started = 0
    rec.aborted(exc, closed=closed)  # 1
    assert seen == [PushAborted(time=1, version=3, seconds=1, cause=cause, incomplete=incomplete)]


def test_only_a_worker_error_is_told_as_a_worker_failure() -> None:
    hub, seen = listening()
    rec = PushRecorder(hub, 2, clock=Clock())
    rec.worker_failed(None)
    rec.worker_failed(ValueError("not a worker's"))
    died = WorkerDiedError("w1", "the process exited")
    rec.worker_failed(died)
    assert seen == [
        WorkerFailed(time=1, version=2, worker="w1", error="WorkerDiedError", message=str(died))
    ]
