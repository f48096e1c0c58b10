"""Trainer ranks in other processes: a rank serves its source, the coordinator drives it.

A sharded trainer runs one process per rank (``torchrun``), and every rank must take
part in every gather of a push. The coordinator lives in one process (rank 0's, or a
driver's); each other rank serves its own source with a :class:`RankServer`, and the
coordinator reaches it through a :class:`RankSource`. Between two optimizer steps,
every rank calls :meth:`RankServer.serve_push`, which serves the coordinator's
requests (describe, prepare, export bucket after bucket) until the push ends, and
then returns to training: training collectives and refit gathers never interleave.

The channel is a Unix socket (one machine; across machines use :mod:`asyncrefit.ray`)
on the same wire stack as the local workers' (:mod:`asyncrefit._wire`): the rank greets
with a :class:`~asyncrefit._wire._messages.Hello`, the coordinator's requests go
through a :class:`~asyncrefit._wire._mux.RequestChannel` (they may overlap; replies
are matched by id), the rank answers them one at a time, in order, with the one serve
loop (:mod:`asyncrefit._wire._serve`), and failures become typed errors through the
one error map (:mod:`asyncrefit._wire._errors`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, TypeAlias

import anyio

from .._exceptions import (
    ClosedError,
    SourceDiedError,
    SourceError,
    SourceRemoteError,
    SourceTimeoutError,
)
from .._protocols import SourceInfo, TrainerSource
from .._wire._channel import FrameChannel, UnixListener, connect_unix
from .._wire._errors import SOURCE, Lost, error_reply, map_wire, raise_for_error
from .._wire._messages import Done, ErrorReply, Hello, decode, encode
from .._wire._mux import RequestChannel
from .._wire._refs import RefDecoder
from .._wire._serve import serve

if TYPE_CHECKING:
    from .._core._plan import Bucket, Plan
    from .._device import DeviceId
    from ..transport._base import Handle

logger = logging.getLogger(__name__)

_SEND_TIMEOUT = 30.0


# --- the wire ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Describe:
    """Describe the source (the start of a push)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare:
    plan: Plan
    slots: int
    slot_bytes: int
    checksum: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Export:
    bucket: Bucket
    slot: int
    devices: tuple[DeviceId, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class EndPush:
    """The push of ``version`` is over (``ok``: it completed): back to training."""

    version: int
    ok: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseSource:
    """Free the source's buffers; the coordinator will send nothing more."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoReply:
    info: SourceInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class HandlesReply:
    handles: tuple[Handle, ...]


RankRequest: TypeAlias = Describe | Prepare | Export | EndPush | CloseSource
RankReply: TypeAlias = InfoReply | HandlesReply | Done | ErrorReply


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPush:
    """How one :meth:`RankServer.serve_push` ended.

    ``version`` and ``ok`` describe the push the coordinator ended (``None`` and
    ``False`` if none was); ``closed`` tells that the coordinator closed (or went
    away) and will drive this rank no more.
    """

    version: int | None
    ok: bool
    closed: bool


# --- the rank's side ---------------------------------------------------------------


class RankServer:
    """Serves one trainer rank's source to a coordinator in another process.

    Listens on the Unix socket ``path`` as soon as it is made (so the coordinator can
    connect while this rank still trains); the coordinator's :class:`RankSource`
    connects once and keeps the connection. Usable from ``async with`` or with one
    ``anyio.run(server.serve_push)`` per push (it holds no event loop state between
    calls).

    Resource handling: :meth:`aclose` closes the source (freeing its buffers), the
    connection and the listener, and removes ``path``; also when the coordinator went
    away. Error handling: a request that fails is answered with the error (the
    coordinator raises it as a :class:`~asyncrefit.SourceRemoteError`); serving goes on.
    """

    def __init__(self, source: TrainerSource, path: str) -> None:
        self._source = source
        self._path = path
        self._listener: UnixListener | None = UnixListener(path)
        self._channel: FrameChannel | None = None
        self._refs = RefDecoder()  # the connection's handles by reference
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._channel else "listening")
        return f"<RankServer {self._path!r} {state} source={self._source!r}>"

    async def __aenter__(self) -> RankServer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def serve_push(self) -> RankPush:
        """Serve the coordinator until it ends a push (or closes); then return.

        To bound the wait, wrap it in :func:`anyio.fail_after`; a wait cut off between
        requests leaves the connection usable.
        """
        if self._closed:
            return RankPush(version=None, ok=False, closed=True)
        channel = await self._connected()
        served = await serve(
            channel,
            self._refs,
            self._handle,
            until=lambda request: isinstance(request, EndPush | CloseSource),
            send_timeout=_SEND_TIMEOUT,
        )
        match served:
            case (EndPush(version=v, ok=ok),):
                return RankPush(version=v, ok=ok, closed=False)
            case _:  # closed, or the coordinator went away
                await self.aclose()
                return RankPush(version=None, ok=False, closed=True)

    async def _connected(self) -> FrameChannel:
        if self._channel is None:
            assert self._listener is not None
            channel = await self._listener.accept()
            hello = Hello(
                role="rank",
                name=getattr(self._source, "name", repr(self._source)),
                pid=os.getpid(),
            )
            await channel.send(encode(hello), within=_SEND_TIMEOUT)
            self._channel = channel
        return self._channel

    async def _handle(self, request: RankRequest) -> RankReply:
        source = self._source
        try:
            match request:
                case Describe():
                    return InfoReply(info=await source.describe())
                case Prepare(plan=plan, slots=slots, slot_bytes=size, checksum=crc):
                    if crc:
                        await source.prepare(plan, slots, size, checksum=True)
                    else:
                        await source.prepare(plan, slots, size)
                    return Done()
                case Export(bucket=bucket, slot=slot, devices=devices):
                    return HandlesReply(handles=await source.export(bucket, slot, devices))
                case EndPush():
                    return Done()
                case CloseSource():
                    await source.aclose()
                    return Done()
        except Exception as exc:
            logger.debug("rank request %r failed", request, exc_info=True)
            return error_reply(exc)
        return error_reply(TypeError(f"unknown request {type(request).__name__}"))

    async def aclose(self) -> None:
        """Close the source, the connection and the listener. Idempotent; shielded."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self._source.aclose()
            finally:
                if self._channel is not None:
                    await self._channel.aclose()
                if self._listener is not None:
                    await self._listener.aclose()
                    self._listener = None
                try:
                    os.unlink(self._path)
                except FileNotFoundError:
                    pass


# --- the coordinator's side --------------------------------------------------------


class RankSource:
    """A :class:`~asyncrefit.abc.TrainerSource` served by a :class:`RankServer` elsewhere.

    Give the coordinator one per rank of another process (and the in-process source
    of its own rank, if it has one). Connects to ``path`` at the first call, waiting
    up to ``timeout`` for the rank to listen; every request then waits up to
    ``timeout`` for its answer, the first one of a push included (a rank answers once
    it reaches :meth:`RankServer.serve_push`, after its optimizer step).

    Resource handling: :meth:`aclose` asks the rank to close its source and closes the
    connection. If the rank's process died, its shared-memory segments are swept.

    Error handling: a rank that went away raises :class:`~asyncrefit.SourceDiedError`,
    one that does not answer in time :class:`~asyncrefit.SourceTimeoutError` (the
    connection is then closed: a late answer could not be told apart), and an error
    raised by the rank's source :class:`~asyncrefit.SourceRemoteError` with its type.
    """

    def __init__(self, path: str, *, name: str | None = None, timeout: float = 60.0) -> None:
        self._path = path
        self._name = name
        self._timeout = timeout
        self._requests: RequestChannel | None = None
        self._pid: int | None = None
        self._connecting = anyio.Lock()
        self._dead: str | None = None

    def __repr__(self) -> str:
        state = f"dead ({self._dead})" if self._dead else ("connected" if self._requests else "new")
        return f"<RankSource {self.name!r} {self._path!r} pid={self._pid} {state}>"

    @property
    def name(self) -> str:
        return self._name if self._name is not None else os.path.basename(self._path)

    async def _connect(self) -> RequestChannel:
        async with self._connecting:
            if self._requests is not None:
                return self._requests
            deadline = time.monotonic() + self._timeout
            while True:
                try:
                    channel = connect_unix(self._path)
                    break
                except (FileNotFoundError, ConnectionRefusedError) as exc:
                    if time.monotonic() > deadline:
                        raise SourceTimeoutError(
                            self.name, f"no rank listens at {self._path!r} after {self._timeout} s"
                        ) from exc
                    await anyio.sleep(0.05)
            try:
                with anyio.fail_after(self._timeout):
                    hello = decode(await channel.receive())
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await channel.aclose()
                raise
            if not isinstance(hello, Hello) or hello.role != "rank":
                await channel.aclose()
                raise SourceRemoteError(
                    self.name, "ProtocolError", f"unexpected greeting {hello!r}"
                )
            if self._name is None:
                self._name = hello.name
            self._pid = hello.pid
            self._requests = RequestChannel(channel, send_timeout=_SEND_TIMEOUT)
            return self._requests

    async def _request(self, request: RankRequest) -> RankReply:
        """Send ``request``, return its answer; requests may overlap (the rank answers
        them in order). A request cancelled while it waits for its answer leaves the
        connection usable: its late answer is told by its id and dropped."""
        if self._dead is not None:
            raise SourceDiedError(self.name, self._dead)

        async def lost(how: Lost, exc: BaseException) -> tuple[Lost, str]:
            if self._dead is not None:  # another request found it lost first
                return Lost.DIED, self._dead
            if how is Lost.TIMEOUT:
                await self._gone(f"no answer to {type(request).__name__} within {self._timeout} s")
            else:
                await self._gone("the rank closed its connection")
            assert self._dead is not None
            return how, self._dead

        async with map_wire(SOURCE, lambda: self.name, lost):
            requests = await self._connect()
            with anyio.fail_after(self._timeout):
                reply: RankReply = raise_for_error(await requests.request(request))
        return reply

    async def _gone(self, why: str) -> None:
        from ..transport.shm import sweep_stale_segments

        self._dead = why
        with anyio.CancelScope(shield=True):
            if self._requests is not None:
                await self._requests.aclose()
        sweep_stale_segments()  # a dead rank's segments (its pid is gone)

    async def describe(self) -> SourceInfo:
        reply = await self._request(Describe())
        if not isinstance(reply, InfoReply):
            raise SourceRemoteError(self.name, "ProtocolError", f"got {type(reply).__name__}")
        return reply.info

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        await self._request(
            Prepare(plan=plan, slots=slots, slot_bytes=slot_bytes, checksum=checksum)
        )

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        reply = await self._request(Export(bucket=bucket, slot=slot, devices=tuple(devices)))
        if not isinstance(reply, HandlesReply):
            raise SourceRemoteError(self.name, "ProtocolError", f"got {type(reply).__name__}")
        return reply.handles

    async def end_push(self, version: int, ok: bool) -> None:
        """Tell the rank the push is over, so that its ``serve_push`` returns."""
        await self._request(EndPush(version=version, ok=ok))

    async def aclose(self) -> None:
        """Ask the rank to close its source; close the connection. Idempotent."""
        with anyio.CancelScope(shield=True):
            if self._dead is None and self._requests is not None:
                try:
                    with anyio.move_on_after(self._timeout):
                        await self._request(CloseSource())
                except (SourceError, ClosedError) as exc:
                    logger.info("rank %s did not close cleanly: %s", self.name, exc)
            if self._requests is not None:
                await self._requests.aclose()
            if self._dead is None:
                self._dead = "closed"
            else:
                from ..transport.shm import sweep_stale_segments

                sweep_stale_segments()  # a rank that died since it was last swept


def rank_path(directory: str, rank: int) -> str:
    """The socket path of ``rank`` in a directory every rank knows (a convention)."""
    return os.path.join(directory, f"rank-{rank}.sock")
