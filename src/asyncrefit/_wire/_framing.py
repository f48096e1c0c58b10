"""Length-prefixed frames over an anyio byte stream or a blocking socket.

The framing itself (:func:`frame`, :data:`MAX_FRAME`) lives in
:mod:`asyncrefit._wire._channel`. :class:`FrameReader` reads frames from an anyio
stream, safe to cancel mid-read (it owns only its buffer; the stream is the caller's;
errors: the stream's own, and :class:`ValueError` for an oversized frame).
:class:`BlockingFrames` is a blocking Unix-socket client for a process without an
event loop (a vLLM worker): it owns its socket.
"""

from __future__ import annotations

import socket

from anyio.abc import ByteReceiveStream, ByteSendStream

from ._channel import HEADER, MAX_FRAME, frame

__all__ = ("MAX_FRAME", "BlockingFrames", "FrameReader", "frame", "send_frame")


async def send_frame(stream: ByteSendStream, payload: bytes) -> None:
    await stream.send(frame(payload))


class FrameReader:
    """Reads whole frames from a stream.

    Every byte received stays in this reader's buffer until a whole frame is there,
    so a read cancelled half-way loses nothing: the next :meth:`receive` continues
    where it stopped. Raises ``anyio.EndOfStream`` when the peer closed.
    """

    def __init__(self, stream: ByteReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def receive(self) -> bytes:
        while True:
            if len(self._buffer) >= HEADER:
                size = int.from_bytes(self._buffer[:HEADER], "big")
                if size > MAX_FRAME:
                    raise ValueError(f"frame of {size} bytes is larger than allowed")
                end = HEADER + size
                if len(self._buffer) >= end:
                    payload = bytes(self._buffer[HEADER:end])
                    del self._buffer[:end]
                    return payload
            chunk = await self._stream.receive(1 << 20)
            self._buffer.extend(chunk)


class BlockingFrames:
    """Whole frames over a blocking Unix-socket connection to ``path``.

    Every operation is bounded by ``timeout`` seconds (``socket.timeout`` past it);
    :class:`ConnectionError` when the peer closed or after :meth:`close`,
    :class:`ValueError` for an oversized frame. Resource handling: :meth:`close`
    closes the socket; idempotent.
    """

    def __init__(self, path: str, timeout: float) -> None:
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
        except BaseException:
            self.close()
            raise

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise ConnectionError("the channel is closed")
        return self._sock

    def send(self, payload: bytes) -> int:
        """Send one frame; returns its size in bytes (the length prefix included)."""
        data = frame(payload)
        self._socket().sendall(data)
        return len(data)

    def _exactly(self, n: int) -> bytes:
        sock = self._socket()
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("the peer closed the channel")
            got += k
        return bytes(buf)

    def receive(self) -> bytes:
        """The next frame's payload; blocks up to the timeout."""
        size = int.from_bytes(self._exactly(HEADER), "big")
        if size > MAX_FRAME:
            raise ValueError(f"frame of {size} bytes is larger than allowed")
        return self._exactly(size)

    def wait_forever(self) -> None:
        """From now on a :meth:`receive` waits without a bound (a thread that serves the
        channel); sends stay bounded by nothing either: frames are small."""
        self._socket().settimeout(None)

    def close(self) -> None:
        """Close the socket; a thread blocked in :meth:`receive` wakes with
        :class:`ConnectionError` (the socket is shut down first: closing alone does not
        wake it)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # never connected, or the peer is gone
            sock.close()
