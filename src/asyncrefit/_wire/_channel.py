"""One framed channel over a connected Unix stream socket, safe to cancel.

The local backend talks to its worker processes over such a channel: length-prefixed
frames (an 8-byte big-endian length, then the payload), replies matched to requests
by id by the caller.

Why not anyio's socket streams: on uvloop, cancelling a task blocked in
``SocketStream.receive`` can leave the readiness callback scheduled on a future that
was already cancelled, and the loop's exception handler then reports
``InvalidStateError`` (a traceback on stderr per occurrence). The channel waits with
:func:`anyio.wait_readable` / :func:`anyio.wait_writable`, which remove their
callback before returning, and does the non-blocking reads and writes itself.
"""

from __future__ import annotations

import socket

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

__all__ = (
    "FrameChannel",
    "HEADER",
    "MAX_FRAME",
    "TcpListener",
    "UnixListener",
    "connect_tcp",
    "connect_unix",
    "frame",
)

#: Bytes of a frame's length prefix.
HEADER = 8
#: The largest payload a frame may carry.
MAX_FRAME = 1 << 32
#: Bytes read from the socket at a time.
_CHUNK = 1 << 20


def frame(payload: bytes) -> bytes:
    """``payload`` with its 8-byte big-endian length in front."""
    return len(payload).to_bytes(HEADER, "big") + payload


class FrameChannel:
    """Whole frames over a connected stream socket (the channel owns the socket).

    :meth:`receive` is cancel-safe: bytes received stay buffered until a whole frame
    is there, so a cancelled read loses nothing and the next one continues. :meth:`send`
    is shielded from cancellation, so a frame is never cut in half, and bounded by a
    timeout; after a timeout the channel is closed, since part of a frame may be out.

    Errors are anyio's: :class:`anyio.EndOfStream` when the peer closed,
    :class:`anyio.BrokenResourceError` when the socket failed,
    :class:`anyio.ClosedResourceError` once :meth:`aclose` was called (a task waiting
    in :meth:`receive` is woken with it), :class:`TimeoutError` from a send that did
    not finish in time.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._buffer = bytearray()
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._sock.fileno()}"
        return f"<FrameChannel {state} buffered={len(self._buffer)}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def _take(self) -> bytes | None:
        if len(self._buffer) < HEADER:
            return None
        size = int.from_bytes(self._buffer[:HEADER], "big")
        if size > MAX_FRAME:
            raise anyio.BrokenResourceError(f"frame of {size} bytes is larger than allowed")
        end = HEADER + size
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[HEADER:end])
        del self._buffer[:end]
        return payload

    async def receive(self) -> bytes:
        """The next whole frame's payload."""
        await checkpoint_if_cancelled()
        while True:
            payload = self._take()
            if payload is not None:
                return payload
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                chunk = self._sock.recv(_CHUNK)
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
                continue
            except OSError as exc:
                if self._closed:
                    raise anyio.ClosedResourceError from None
                raise anyio.BrokenResourceError from exc
            if not chunk:
                raise anyio.EndOfStream
            if not self._buffer and len(chunk) > HEADER:
                # Mostly one whole frame came (a reply, a request): no buffering.
                size = int.from_bytes(chunk[:HEADER], "big")
                if len(chunk) == HEADER + size:
                    return chunk[HEADER:]
            self._buffer += chunk

    async def send(self, payload: bytes, *, within: float) -> None:
        """Send ``payload`` as one frame, shielded from cancellation, within ``within`` s."""
        data = memoryview(frame(payload))
        # Most frames fit in the socket's buffer: sent at once, with no await (so
        # nothing to shield) and without the cost of the scopes below.
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise anyio.BrokenResourceError from exc
        if sent == len(data):
            return
        data = data[sent:]
        with anyio.CancelScope(shield=True), anyio.move_on_after(within) as scope:
            while data:
                if self._closed:
                    raise anyio.ClosedResourceError
                try:
                    sent = self._sock.send(data)
                except BlockingIOError:
                    await anyio.wait_writable(self._sock)
                    continue
                except OSError as exc:
                    if self._closed:
                        raise anyio.ClosedResourceError from None
                    raise anyio.BrokenResourceError from exc
                data = data[sent:]
        if scope.cancelled_caught:
            await self.aclose()
            raise TimeoutError(f"sending a frame did not finish within {within} s")

    async def aclose(self) -> None:
        """Close the socket, waking a task blocked in :meth:`receive`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        anyio.notify_closing(self._sock)
        self._sock.close()
        await anyio.lowlevel.checkpoint()


class UnixListener:
    """A listening Unix socket whose :meth:`accept` yields :class:`FrameChannel`\\ s."""

    def __init__(self, path: str, backlog: int = 64) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.path = path

    async def accept(self) -> FrameChannel:
        """The next connection, as a channel."""
        await checkpoint_if_cancelled()
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
                continue
            return FrameChannel(conn)

    async def aclose(self) -> None:
        """Stop listening (the path is the caller's to remove). Idempotent."""
        if self._sock.fileno() >= 0:
            anyio.notify_closing(self._sock)
            self._sock.close()
        await anyio.lowlevel.checkpoint()


def connect_unix(path: str) -> FrameChannel:
    """A channel connected to the listener at ``path`` (a local connect: immediate)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return FrameChannel(sock)


# --- TCP: the Ray backend's per-push streams between the driver and actors ------------


def _tcp_socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM)


def _no_delay(sock: socket.socket) -> socket.socket:
    # Small frames (a bucket's notification, an ack) go out at once, not after 40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class TcpListener:
    """A listening TCP socket on ``host`` (``port`` 0: a free one), non-blocking.

    :meth:`accept_socket` returns the raw connected socket (non-blocking, with
    ``TCP_NODELAY``): the caller wraps it in a :class:`FrameChannel` and may keep the
    socket to interrupt a read (``shutdown``). Anyone who can reach the port can
    connect: authenticate connections (a token sent first) before trusting them.
    """

    def __init__(self, host: str, port: int = 0, backlog: int = 64) -> None:
        sock = _tcp_socket(host)
        try:
            sock.bind((host, port))
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the listener is bound to."""
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    async def accept_socket(self) -> socket.socket:
        """The next connection's socket (non-blocking, ``TCP_NODELAY``)."""
        await checkpoint_if_cancelled()
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
                continue
            except OSError as exc:
                if self._sock.fileno() < 0:
                    raise anyio.ClosedResourceError from None
                raise anyio.BrokenResourceError from exc
            conn.setblocking(False)
            return _no_delay(conn)

    async def aclose(self) -> None:
        """Stop listening. Idempotent."""
        if self._sock.fileno() >= 0:
            anyio.notify_closing(self._sock)
            self._sock.close()
        await anyio.lowlevel.checkpoint()


async def connect_tcp(host: str, port: int) -> FrameChannel:
    """A channel connected to ``(host, port)`` (non-blocking connect, ``TCP_NODELAY``).

    Bound it with a timeout: a host that drops packets never answers. Raises
    :class:`OSError` when the connection is refused or fails.
    """
    import errno
    import os

    sock = _tcp_socket(host)
    try:
        sock.setblocking(False)
        err = sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            raise OSError(err, f"connecting to {host}:{port}: {os.strerror(err)}")
        if err:
            await anyio.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, f"connecting to {host}:{port}: {os.strerror(err)}")
        return FrameChannel(_no_delay(sock))
    except BaseException:
        sock.close()
        raise
