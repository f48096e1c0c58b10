"""The vLLM worker's frames: a request id in front of a message of the one vocabulary.

Each vLLM worker keeps one Unix-socket connection to the adapter that serves its
rank. The adapter writes a request frame on that rank's connection only, then sends
vLLM a small trigger RPC (the same for every rank: a request id); each worker reads
the frame addressed to it, handles it and answers on its own connection. Handles
therefore travel to exactly one worker, and what a worker receives per bucket does
not depend on how many workers the engine has.

Owns only what is vLLM's own: the names vLLM loads (:data:`BACKEND`,
:data:`EXTENSION`), the frame's request-id header (a frame is ``length (8 bytes) |
request id (8 bytes) | message``), the greeting's role (:class:`RankHello`) and the
worker's blocking end (:class:`BlockingChannel`). The messages and their codec are
:mod:`asyncrefit._wire._messages`' (:class:`~asyncrefit._wire._messages.Aborted`, the
answer to an abort, included); the framing over a blocking socket is
:mod:`asyncrefit._wire._framing`'s. This module imports neither torch nor vLLM: both
sides use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .._wire._channel import HEADER, frame
from .._wire._framing import BlockingFrames
from .._wire._messages import Hello, decode, encode

#: The name asyncrefit's weight-transfer engine is registered under in vLLM.
BACKEND = "asyncrefit"
#: The worker extension class vLLM must load (``worker_extension_cls``).
EXTENSION = "asyncrefit.vllm.worker.RefitWorkerExtension"
#: The worker method that serves one request outside a weight-update session.
SERVE_METHOD = "asyncrefit_serve"

_ID_BYTES = 8
#: Bytes a frame adds to its encoded message: the length and the request id.
FRAME_OVERHEAD = HEADER + _ID_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class RankHello(Hello):
    """The first frame a vLLM worker sends on its connection: the shared
    :class:`~asyncrefit._wire._messages.Hello`, its role ``"vllm-rank"``."""

    role: Literal["vllm-rank"] = "vllm-rank"


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
    return int.from_bytes(payload[:_ID_BYTES], "big"), decode(payload[_ID_BYTES:])


class BlockingChannel:
    """The worker's end: a blocking Unix-socket client (a vLLM worker has no event loop).

    Every operation is bounded by ``timeout`` seconds (``socket.timeout`` past it).
    Resource handling: :meth:`close` closes the socket; idempotent.
    """

    def __init__(self, path: str, timeout: float) -> None:
        self._frames = BlockingFrames(path, timeout)

    def send(self, request_id: int, message: object) -> int:
        """Send one frame; returns its size in bytes."""
        return self._frames.send(body(request_id, message))

    def receive(self) -> tuple[int, Any]:
        """The next frame's ``(request id, message)``; blocks up to the timeout."""
        return unpack(self._frames.receive())

    def close(self) -> None:
        self._frames.close()
