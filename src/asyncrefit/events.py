"""What happens in a push, as typed events: subscribe with a callback or iterate.

Every event carries ``time`` (``time.perf_counter()`` of the coordinator's process,
seconds) and the ``version`` of the push. A push emits, in order:

- :class:`PushBegun` once every worker began (the first bucket's pack runs meanwhile,
  so a :class:`BucketPacked` may come first; no bucket is sent to a worker before);
- per bucket, :class:`BucketPacked` when every trainer source packed and exported it
  (``started`` is when its pack began, after its slot was free), then one
  :class:`BucketAcked` per worker that acknowledged it (``sent`` is when its handle
  went out, ``seconds`` what the worker reported for its copy);
- :class:`WorkerFailed` for the worker whose failure ended the push, if one did;
- :class:`PushCommitted` (every worker holds the version) or :class:`PushAborted`
  (the touched workers were told to abort; ``cause`` names the typed error, or
  ``"cancelled"`` / ``"closed"``).

Nobody listening costs one truthiness check per event: nothing is built. Callbacks
run inline on the coordinator's event loop and must be quick; an exception raised by
one is logged and the callback is dropped, never raised into the push. An iterator
(:meth:`EventHub.stream`) has a bounded buffer: when the consumer falls behind, the
oldest events are dropped and counted in :attr:`EventStream.dropped`, so a slow
consumer never slows a push or grows memory.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

import anyio

logger = logging.getLogger(__name__)

__all__ = (
    "BucketAcked",
    "BucketPacked",
    "Event",
    "EventHub",
    "EventStream",
    "PushAborted",
    "PushBegun",
    "PushCommitted",
    "PushEvent",
    "WorkerFailed",
    "as_scalars",
    "event_dict",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every event: when (``perf_counter`` seconds) and which push."""

    time: float
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PushBegun(Event):
    """Every worker was told to begin ``version``; ``bytes`` of payload follow."""

    workers: tuple[str, ...]
    buckets: int
    bytes: int
    started: float  # when the push was called (before planning)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketPacked(Event):
    """Every source packed and exported ``bucket`` into ``slot``."""

    bucket: int
    slot: int
    bytes: int
    started: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketAcked(Event):
    """``worker`` acknowledged ``bucket``: it copied it and holds no view of ``slot``."""

    bucket: int
    slot: int
    worker: str
    sent: float
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerFailed(Event):
    """The failure that ended the push, attributed to ``worker``."""

    worker: str
    error: str  # the typed error's class name, e.g. "WorkerDiedError"
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PushCommitted(Event):
    """Every worker holds ``version`` completely."""

    seconds: float
    bytes: int
    buckets: int
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PushAborted(Event):
    """The push failed or was cancelled; the touched workers were told to abort.

    ``cause`` is the class name of the typed error (``"WorkerDiedError"``, ...),
    ``"cancelled"`` or ``"closed"``; ``incomplete`` the workers left without a
    complete version of it.
    """

    seconds: float
    cause: str
    incomplete: tuple[str, ...]


PushEvent: TypeAlias = (
    PushBegun | BucketPacked | BucketAcked | WorkerFailed | PushCommitted | PushAborted
)
Callback: TypeAlias = Callable[[PushEvent], object]


class EventStream:
    """The events of one subscription, iterated with ``async for``.

    Holds at most ``maxlen`` events; when full, the oldest is dropped and
    :attr:`dropped` counts it. Iteration ends when the subscription closes (its
    ``async with`` block ends, or the hub closes with the coordinator). One task
    iterates a stream; each consumer opens its own.
    """

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be at least 1, got {maxlen}")
        self._events: deque[PushEvent] = deque(maxlen=maxlen)
        self._wakeup: anyio.Event | None = None
        self._closed = False
        self.dropped = 0

    def __repr__(self) -> str:
        return f"<EventStream buffered={len(self._events)} dropped={self.dropped}>"

    def _put(self, event: PushEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)
        if self._wakeup is not None:
            self._wakeup.set()

    def _close(self) -> None:
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> PushEvent:
        while not self._events:
            if self._closed:
                raise StopAsyncIteration
            self._wakeup = anyio.Event()
            try:
                await self._wakeup.wait()
            finally:
                self._wakeup = None
        return self._events.popleft()

    def drain(self) -> list[PushEvent]:
        """Every buffered event, oldest first, without waiting."""
        events = list(self._events)
        self._events.clear()
        return events


class EventHub:
    """Fans a coordinator's events out to callbacks and streams.

    ``bool(hub)`` is true while anyone listens; emitters check it first, so a push
    nobody listens to builds no event.
    """

    def __init__(self) -> None:
        self._callbacks: list[Callback] = []
        self._streams: list[EventStream] = []

    def __bool__(self) -> bool:
        return bool(self._callbacks) or bool(self._streams)

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        """Call ``callback(event)`` for every event from now on; returns the unsubscriber."""
        self._callbacks.append(callback)

        def unsubscribe() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return unsubscribe

    @asynccontextmanager
    async def stream(self, maxlen: int = 1024) -> AsyncIterator[EventStream]:
        """An :class:`EventStream` of the events from now until the block ends."""
        stream = EventStream(maxlen)
        self._streams.append(stream)
        try:
            yield stream
        finally:
            if stream in self._streams:
                self._streams.remove(stream)
            stream._close()

    def emit(self, event: PushEvent) -> None:
        """Hand ``event`` to every listener (callers check ``bool(self)`` first)."""
        for stream in self._streams:
            stream._put(event)
        for callback in tuple(self._callbacks):
            try:
                callback(event)
            except Exception:
                logger.exception("event callback %r failed; it is unsubscribed", callback)
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

    def close(self) -> None:
        """End every stream's iteration (after its buffered events) and drop callbacks."""
        for stream in self._streams:
            stream._close()
        self._streams.clear()
        self._callbacks.clear()


def as_scalars(event: PushCommitted | PushAborted, *, prefix: str = "refit/") -> dict[str, float]:
    """The end of a push as a flat dict of scalars, ready for a tracker's ``log``.

    For instance ``wandb.log(as_scalars(event), step=event.version)`` from a callback
    that waits for :class:`PushCommitted` and :class:`PushAborted`.
    """
    if isinstance(event, PushCommitted):
        gbps = event.bytes / event.seconds / 1e9 if event.seconds > 0 else math.inf
        return {
            f"{prefix}ok": 1.0,
            f"{prefix}seconds": event.seconds,
            f"{prefix}bytes": float(event.bytes),
            f"{prefix}buckets": float(event.buckets),
            f"{prefix}workers": float(len(event.workers)),
            f"{prefix}gbps": gbps,
        }
    return {
        f"{prefix}ok": 0.0,
        f"{prefix}seconds": event.seconds,
        f"{prefix}incomplete_workers": float(len(event.incomplete)),
    }


def event_dict(event: Event) -> dict[str, Any]:
    """``event`` as a JSON-ready dict with its type name under ``"event"``."""
    out: dict[str, Any] = {"event": type(event).__name__}
    for f in fields(event):
        value = getattr(event, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
