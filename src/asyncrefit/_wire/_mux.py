"""Many outstanding requests over one framed channel, replies matched by request id.

A link to a worker (a local process, a vLLM rank) sends each request as one frame
``(request_id, request)`` and the worker answers ``(request_id, reply)``, in order. With
one request at a time the worker idles for a whole round trip between two buckets;
:class:`RequestChannel` lets callers send their next request while earlier ones are
still being answered, so a worker takes the next bucket's notification straight after
the last one, with no round trip of the coordinator in between.

No background task reads the channel: whichever caller is waiting for a reply and finds
no one reading becomes the reader, stores every reply that arrives for the callers
still waiting, and hands reading over when its own reply came (or it was cancelled).
So the channel needs no task group of its own and leaves nothing running when its
callers are gone.
"""

from __future__ import annotations

from typing import Any

import anyio

from .._exceptions import ChannelFailedError
from ._channel import FrameChannel
from ._messages import decode
from ._refs import RefEncoder

__all__ = (
    "CHANNEL_ERRORS",
    "ChannelFailedError",
    "RequestChannel",
)

#: The channel failures that mean the peer is gone (or the channel was closed).
CHANNEL_ERRORS: tuple[type[BaseException], ...] = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)
_SEND_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *CHANNEL_ERRORS)


class RequestChannel:
    """Requests and their replies over one :class:`FrameChannel`, many at a time.

    :meth:`request` sends one request and returns its reply. Callers may overlap:
    frames go out whole and in the order the callers reached the send, and the peer is
    expected to answer in its own time, each reply tagged with its request's id.

    Resource handling: a caller cancelled after its request went out leaves the channel
    usable: its reply is recognised by id and dropped when it comes. The send is
    shielded (a frame is never cut in half) and bounded by ``send_timeout``.

    Handles go by reference (see :mod:`asyncrefit._wire._refs`): the peer must turn what it
    receives back with a :class:`~asyncrefit._wire._refs.RefDecoder` of its own.

    Error handling: once the channel fails (end of stream, a broken socket, a send
    that timed out, :meth:`aclose`), every waiting and later call raises
    :class:`ChannelFailedError` with the first failure as ``cause``.
    """

    def __init__(self, channel: FrameChannel, *, send_timeout: float) -> None:
        self._channel = channel
        self._send_timeout = send_timeout
        # Taken without yielding when free (a request goes out at once; still a
        # cancellation point).
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._refs = RefEncoder()
        self._next_id = 0
        # Every request whose caller still waits, by id, in the order they were made,
        # with the event it sleeps on while another caller reads (``None``: it is not
        # asleep). An event is made only for a caller that has to sleep: with one
        # request at a time its caller reads its own reply, and no event is made.
        self._waiting: dict[int, anyio.Event | None] = {}
        self._replies: dict[int, Any] = {}
        self._reading = False
        self._failed: BaseException | None = None

    def __repr__(self) -> str:
        state = f"failed ({self._failed!r})" if self._failed else "open"
        return f"<RequestChannel {state} waiting={len(self._waiting)}>"

    @property
    def failed(self) -> BaseException | None:
        """The failure that ended the channel, or ``None`` while it works."""
        return self._failed

    def _fail(self, exc: BaseException) -> ChannelFailedError:
        if self._failed is None:
            self._failed = exc
        for event in self._waiting.values():
            if event is not None:
                event.set()
        return ChannelFailedError(self._failed)

    def _hand_over(self) -> None:
        """No one reads: wake the first sleeping caller still without its reply (it
        reads next). One woken already counts: it runs and reads, or, finding its
        reply, hands over in its turn; a caller not asleep reads when it gets there."""
        replies = self._replies
        for request_id, event in self._waiting.items():
            if event is not None and request_id not in replies:
                event.set()
                return

    async def request(self, request: Any) -> Any:
        """Send ``request`` and return the peer's reply to it."""
        if self._failed is not None:
            raise ChannelFailedError(self._failed)
        self._next_id += 1
        request_id = self._next_id
        waiting = self._waiting
        waiting[request_id] = None
        try:
            async with self._send_lock:
                if self._failed is not None:
                    raise ChannelFailedError(self._failed)
                # Encoded under the lock: the reference table sees the wire's order.
                payload = self._refs.encode(request_id, request)
                try:
                    await self._channel.send(payload, within=self._send_timeout)
                except _SEND_ERRORS as exc:
                    raise self._fail(exc) from None
            return await self._reply(request_id)
        finally:
            del waiting[request_id]
            if self._replies:
                self._replies.pop(request_id, None)
            if waiting and not self._reading:
                self._hand_over()  # this caller read, or was woken to: the next one does

    async def _reply(self, request_id: int) -> Any:
        replies = self._replies
        waiting = self._waiting
        while True:
            if request_id in replies:
                return replies.pop(request_id)
            if self._failed is not None:
                raise ChannelFailedError(self._failed)
            if self._reading:
                event = waiting[request_id] = anyio.Event()
                try:
                    await event.wait()
                finally:
                    waiting[request_id] = None
                continue
            self._reading = True
            try:
                receive = self._channel.receive
                while True:
                    try:
                        got_id, reply = decode(await receive())
                    except CHANNEL_ERRORS as exc:
                        raise self._fail(exc) from None
                    if got_id == request_id:
                        return reply
                    if got_id in waiting:
                        replies[got_id] = reply
                        sleeper = waiting[got_id]
                        if sleeper is not None:
                            sleeper.set()
                    # else: the reply to a request whose caller was cancelled: dropped
            finally:
                self._reading = False

    async def aclose(self) -> None:
        """Close the channel: waiting callers get :class:`ChannelFailedError`."""
        self._fail(anyio.ClosedResourceError())
        await self._channel.aclose()
