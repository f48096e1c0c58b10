"""The per-worker channel between a coordinator-side adapter and one vLLM worker.

Each vLLM worker keeps one Unix-socket connection to the adapter that serves its
rank. The adapter writes a request frame on that rank's connection only, then sends
vLLM a small trigger RPC (the same for every rank: a request id); each worker reads
the frame addressed to it, handles it and answers on its own connection. Handles
therefore travel to exactly one worker, and what a worker receives per bucket does
not depend on how many workers the engine has.

A frame is ``length (8 bytes) | request id (8 bytes) | pickled message``, built on
:mod:`asyncrefit._wire._framing`. This module imports neither torch nor vLLM: both
sides use it.
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from typing import Any

from .._wire._framing import frame
from .._wire._messages import encode

#: The name asyncrefit's weight-transfer engine is registered under in vLLM.
BACKEND = "asyncrefit"
#: The worker extension class vLLM must load (``worker_extension_cls``).
EXTENSION = "asyncrefit.vllm.worker.RefitWorkerExtension"
#: The worker method that serves one request outside a weight-update session.
SERVE_METHOD = "asyncrefit_serve"

_ID_BYTES = 8
_LENGTH_BYTES = 8
#: Bytes a frame adds to its pickled message: the length and the request id.
FRAME_OVERHEAD = _LENGTH_BYTES + _ID_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """The first frame a worker sends on its connection: who it is."""

    rank: int
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Aborted:
    """A worker's answer to an abort: the complete version it holds after it, and
    whether any byte of the aborted version had been written into its model."""

    version: int | None
    written: bool


def body(request_id: int, message: object) -> bytes:
    """A frame's payload (what follows the length): ``request_id``, then ``message``."""
    return request_id.to_bytes(_ID_BYTES, "big") + encode(message)


def pack(request_id: int, message: object) -> bytes:
    """One whole frame carrying ``message`` under ``request_id``."""
    return frame(body(request_id, message))


def unpack(payload: bytes) -> tuple[int, Any]:
    """``(request id, message)`` of a frame's payload (the part after the length)."""
    if len(payload) < _ID_BYTES:
        raise ValueError(f"frame of {len(payload)} bytes has no request id")
    return int.from_bytes(payload[:_ID_BYTES], "big"), pickle.loads(payload[_ID_BYTES:])


class BlockingChannel:
    """The worker's end: a blocking Unix-socket client (a vLLM worker has no event loop).

    Every operation is bounded by ``timeout`` seconds (``socket.timeout`` past it).
    Resource handling: :meth:`close` closes the socket; idempotent.
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
            raise ConnectionError("the asyncrefit channel is closed")
        return self._sock

    def send(self, request_id: int, message: object) -> int:
        """Send one frame; returns its size in bytes."""
        data = pack(request_id, message)
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
                raise ConnectionError("the coordinator closed the asyncrefit channel")
            got += k
        return bytes(buf)

    def receive(self) -> tuple[int, Any]:
        """The next frame's ``(request id, message)``; blocks up to the timeout."""
        size = int.from_bytes(self._exactly(_LENGTH_BYTES), "big")
        return unpack(self._exactly(size))

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
