"""Length-prefixed frames over a byte stream, safe to cancel mid-read."""

from __future__ import annotations

from anyio.abc import ByteReceiveStream, ByteSendStream

_HEADER = 8
MAX_FRAME = 1 << 32


def frame(payload: bytes) -> bytes:
    """``payload`` with its 8-byte big-endian length in front."""
    return len(payload).to_bytes(_HEADER, "big") + payload


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
            if len(self._buffer) >= _HEADER:
                size = int.from_bytes(self._buffer[:_HEADER], "big")
                if size > MAX_FRAME:
                    raise ValueError(f"frame of {size} bytes is larger than allowed")
                end = _HEADER + size
                if len(self._buffer) >= end:
                    payload = bytes(self._buffer[_HEADER:end])
                    del self._buffer[:end]
                    return payload
            chunk = await self._stream.receive(1 << 20)
            self._buffer.extend(chunk)
