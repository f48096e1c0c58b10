"""The vLLM worker's frames: a request id in front of a message of the one vocabulary.

Each vLLM worker keeps one Unix-socket connection to the adapter that serves its
rank. The adapter writes a request frame on that rank's connection only, then sends
vLLM a small trigger RPC (the same for every rank: a request id); each worker reads
the frame addressed to it, handles it and answers on its own connection. Handles
therefore travel to exactly one worker, and what a worker receives per bucket does
not depend on how many workers the engine has.

Each worker keeps a second connection, its control channel (greeted with
:class:`ControlHello`), which a thread of the worker serves as frames arrive, with no
engine RPC: the begin, commit and abort of a version the trainer writes directly. The
frames are the same.

Owns only what is vLLM's own: the names vLLM loads (:data:`BACKEND`,
:data:`EXTENSION`), the greeting's role (:class:`RankHello`), the requests of LoRA
adapters (:class:`DeclareAdapter`, and :class:`ToAdapter` around the usual ones, sent
in full: an adapter's buckets are few) and the worker's blocking end
(:class:`BlockingChannel`). Everything else is the one wire stack's: a frame's
payload is ``(request id, message)`` of the one vocabulary
(:mod:`asyncrefit._wire._messages`, :class:`~asyncrefit._wire._messages.Aborted`
included), with handles by reference as local and Ray workers get them
(:mod:`asyncrefit._wire._refs`: the adapter keeps a
:class:`~asyncrefit._wire._refs.RefEncoder` per rank, the worker a
:class:`~asyncrefit._wire._refs.RefDecoder`); the framing over a blocking socket is
:mod:`asyncrefit._wire._framing`'s. This module imports neither torch nor vLLM: both
sides use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from .._wire._channel import frame
from .._wire._framing import BlockingFrames
from .._wire._messages import Hello, Request, decode, encode
from .._wire._refs import RefDecoder
from ._lora import LoRAAdapter

#: The name asyncrefit's weight-transfer engine is registered under in vLLM.
BACKEND = "asyncrefit"
#: The worker extension class vLLM must load (``worker_extension_cls``).
EXTENSION = "asyncrefit.vllm.worker.RefitWorkerExtension"
#: The worker method that serves one request outside a weight-update session.
SERVE_METHOD = "asyncrefit_serve"
#: The worker method that closes the worker's channel (vLLM 0.26 has no
#: ``shutdown_weight_transfer_engine``; this one works on every release).
SHUTDOWN_METHOD = "asyncrefit_shutdown"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankHello(Hello):
    """The first frame a vLLM worker sends on its connection: the shared
    :class:`~asyncrefit._wire._messages.Hello`, its role ``"vllm-rank"``."""

    role: Literal["vllm-rank"] = "vllm-rank"


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlHello(Hello):
    """The first frame on a vLLM worker's second connection, its control channel: a
    thread of the worker serves it on its own, with no engine RPC (the begin and the
    commit of a version the trainer writes directly)."""

    role: Literal["vllm-control"] = "vllm-control"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareAdapter:
    """Check ``adapter`` against the engine and take its pushes from now on; answered
    with the adapter's specs (:class:`~asyncrefit._wire._messages.SpecsReply`). Declaring
    the same adapter again is answered the same; another adapter under its name or id
    is refused."""

    adapter: LoRAAdapter


@dataclass(frozen=True, slots=True, kw_only=True)
class ToAdapter:
    """``request`` (a begin, a bucket, a commit, an abort, a version, a release) for
    the declared adapter named ``adapter``, not for the engine's weights."""

    adapter: str
    request: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class InstallAdapter:
    """Put ``version`` of the adapter in (every rank built it at its commit): the
    second step of an adapter's commit, so that no rank swaps before every rank could
    build it."""

    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveAdapter:
    """Take the adapter out: an install that failed at one rank leaves no rank serving
    it, rather than ranks serving different versions."""


#: What a rank's channels carry: the one vocabulary's requests, and an adapter's.
RankRequest: TypeAlias = Request | DeclareAdapter | ToAdapter


def body(request_id: int, message: object) -> bytes:
    """A frame's payload (what follows the length): ``(request_id, message)``, every
    handle in full (the adapter's requests go by reference instead)."""
    return encode((request_id, message))


def pack(request_id: int, message: object) -> bytes:
    """One whole frame carrying ``message`` under ``request_id``."""
    return frame(body(request_id, message))


def unpack(payload: bytes) -> tuple[int, Any]:
    """``(request id, message)`` of a payload made by :func:`body` (the part after the
    length); ``ValueError`` for anything else."""
    message = decode(payload)
    if not (isinstance(message, tuple) and len(message) == 2 and isinstance(message[0], int)):
        raise ValueError(f"not a (request id, message) frame: {type(message).__name__}")
    return message[0], message[1]


class BlockingChannel:
    """The worker's end: a blocking Unix-socket client (a vLLM worker has no event loop).

    Every operation is bounded by ``timeout`` seconds (``socket.timeout`` past it).
    Resource handling: :meth:`close` closes the socket; idempotent.
    """

    def __init__(self, path: str, timeout: float) -> None:
        self._frames = BlockingFrames(path, timeout)
        self._refs = RefDecoder()

    def send(self, request_id: int, message: object) -> int:
        """Send one frame; returns its size in bytes."""
        return self._frames.send(body(request_id, message))

    def receive(self) -> tuple[int, Any]:
        """The next frame's ``(request id, message)``, a load's handles resolved by
        reference; blocks up to the timeout. Every frame must pass through here, in the
        order it arrived (frames the caller skips included): the reference table
        follows the frames."""
        return self._refs.decode(self._frames.receive())

    def wait_forever(self) -> None:
        """Receive without a bound from now on (the control thread's channel)."""
        self._frames.wait_forever()

    def close(self) -> None:
        """Close the socket (waking a thread blocked in :meth:`receive`)."""
        self._frames.close()
