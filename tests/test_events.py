"""The event stream of a push: what it says, in which order, and what it costs unheard."""

from __future__ import annotations

import logging

import anyio
import pytest

from asyncrefit import PushError, RefitCoordinator, VersionError, WorkerDiedError, cpu_device
from asyncrefit._core import _recorder as recorder_module
from asyncrefit.events import (
    BucketAcked,
    BucketPacked,
    EventHub,
    EventStream,
    PushAborted,
    PushBegun,
    PushCommitted,
    PushEvent,
    WorkerFailed,
    as_scalars,
    event_dict,
)
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults

from .fakes import FakeWorker, Faults
from .helpers import step
from .models import make_mlp

KIB = 1024

pytestmark = pytest.mark.timeout(60)


def _begun(version: int = 1) -> PushBegun:
    return PushBegun(time=0.0, version=version, workers=(), buckets=0, bytes=0, started=0.0)


async def test_a_push_tells_begin_packs_acks_and_commit_in_order() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    seen: list[PushEvent] = []
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, bucket_bytes=8 * KIB
    ) as refit:
        assert refit.plan is not None
        buckets = len(refit.plan.buckets)
        assert buckets >= 3
        unsubscribe = refit.subscribe(seen.append)
        report = await refit.push(1)
        unsubscribe()
        await refit.push(2)  # nobody listens any more

    (begun,) = [e for e in seen if isinstance(e, PushBegun)]
    assert begun.workers == ("w0", "w1") and begun.started <= begun.time
    assert begun.buckets == buckets and begun.bytes == report.bytes
    # the first pack may overlap the begins; no bucket reaches a worker before them
    first_ack = min(i for i, e in enumerate(seen) if isinstance(e, BucketAcked))
    assert seen.index(begun) < first_ack
    assert isinstance(seen[-1], PushCommitted) and seen[-1].version == 1
    assert seen[-1].bytes == report.bytes and seen[-1].buckets == buckets
    assert all(e.version == 1 for e in seen)
    assert [e.time for e in seen] == sorted(e.time for e in seen)

    packed = [e for e in seen if isinstance(e, BucketPacked)]
    acked = [e for e in seen if isinstance(e, BucketAcked)]
    assert [e.bucket for e in packed] == list(range(buckets))
    assert sorted((e.bucket, e.worker) for e in acked) == [
        (b, w) for b in range(buckets) for w in ("w0", "w1")
    ]
    for ack in acked:
        pack = packed[ack.bucket]
        assert ack.slot == pack.slot and pack.started <= pack.time <= ack.sent <= ack.time
        assert seen.index(pack) < seen.index(ack)
        assert ack.seconds >= 0
    assert sum(e.bytes for e in packed) == report.bytes
    scalars = as_scalars(seen[-1])
    assert scalars["refit/ok"] == 1.0 and scalars["refit/bytes"] == report.bytes


async def test_a_killed_worker_is_told_as_its_failure_then_the_abort() -> None:
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(kill_at_bucket=1)}
    async with spawn_with_faults(make_mlp, 2, faults=faults) as workers:
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=64 * KIB, bucket_bytes=8 * KIB, timeout=30
        ) as refit:
            async with refit.events() as events:
                with pytest.raises(PushError) as info:
                    await refit.push(1)
                got = events.drain()
            assert isinstance(info.value.cause, WorkerDiedError)
            await refit.remove_worker("worker-1")

    kinds = [type(e) for e in got]
    assert kinds.count(PushBegun) == 1 and kinds[0] in (PushBegun, BucketPacked)
    failed = [e for e in got if isinstance(e, WorkerFailed)]
    assert len(failed) == 1 and failed[0].worker == "worker-1"
    assert failed[0].error == "WorkerDiedError"
    assert isinstance(got[-1], PushAborted)
    assert got[-1].cause == "WorkerDiedError" and "worker-1" in got[-1].incomplete
    assert kinds.index(WorkerFailed) < len(got) - 1  # the failure, then the abort
    assert PushCommitted not in kinds
    late = [e for e in got if isinstance(e, BucketAcked) and e.worker == "worker-1"]
    assert all(e.bucket < 1 for e in late)  # killed at bucket 1: never acked it


async def test_a_cancelled_push_and_a_refused_version_are_aborts_with_their_cause() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    workers[1].faults = Faults(delay=30.0)
    seen: list[PushEvent] = []
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, bucket_bytes=8 * KIB
    ) as refit:
        refit.subscribe(seen.append)
        with anyio.move_on_after(0.5):
            await refit.push(1)
        aborted = [e for e in seen if isinstance(e, PushAborted)]
        assert len(aborted) == 1 and aborted[0].cause == "cancelled"
        workers[1].faults = Faults()
        seen.clear()
        with pytest.raises(VersionError):
            await refit.push(1)
        assert [type(e) for e in seen] == [PushAborted]
        assert isinstance(seen[0], PushAborted) and seen[0].cause == "VersionError"
        seen.clear()
        step(model, 2)
        await refit.push(2)
        assert isinstance(seen[-1], PushCommitted)


async def test_nobody_listening_builds_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**_: object) -> None:
        raise AssertionError("an event was built with nobody listening")

    for name in ("PushBegun", "BucketPacked", "BucketAcked", "PushCommitted", "PushAborted"):
        monkeypatch.setattr(recorder_module, name, refuse)
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, bucket_bytes=8 * KIB
    ) as refit:
        assert not refit._events
        await refit.push(1)
        with pytest.raises(VersionError):
            await refit.push(1)
        seen: list[PushEvent] = []
        unsubscribe = refit.subscribe(seen.append)
        assert refit._events
        with pytest.raises(AssertionError, match="nobody listening"):
            await refit.push(2)
        unsubscribe()
        assert not refit._events


async def test_a_slow_stream_drops_the_oldest_and_counts_them() -> None:
    hub = EventHub()
    async with hub.stream(maxlen=3) as stream:
        for v in range(1, 6):
            hub.emit(_begun(v))
        assert stream.dropped == 2
        assert [e.version for e in stream.drain()] == [3, 4, 5]
        hub.emit(_begun(6))
        got = await stream.__anext__()
        assert got.version == 6
    assert not hub


async def test_a_stream_waits_for_events_and_ends_when_the_hub_closes() -> None:
    hub = EventHub()
    got: list[int] = []

    async def consume() -> None:
        async with hub.stream() as stream:
            got.extend([event.version async for event in stream])

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        hub.emit(_begun(1))
        hub.emit(_begun(2))
        await anyio.wait_all_tasks_blocked()
        hub.emit(_begun(3))
        hub.close()
    assert got == [1, 2, 3]


async def test_the_events_stream_ends_when_the_coordinator_closes() -> None:
    model = make_mlp()
    workers = [FakeWorker.like("w0", cpu_device(0), model)]
    versions: list[int] = []
    refit = RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB)

    async def consume() -> None:
        async with refit.events() as events:
            versions.extend([e.version async for e in events if isinstance(e, PushCommitted)])

    async with refit:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            await refit.push(1)
            await refit.aclose()  # ends the consumer's iteration
    assert versions == [1]


def test_a_failing_callback_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    hub = EventHub()
    calls: list[int] = []

    def bad(event: PushEvent) -> None:
        calls.append(event.version)
        raise RuntimeError("tracker is down")

    hub.subscribe(bad)
    with caplog.at_level(logging.ERROR, logger="asyncrefit.events"):
        hub.emit(_begun(1))
        hub.emit(_begun(2))
    assert calls == [1] and not hub
    assert "tracker is down" in caplog.text


def test_events_as_dicts_and_scalars() -> None:
    aborted = PushAborted(
        time=2.0, version=7, seconds=0.5, cause="WorkerTimeoutError", incomplete=("a", "b")
    )
    assert event_dict(aborted) == {
        "event": "PushAborted",
        "time": 2.0,
        "version": 7,
        "seconds": 0.5,
        "cause": "WorkerTimeoutError",
        "incomplete": ["a", "b"],
    }
    assert as_scalars(aborted, prefix="x/") == {
        "x/ok": 0.0,
        "x/seconds": 0.5,
        "x/incomplete_workers": 2.0,
    }
    with pytest.raises(ValueError, match="maxlen"):
        EventStream(0)
