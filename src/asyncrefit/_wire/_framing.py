"""Length-prefixed frames over an anyio byte stream, safe to cancel mid-read.

The framing itself (:func:`frame`, :data:`MAX_FRAME`) lives in
:mod:`asyncrefit._wire._channel`; this reader serves the links that still read
through anyio streams (the vLLM link). It owns only its buffer; the stream is the
caller's. Errors: the stream's own, and :class:`ValueError` for an oversized frame.
"""

from __future__ import annotations

from anyio.abc import ByteReceiveStream, ByteSendStream

from ._channel import HEADER, MAX_FRAME, frame

__all__ = ("MAX_FRAME", "FrameReader", "frame", "send_frame")


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
