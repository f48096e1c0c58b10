"""A worker's requests over one TCP stream that lasts as long as its coordinator uses it.

Ray's cost per actor call (~0.2-0.7 ms of the caller's CPU) made the per-request calls
(``refit_load`` per bucket) the driver's main cost. On the streaming path a worker
costs one actor call for as long as the coordinator keeps it, not one per request
nor one per push:

1. The first ``RayWorker.begin_update`` listens on a fresh port of the driver's node
   IP (the one Ray reports) and submits ``refit_stream(host, port, token)``: the call
   runs on the actor's loop until the driver closes the stream. The actor connects
   and sends the random token first (the driver drops connections that do not).
2. From then on every push is requests on the stream, each answered in order: a
   :class:`BeginUpdate`, a :class:`LoadBucket` per bucket, a :class:`CommitUpdate` or
   :class:`AbortUpdate`. They travel as on the local link (:mod:`asyncrefit._wire._mux`):
   ``(request id, request)`` frames, replies matched by id, handles by reference
   (:mod:`asyncrefit._wire._refs`: after a handle's first push a load is a few bytes). The
   actor takes them one after the other through its own ``refit_begin`` /
   ``refit_load`` / ``refit_commit`` / ``refit_abort`` (overrides apply), and answers
   a load only after the copy.
3. ``release_handles`` (the coordinator calls it when it removes the worker or
   closes) closes the stream; the actor's call then returns.

The actor call's end is watched throughout: when its ``ObjectRef`` resolves (the
actor died, its node was lost, ``refit_stream`` raised), the driver's socket is shut
down so a pending read wakes, and the Ray error is translated by
:func:`~asyncrefit.ray._errors.worker_errors` as for any call. A stream whose
connection failed is never reused: the next push opens a new one (and so learns of a
dead actor from Ray).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
from functools import cache
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import anyio

from .._exceptions import (
    WorkerDiedError,
    WorkerError,
    WorkerProtocolError,
    WorkerTimeoutError,
)
from .._wire._channel import FrameChannel, TcpListener, connect_tcp
from .._wire._errors import WORKER, error_reply, protocol_reply
from .._wire._messages import (
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    Done,
    ErrorReply,
    LoadBucket,
)
from .._wire._mux import ChannelFailedError, RequestChannel
from .._wire._refs import RefDecoder
from .._wire._serve import Served, serve
from ._errors import worker_errors

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from .._wire._messages import BucketAck
    from ..transport._base import Handle


class StreamedWorker(Protocol):
    """What :func:`serve_stream` drives: the actor's refit methods and its stream epochs
    (:class:`~asyncrefit.ray.RefitWorkerMixin` is one)."""

    async def refit_begin(self, version: int) -> None: ...

    async def refit_begin_direct(self, version: int) -> None: ...

    async def refit_load(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck: ...

    async def refit_commit(self, version: int, buckets: int) -> None: ...

    async def refit_abort(self, version: int) -> None: ...

    async def refit_abort_unwritten(self, version: int) -> None: ...

    def _refit_stream_started(self) -> int: ...

    def _refit_stream_current(self, epoch: int) -> bool: ...

    async def _refit_stream_lost(self, version: int, epoch: int) -> None: ...


#: Bytes of the random token a stream's connection is authenticated with.
TOKEN_BYTES = 16
#: Seconds the driver waits for an accepted connection's token.
HANDSHAKE_S = 10.0
#: Seconds the actor waits for its connection to the driver.
CONNECT_S = 30.0
#: Seconds a frame's send may take (frames are small: a bucket's handle, an ack).
SEND_S = 30.0
#: After the connection was lost, seconds to wait for Ray to report the call's end.
LOST_GRACE_S = 2.0

_LOST = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)


@cache
def driver_host() -> str:
    """The IP address of this process's Ray node, where the driver listens for streams."""
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


class StreamCall:
    """The driver's end of one actor's stream (one ``refit_stream`` call).

    Made by :func:`open_stream`. Requests may be issued concurrently (the coordinator
    overlaps the loads of consecutive buckets): they go out whole, in the order the
    callers reached the send, over a :class:`~asyncrefit._wire._mux.RequestChannel`, and
    replies are matched to them by id. The stream serves push after push.

    Resource handling: owns the connection; :meth:`close` closes it (idempotent), and
    the actor's call returns (giving up a version it had begun and not finished). A
    request cancelled after its frame went out leaves the stream usable: the actor
    still carries it out, in order, and its reply is dropped; so an abort sent next is
    answered only after that request (a copy) finished.

    Error handling: the connection ending or failing, or the actor call ending
    early, raises the call's Ray error translated (:class:`WorkerDiedError` for a dead
    actor, :class:`WorkerRemoteError` for an error in ``refit_stream``), or, if Ray
    reports nothing within :data:`LOST_GRACE_S`, :class:`WorkerDiedError` (the actor's
    end closes only after it stopped copying). A send that times out closes the
    stream and raises :class:`WorkerTimeoutError`. An error the actor answers a
    request with is a :class:`WorkerRemoteError` (or its more specific subclass).
    """

    def __init__(self, name: str, ref: Any) -> None:
        self.name = name
        self._future: asyncio.Future[Any] = asyncio.wrap_future(ref.future())
        self._ended = anyio.Event()
        self._sock: socket.socket | None = None
        self._requests: RequestChannel | None = None
        self._broken: str | None = None
        self._loss: anyio.Event | None = None  # set once a loss is understood
        self._future.add_done_callback(self._on_end)

    def __repr__(self) -> str:
        state = self._broken or ("ended" if self._ended.is_set() else "open")
        return f"<StreamCall {self.name!r} {state}>"

    @property
    def usable(self) -> bool:
        """Whether requests can still go over the stream."""
        return (
            self._broken is None
            and self._requests is not None
            and self._requests.failed is None
            and not self._ended.is_set()
        )

    def _on_end(self, future: asyncio.Future[Any]) -> None:
        # On the loop, when the actor call resolved: wake whoever waits on the stream.
        if not future.cancelled():
            future.exception()  # retrieved here: never logged as "never retrieved"
        self._ended.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already

    def _raise_ended(self) -> NoReturn:
        """The actor call resolved while the stream was still needed: raise its error."""
        with worker_errors(self.name):
            self._future.result()
        raise WorkerProtocolError(self.name, "refit_stream returned before its stream ended")

    async def _lost(self, exc: BaseException | None = None) -> NoReturn:
        """The connection ended or failed: close it, raise what the actor call says.

        The first request to find it lost waits (up to :data:`LOST_GRACE_S`) for Ray
        to report the call's end; every request waiting on the stream then raises
        the same typed error.
        """
        if self._loss is None:
            self._loss = anyio.Event()
            try:
                await self.close("its stream connection was lost")
                with anyio.move_on_after(LOST_GRACE_S):
                    await self._ended.wait()
            finally:
                self._loss.set()
        else:
            await self._loss.wait()
        if self._ended.is_set():
            self._raise_ended()
        raise WorkerDiedError(
            self.name, "its stream connection closed and Ray reported nothing"
        ) from exc

    # --- opening --------------------------------------------------------------------

    async def _accept(self, listener: TcpListener, token: bytes) -> None:
        """Accept the actor's connection (the first with ``token``), or raise its end."""

        async def accept() -> None:
            while True:
                sock = await listener.accept_socket()
                channel = FrameChannel(sock)
                try:
                    with anyio.move_on_after(HANDSHAKE_S):
                        if hmac.compare_digest(await channel.receive(), token):
                            self._sock = sock
                            self._requests = RequestChannel(channel, send_timeout=SEND_S)
                            if self._ended.is_set():  # too late for the callback
                                self._on_end(self._future)
                            tg.cancel_scope.cancel()
                            return
                except _LOST:
                    pass
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await channel.aclose()
                    raise
                await channel.aclose()  # not the actor: someone else found the port

        async with anyio.create_task_group() as tg:
            tg.start_soon(accept)
            await self._ended.wait()
            tg.cancel_scope.cancel()
        if self._requests is None:
            self._raise_ended()

    # --- requests -------------------------------------------------------------------

    async def request(self, message: object) -> object:
        """Send ``message`` and return the actor's reply to it (an error reply raises)."""
        if self._loss is not None:
            await self._lost()
        requests = self._requests
        if self._broken is not None or requests is None:
            raise WorkerError(self.name, f"the stream was closed: {self._broken}")
        try:
            reply = await requests.request(message)
        except ChannelFailedError as exc:
            if self._broken is not None and self._loss is None:
                raise WorkerError(self.name, f"the stream was closed: {self._broken}") from None
            if isinstance(exc.cause, TimeoutError):
                await self.close("a send timed out")
                raise WorkerTimeoutError(
                    self.name, f"sending on its stream did not finish within {SEND_S} s"
                ) from None
            await self._lost(exc.cause)
        if isinstance(reply, ErrorReply):
            raise WORKER.from_reply(self.name, reply)
        return reply

    async def _expect_done(self, message: BeginUpdate | CommitUpdate | AbortUpdate) -> None:
        reply = await self.request(message)
        if not isinstance(reply, Done):
            raise WorkerProtocolError(
                self.name, f"{type(message).__name__} answered {type(reply).__name__}"
            )

    async def begin(self, version: int, *, direct: bool = False) -> None:
        await self._expect_done(BeginUpdate(version=version, direct=direct))

    async def load(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> BucketAck:
        reply = await self.request(LoadBucket(version=version, bucket=bucket, handles=handles))
        if not isinstance(reply, BucketAck):
            raise WorkerProtocolError(
                self.name, f"refit_load answered {type(reply).__name__}, not a BucketAck"
            )
        return reply

    async def finish(self, message: CommitUpdate | AbortUpdate) -> None:
        """Send a push's last request; the stream stays open for the next push."""
        await self._expect_done(message)

    async def close(self, why: str = "closed") -> None:
        """Close the connection (the actor sees it end, and its call returns). Idempotent."""
        if self._broken is None:
            self._broken = why
        if self._requests is not None:
            await self._requests.aclose()


async def open_stream(actor: Any, name: str, host: str) -> StreamCall:
    """Start ``actor``'s ``refit_stream`` call; its stream, once the actor connected.

    Listens on a fresh port of ``host`` until the actor connected with the token (the
    listener is closed before this returns). Raises as :class:`StreamCall` does.
    """
    listener = TcpListener(host)
    try:
        token = secrets.token_bytes(TOKEN_BYTES)
        bound, port = listener.address
        with worker_errors(name):
            ref = actor.refit_stream.remote(bound, port, token)
        call = StreamCall(name, ref)
        try:
            await call._accept(listener, token)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await call.close("it did not connect")
            raise
        return call
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()


# --- the actor's end ---------------------------------------------------------------------


async def _answer(step: Awaitable[object]) -> object:
    """``step``'s result as a reply: ``Done`` for ``None``, an error as an ``ErrorReply``."""
    try:
        value = await step
    except Exception as exc:
        return error_reply(exc)
    return Done() if value is None else value


async def serve_stream(worker: StreamedWorker, host: str, port: int, token: bytes) -> int:
    """The actor's end of a stream: connect, then serve requests in order until it ends.

    Every request goes to ``worker``'s own ``refit_begin`` / ``refit_load`` /
    ``refit_commit`` / ``refit_abort`` and is answered after it returned (a load's
    answer after the copy, with every view dropped). Returns the requests served once
    the driver closed the connection; a version begun and neither committed nor
    aborted is then given up (unless a newer stream call started meanwhile).

    A begin is refused once a newer stream call started (Ray may run an actor's calls
    in any order): a stream the driver gave up never begins a version over a newer
    stream's push.

    Requests are served by the one serve loop (:func:`asyncrefit._wire._serve.serve`):
    a handle never carried and a request of another kind are answered with a protocol
    error, a reply that does not pickle with its error.

    Resource handling: the connection is closed on the way out; nothing is left
    running (each request is awaited before the next is read).
    """
    epoch = worker._refit_stream_started()
    with anyio.fail_after(CONNECT_S):
        channel = await connect_tcp(host, port)
    pending: int | None = None  # a version begun here, not yet committed or aborted

    async def handle(message: object) -> object:
        nonlocal pending
        reply: object
        match message:
            case BeginUpdate(version=v, direct=direct):
                if not worker._refit_stream_current(epoch):
                    return ErrorReply(
                        type="AsyncRefitError",
                        message=f"the stream of this push (version {v}) was superseded "
                        "by a newer one",
                        kind="error",
                    )
                begin = worker.refit_begin_direct(v) if direct else worker.refit_begin(v)
                reply = await _answer(begin)
                if not isinstance(reply, ErrorReply):
                    pending = v
            case LoadBucket(version=v, bucket=b, handles=h):
                reply = await _answer(worker.refit_load(v, b, h))
            case CommitUpdate(version=v, buckets=n):
                reply = await _answer(worker.refit_commit(v, n))
                if not isinstance(reply, ErrorReply) and v == pending:
                    pending = None
            case AbortUpdate(version=v, unwritten=unwritten):
                abort = worker.refit_abort_unwritten(v) if unwritten else worker.refit_abort(v)
                reply = await _answer(abort)
                if not isinstance(reply, ErrorReply) and v == pending:
                    pending = None
            case _:
                reply = protocol_reply(
                    f"{type(message).__name__} is not a request of a refit stream"
                )
        return reply

    served = Served()
    try:
        try:
            await channel.send(token, within=SEND_S)
        except (*_LOST, TimeoutError):
            return served.requests
        await serve(
            channel,
            RefDecoder(),
            handle,
            until=lambda _: False,
            send_timeout=SEND_S,
            unknown=lambda exc: protocol_reply(str(exc)),
            encode_failures=True,
            served=served,
        )
        if pending is not None:  # the driver closed the stream mid-push
            await worker._refit_stream_lost(pending, epoch)
        return served.requests
    finally:
        with anyio.CancelScope(shield=True):
            await channel.aclose()
