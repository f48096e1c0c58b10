"""What a push measures and tells: its clock, its events and its report.

A :class:`PushRecorder` is made when a push is called and owns everything the push
records about itself: every ``time.perf_counter()`` reading, every
:mod:`asyncrefit.events` event it emits, and the tallies (:class:`_PushAccount`) that
become its :class:`~asyncrefit._core._report.RefitReport`. The push's control flow calls one
small method per thing that happened (``bucket_sent``, ``acked``, ...) or wraps a stage
in one of its timing blocks (``with recorder.committing(): ...``).

Nothing here awaits, does I/O or decides anything: the recorder is told, never asked.
Nobody listening costs one truthiness check per event, and no event is built. A stage
that raises is not tallied (a failed push makes no report); timing blocks let every
exception, cancellation included, pass through untouched.

:class:`EventSource` is the other end: the coordinator's ``subscribe`` and ``events``,
over the :class:`~asyncrefit.events.EventHub` its recorders emit into.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._exceptions import ClosedError, PushError, WorkerError
from ..events import (
    BucketAcked,
    BucketPacked,
    EventHub,
    EventStream,
    PushAborted,
    PushBegun,
    PushCommitted,
    PushEvent,
    WorkerFailed,
)
from ._report import RefitReport, StageTimes

if TYPE_CHECKING:
    from ._topology import Topology


class EventSource:
    """The event subscriptions of an object whose pushes record events into ``_events``
    (the coordinator's :class:`~asyncrefit.events.EventHub`, which it closes)."""

    _events: EventHub

    def subscribe(self, callback: Callable[[PushEvent], object]) -> Callable[[], None]:
        """Call ``callback(event)`` for every :mod:`asyncrefit.events` event from now on.

        Returns a function that unsubscribes. The callback runs inline on the event
        loop of the push and must be quick; one that raises is logged and dropped,
        never raised into the push.
        """
        return self._events.subscribe(callback)

    @asynccontextmanager
    async def events(self, maxlen: int = 1024) -> AsyncIterator[EventStream]:
        """An async iterator of the events from now until the block ends::

            async with refit.events() as events:
                async for event in events:
                    ...

        Resource handling: it buffers at most ``maxlen`` events; when the consumer
        falls behind, the oldest are dropped and counted (``events.dropped``): a push
        never waits for a consumer. Iteration ends when the coordinator closes.
        """
        async with self._events.stream(maxlen) as stream:
            yield stream


@dataclass(slots=True)
class _PushAccount:
    """Mutable tallies of one push, frozen into a :class:`RefitReport` at the end."""

    plan: float = 0.0
    begin: float = 0.0
    wait_budget: float = 0.0
    pack: float = 0.0
    load: float = 0.0
    commit: float = 0.0
    handle_bytes: dict[str, int] = field(default_factory=dict)
    transport_bytes: dict[str, int] = field(default_factory=dict)

    def stages(self) -> StageTimes:
        return StageTimes(
            plan=self.plan,
            begin=self.begin,
            wait_budget=self.wait_budget,
            pack=self.pack,
            load=self.load,
            commit=self.commit,
        )


class WriteTimer:
    """When a block of direct writes started (see :meth:`PushRecorder.writing`)."""

    __slots__ = ("_clock", "discarded", "start")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.start = clock()
        self.discarded = False

    def restart(self) -> None:
        """The writes start now (the block waited until here)."""
        self.start = self._clock()

    def discard(self) -> None:
        """Nothing was written after all: the block is not tallied."""
        self.discarded = True


class PushRecorder:
    """The clock, events and account of one push of ``version``.

    ``started`` is when the push was called (before planning); every duration and
    event time is a reading of ``clock`` (``time.perf_counter`` of this process).
    """

    def __init__(
        self, events: EventHub, version: int, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.version = version
        self._clock = clock
        self.started = clock()
        self.account = _PushAccount()
        self._events = events
        self._workers: tuple[str, ...] = ()

    # --- the push's stages ------------------------------------------------------------

    def planned(self, workers: Iterable[str]) -> None:
        """Planning ended (the plan stage's time); the push goes to ``workers``."""
        self.account.plan = self._clock() - self.started
        self._workers = tuple(workers)
        self.account.handle_bytes = dict.fromkeys(self._workers, 0)

    @contextmanager
    def beginning(self) -> Iterator[None]:
        """Time the block that tells every worker to begin (:meth:`begun` follows, once
        the plan is also known to hold)."""
        t = self._clock()
        yield
        self.account.begin = self._clock() - t

    def begun(self, topology: Topology) -> None:
        """Emit :class:`PushBegun`: every worker began, following ``topology``."""
        if self._events:
            self._events.emit(
                PushBegun(
                    time=self._clock(),
                    version=self.version,
                    workers=self._workers,
                    buckets=len(topology.plan.buckets),
                    bytes=topology.plan.payload_bytes,
                    started=self.started,
                )
            )

    @contextmanager
    def waiting_for_budget(self) -> Iterator[None]:
        """Time the block that waits for a bucket's budget grant."""
        t = self._clock()
        yield
        self.account.wait_budget += self._clock() - t

    def bucket(self, index: int, slot: int, payload: int) -> BucketRecorder:
        """The recorder of bucket ``index`` (``payload`` bytes) staged in ``slot``."""
        return BucketRecorder(self, index, slot, payload)

    @contextmanager
    def writing(
        self, buckets: Sequence[BucketRecorder], kind: str, workers: int
    ) -> Iterator[WriteTimer]:
        """Time the block that writes ``buckets`` directly into ``workers`` workers
        (transport ``kind``): once into the pack stage, then a :class:`BucketPacked`
        per bucket and its bytes per worker. The block may move its start later
        (:meth:`WriteTimer.restart`: a write that waited for the workers to begin), or
        discard itself (:meth:`WriteTimer.discard`: nothing was written)."""
        timer = WriteTimer(self._clock)
        yield timer
        if timer.discarded:
            return
        done = self._clock()
        self.account.pack += done - timer.start
        for record in buckets:
            record.written(kind, workers)
            record.packed(timer.start, done)

    @contextmanager
    def committing(self) -> Iterator[None]:
        """Time the block that has every worker commit."""
        t = self._clock()
        yield
        self.account.commit = self._clock() - t

    # --- the end of a push ------------------------------------------------------------

    def worker_failed(self, error: BaseException | None) -> None:
        """Emit :class:`WorkerFailed` if ``error`` (the push's primary one) is a worker's."""
        if self._events and isinstance(error, WorkerError):
            self._events.emit(
                WorkerFailed(
                    time=self._clock(),
                    version=self.version,
                    worker=error.worker,
                    error=type(error).__name__,
                    message=str(error),
                )
            )

    def committed(self, topology: Topology, peak_budget_bytes: int) -> RefitReport:
        """Every worker committed: emit :class:`PushCommitted`, return the report."""
        seconds = self._clock() - self.started
        plan = topology.plan
        if self._events:
            self._events.emit(
                PushCommitted(
                    time=self.started + seconds,
                    version=self.version,
                    seconds=seconds,
                    bytes=plan.payload_bytes,
                    buckets=len(plan.buckets),
                    workers=self._workers,
                )
            )
        return RefitReport(
            version=self.version,
            buckets=len(plan.buckets),
            bytes=plan.payload_bytes,
            seconds=seconds,
            stages=self.account.stages(),
            workers=self._workers,
            handle_bytes_per_worker=self.account.handle_bytes,
            bytes_per_transport=self.account.transport_bytes,
            slots=topology.slots,
            slot_bytes=topology.slot_bytes,
            peak_budget_bytes=peak_budget_bytes,
        )

    def aborted(self, exc: BaseException, *, closed: bool) -> None:
        """The push ended with ``exc``: emit :class:`PushAborted` naming its cause.

        ``closed``: the coordinator was closed (a cancellation is told as ``"closed"``).
        """
        if not self._events:
            return
        incomplete: tuple[str, ...] = ()
        if isinstance(exc, PushError):
            incomplete = exc.incomplete
            cause = "closed" if isinstance(exc.cause, ClosedError) else type(exc.cause).__name__
        elif isinstance(exc, Exception):
            cause = type(exc).__name__
        else:  # cancelled: by the caller, or by closing the coordinator
            cause = "closed" if closed else "cancelled"
        now = self._clock()
        self._events.emit(
            PushAborted(
                time=now,
                version=self.version,
                seconds=now - self.started,
                cause=cause,
                incomplete=incomplete,
            )
        )


class BucketRecorder:
    """What happens to one bucket: its pack, the handles sent, the acks.

    ``index`` and ``slot`` say which bucket in which slot; ``sent`` is when its
    handles went out (set by :meth:`loading`).
    """

    __slots__ = ("_push", "index", "payload", "sent", "slot")

    def __init__(self, push: PushRecorder, index: int, slot: int, payload: int) -> None:
        self._push = push
        self.index = index
        self.slot = slot
        self.payload = payload
        self.sent = 0.0

    @contextmanager
    def packing(self) -> Iterator[None]:
        """Time the block that packs and exports the bucket; then :class:`BucketPacked`."""
        t = self._push._clock()
        yield
        packed = self._push._clock()
        self._push.account.pack += packed - t
        self.packed(t, packed)

    def packed(self, started: float, done: float) -> None:
        """Emit :class:`BucketPacked`: the bucket was packed (or written) from
        ``started`` to ``done``."""
        push = self._push
        if push._events:
            push._events.emit(
                BucketPacked(
                    time=done,
                    version=push.version,
                    bucket=self.index,
                    slot=self.slot,
                    bytes=self.payload,
                    started=started,
                )
            )

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Time the block that sends the handles and awaits every ack."""
        self.sent = self._push._clock()
        yield
        self._push.account.load += self._push._clock() - self.sent

    def bucket_sent(self, worker: str, kind: str, handle_bytes: int) -> None:
        """``worker`` is sent ``handle_bytes`` of handles of transport ``kind``."""
        account = self._push.account
        account.handle_bytes[worker] += handle_bytes
        account.transport_bytes[kind] = account.transport_bytes.get(kind, 0) + self.payload

    def written(self, kind: str, workers: int) -> None:
        """The bucket was written directly (transport ``kind``) into ``workers`` workers."""
        account = self._push.account
        account.transport_bytes[kind] = (
            account.transport_bytes.get(kind, 0) + self.payload * workers
        )

    def acked(self, worker: str, seconds: float) -> None:
        """``worker`` acknowledged the bucket, having copied it in ``seconds``."""
        push = self._push
        if push._events:
            push._events.emit(
                BucketAcked(
                    time=self._push._clock(),
                    version=push.version,
                    bucket=self.index,
                    slot=self.slot,
                    worker=worker,
                    sent=self.sent,
                    seconds=seconds,
                )
            )
