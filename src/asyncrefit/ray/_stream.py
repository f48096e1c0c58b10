"""One actor call per push: a push's per-bucket requests over a TCP stream.

Ray's cost per actor call (~0.7 ms of the caller's CPU) made the per-bucket calls
(``refit_load``) the driver's main cost: one call per worker per bucket. On the
streaming path a push costs one actor call per worker:

1. ``RayWorker.begin_update`` listens on a fresh port of the driver's node IP (the one
   Ray reports) and submits ``refit_stream(version, host, port, token)``: the call
   runs on the actor's loop for the whole push. The actor connects and sends the
   random token first (the driver drops connections that do not); the driver answers
   :class:`BeginUpdate`, and the actor begins the version and answers
   :class:`~asyncrefit._messages.Done` (or an :class:`ErrorReply`). An actor never
   begins for a driver that gave the push up, nor after a newer stream call started.
2. Each ``load_bucket`` is one :class:`LoadBucket` frame out and one
   :class:`BucketAck` frame back, in the framing of :mod:`asyncrefit._channel`; the
   actor takes them one after the other, in the order sent, through its own
   ``refit_load`` (overrides apply), and answers only after the copy.
3. ``commit_update`` / ``abort_update`` send :class:`CommitUpdate` /
   :class:`AbortUpdate`; the actor answers and returns from the call, whose result
   the driver then awaits.

The actor call's end is watched throughout: when its ``ObjectRef`` resolves first
(the actor died, its node was lost, ``refit_stream`` raised), the driver's socket is
shut down so a pending read wakes, and the Ray error is translated by
:func:`~asyncrefit.ray._errors.worker_errors` as for any call.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
from functools import cache
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from .._channel import FrameChannel, TcpListener, connect_tcp
from .._endpoint import error_reply
from .._exceptions import (
    WorkerDiedError,
    WorkerError,
    WorkerProtocolError,
    WorkerTimeoutError,
    remote_error,
)
from .._messages import (
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    Done,
    ErrorReply,
    LoadBucket,
    decode,
    encode,
)
from ._errors import worker_errors

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from ..transport._base import Handle
    from ._worker import RefitWorkerMixin

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
    """The driver's end of one push's stream to one actor.

    Made by :func:`open_stream`. Requests may be issued concurrently (the coordinator
    overlaps the loads of consecutive buckets); they are sent one whole frame at a
    time and the actor answers them in order, so replies are matched to requests by
    their position.

    Resource handling: owns the connection; :meth:`close` closes it (idempotent).
    A request cancelled after its frame went out closes the stream, since its reply
    would never be consumed: the actor then sees the connection end, finishes what it
    is copying and gives the version up; later requests raise :class:`WorkerError`,
    and an abort goes by a per-call ``refit_abort`` (answered after that copy).

    Error handling: the connection ending or failing, or the actor call ending
    early, raises the call's Ray error translated (:class:`WorkerDiedError` for a dead
    actor, :class:`WorkerRemoteError` for an error in ``refit_stream``), or, if Ray
    reports nothing within :data:`LOST_GRACE_S`, :class:`WorkerDiedError` (the actor's
    end closes only after it stopped copying). An error the actor answers a request
    with is a :class:`WorkerRemoteError` (or its more specific subclass).
    """

    def __init__(self, name: str, version: int, ref: Any) -> None:
        self.name = name
        self.version = version
        self._future: asyncio.Future[Any] = asyncio.wrap_future(ref.future())
        self._ended = anyio.Event()
        self._sock: socket.socket | None = None
        self._channel: FrameChannel | None = None
        self._broken: str | None = None
        self._loss: anyio.Event | None = None  # set once a loss is understood
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._sent = 0
        self._received = 0
        self._replies: dict[int, bytes] = {}
        self._reading = False
        self._waiting = 0
        self._arrived = anyio.Event()
        self._future.add_done_callback(self._on_end)

    def __repr__(self) -> str:
        state = self._broken or ("ended" if self._ended.is_set() else "open")
        return f"<StreamCall {self.name!r} version={self.version} {state}>"

    @property
    def usable(self) -> bool:
        """Whether requests can still go over the stream."""
        return self._broken is None and self._channel is not None and not self._channel.closed

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
            self.name, "its stream connection closed mid-push and Ray reported nothing"
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
                            self._sock, self._channel = sock, channel
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
        if self._channel is None:
            self._raise_ended()

    # --- requests -------------------------------------------------------------------

    async def _reply(self, seq: int) -> object:
        """The reply to request ``seq`` (whoever waits reads; replies come in order)."""
        try:
            while seq not in self._replies:
                if self._loss is not None:
                    await self._lost()
                if self._broken is not None:
                    raise WorkerError(self.name, f"the stream was closed: {self._broken}")
                if self._reading:
                    self._waiting += 1
                    try:
                        await self._arrived.wait()
                    finally:
                        self._waiting -= 1
                    continue
                channel = self._channel
                assert channel is not None
                self._reading = True
                try:
                    data = await channel.receive()
                except _LOST as exc:
                    await self._lost(exc)
                finally:
                    self._reading = False
                    self._wake()
                self._replies[self._received] = data
                self._received += 1
            return decode(self._replies.pop(seq))
        except BaseException as exc:
            if not isinstance(exc, WorkerError):  # cancelled: the reply is never consumed
                with anyio.CancelScope(shield=True):
                    await self.close("a request on it was cancelled")
            raise

    async def request(self, message: object) -> object:
        """Send ``message`` and return the actor's reply to it (an error reply raises)."""
        data = encode(message)
        async with self._send_lock:
            if self._loss is not None:
                await self._lost()
            if self._broken is not None or self._channel is None:
                raise WorkerError(self.name, f"the stream was closed: {self._broken}")
            seq = self._sent
            try:
                await self._channel.send(data, within=SEND_S)
            except TimeoutError:
                await self.close("a send timed out")
                raise WorkerTimeoutError(
                    self.name, f"sending on its stream did not finish within {SEND_S} s"
                ) from None
            except _LOST as exc:
                await self._lost(exc)
            self._sent += 1
        reply = await self._reply(seq)
        if isinstance(reply, ErrorReply):
            raise remote_error(self.name, reply.type, reply.message)
        return reply

    async def load(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> BucketAck:
        reply = await self.request(LoadBucket(version=version, bucket=bucket, handles=handles))
        if not isinstance(reply, BucketAck):
            raise WorkerProtocolError(
                self.name, f"refit_load answered {type(reply).__name__}, not a BucketAck"
            )
        return reply

    async def finish(self, message: CommitUpdate | AbortUpdate) -> None:
        """Send the push's last request, then await the actor call's end."""
        try:
            reply = await self.request(message)
            if not isinstance(reply, Done):
                raise WorkerProtocolError(
                    self.name, f"{type(message).__name__} answered {type(reply).__name__}"
                )
            await self._ended.wait()
            with worker_errors(self.name):
                self._future.result()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close("the push ended")

    def _wake(self) -> None:
        """Wake the requests waiting for another's read."""
        if self._waiting:
            arrived, self._arrived = self._arrived, anyio.Event()
            arrived.set()

    async def close(self, why: str = "closed") -> None:
        """Close the connection (the actor sees it end). Idempotent."""
        if self._broken is None:
            self._broken = why
        self._wake()
        if self._channel is not None:
            await self._channel.aclose()


async def open_stream(actor: Any, name: str, version: int, host: str) -> StreamCall:
    """Begin ``version`` on ``actor`` by one long ``refit_stream`` call; its stream.

    Listens on a fresh port of ``host`` until the actor connected with the token
    (the listener is closed before this returns), then awaits the actor's answer to
    the begin. Raises as :class:`StreamCall` does; an error the begin raised in the
    actor is a :class:`WorkerRemoteError`.
    """
    listener = TcpListener(host)
    try:
        token = secrets.token_bytes(TOKEN_BYTES)
        bound, port = listener.address
        with worker_errors(name):
            ref = actor.refit_stream.remote(version, bound, port, token)
        call = StreamCall(name, version, ref)
        try:
            await call._accept(listener, token)
            reply = await call.request(BeginUpdate(version=version))
            if not isinstance(reply, Done):
                raise WorkerProtocolError(name, f"refit_begin answered {type(reply).__name__}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await call.close("its begin failed")
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


def _encoded(reply: object) -> bytes:
    try:
        return encode(reply)
    except Exception as exc:  # an override returned something that does not pickle
        return encode(error_reply(exc))


async def serve_stream(
    worker: RefitWorkerMixin, version: int, host: str, port: int, token: bytes
) -> int:
    """The actor's end of a push's stream: connect, begin, serve requests in order.

    Every request goes to ``worker``'s own ``refit_begin`` / ``refit_load`` /
    ``refit_commit`` / ``refit_abort`` and is answered after it returned (a load's
    answer after the copy, with every view dropped). Returns after answering the
    commit or abort, or when the driver closed the connection (the version is then
    given up, unless another push began meanwhile). Returns the requests served.

    The begin waits for the driver's :class:`BeginUpdate`, and is refused if a newer
    stream call started meanwhile (Ray may run an actor's calls in any order): a
    stream the driver gave up never begins a version over a newer push's.

    Resource handling: the connection is closed on the way out; nothing is left
    running (each request is awaited before the next is read).
    """
    epoch = worker._refit_stream_started()
    with anyio.fail_after(CONNECT_S):
        channel = await connect_tcp(host, port)
    served = 0
    try:
        try:
            await channel.send(token, within=SEND_S)
            message = decode(await channel.receive())
            if not isinstance(message, BeginUpdate) or message.version != version:
                reply: object = ErrorReply(
                    type="ProtocolError", message=f"{type(message).__name__} before the begin"
                )
            elif not worker._refit_stream_current(epoch):
                reply = ErrorReply(
                    type="AsyncRefitError",
                    message=f"the stream of version {version} was superseded by a newer one",
                )
            else:
                reply = await _answer(worker.refit_begin(version))
            await channel.send(_encoded(reply), within=SEND_S)
        except (*_LOST, TimeoutError):  # the driver gave the begin up
            await worker._refit_stream_lost(version, epoch)
            return served
        if isinstance(reply, ErrorReply):
            return served
        while True:
            try:
                message = decode(await channel.receive())
            except _LOST:
                await worker._refit_stream_lost(version, epoch)
                return served
            last = False
            match message:
                case LoadBucket(version=v, bucket=b, handles=h):
                    reply = await _answer(worker.refit_load(v, b, h))
                case CommitUpdate(version=v, buckets=n):
                    reply, last = await _answer(worker.refit_commit(v, n)), True
                case AbortUpdate(version=v):
                    reply, last = await _answer(worker.refit_abort(v)), True
                case _:
                    reply = ErrorReply(
                        type="ProtocolError",
                        message=f"{type(message).__name__} is not a request of a refit stream",
                    )
            served += 1
            try:
                await channel.send(_encoded(reply), within=SEND_S)
            except (*_LOST, TimeoutError):
                await worker._refit_stream_lost(version, epoch)
                return served
            if last:
                return served
    finally:
        with anyio.CancelScope(shield=True):
            await channel.aclose()
