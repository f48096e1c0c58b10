"""The codec and the vocabulary: what a coordinator and its peers say to each other.

Owns :func:`encode` / :func:`decode` (pickle protocol 5: local, trusted peers only)
and the messages. Every message is a frozen, slotted, keyword-only dataclass.
Requests and replies each form one union, dispatched with ``match``. Handles are
transport records (see :mod:`asyncrefit.transport`): small, and never tensors or
coroutines. A peer's first frame on a connection is a :class:`Hello`; a request that
failed is answered with an :class:`ErrorReply` (turned back into a typed error by
:mod:`asyncrefit._wire._errors`). The trainer ranks' requests and replies live with
the ranks (:mod:`asyncrefit.trainer._rank`) and travel with this codec.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from .._core._plan import ParamSpec
from .._device import DeviceId
from ..transport._base import Handle
from ..transport.destinations import Destinations
from ._pickling import FastPickle

__all__ = (
    "AbortUpdate",
    "Aborted",
    "BeginUpdate",
    "BucketAck",
    "CommitUpdate",
    "DeviceReply",
    "Digest",
    "DigestReply",
    "Done",
    "ErrorReply",
    "Forward",
    "ForwardReply",
    "GetSpecs",
    "DestinationsReply",
    "GetDestinations",
    "GetVersion",
    "Hello",
    "LoadBucket",
    "LoadSizes",
    "ReleaseHandles",
    "RemoteKind",
    "Reply",
    "ReportDevice",
    "Request",
    "Shutdown",
    "SpecsReply",
    "VersionReply",
    "decode",
    "encode",
    "encoded_size",
)

# --- greeting ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """The first frame a peer sends on its connection: who it is.

    ``role`` says what the peer serves (``"rank"``: a trainer rank's source,
    ``"vllm-rank"``: a worker of a vLLM engine, its channel to the engine's adapter;
    ``"vllm-control"``: the same worker's control channel, served by a thread of its own);
    ``name`` names it, ``rank`` is its index among its kind, and ``pid`` lets the
    coordinator sweep what a dead peer left behind.
    """

    role: Literal["rank", "worker", "vllm-rank", "vllm-control"]
    pid: int
    name: str = ""
    rank: int = 0


# --- requests ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportDevice:
    """Ask for the worker's device id (answered by ``report_device_id_async``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GetSpecs:
    """Ask for the worker's parameter specs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BeginUpdate:
    """Start receiving ``version``: from now on the worker holds no complete version.

    ``direct``: the trainer writes the version straight into the worker's exported
    parameters (see :class:`GetDestinations`); no bucket is loaded.
    """

    version: int
    direct: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadBucket(FastPickle):
    """Copy bucket ``bucket`` of ``version`` from the handle for the worker's device.

    ``handles`` holds exactly one handle when dispatch is filtered; the
    broadcast-all baseline sends every device's handle and lets the worker pick.
    """

    version: int
    bucket: int
    handles: tuple[Handle, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitUpdate:
    """Every one of ``buckets`` buckets of ``version`` was sent: the version is whole."""

    version: int
    buckets: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortUpdate:
    """Give up ``version``; answered only after every view of a buffer is dropped."""

    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GetDestinations:
    """Ask for the worker's exported parameters (``None``: it exports none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GetVersion:
    """Ask which complete version the worker holds (``None``: none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseHandles:
    """Close every cached handle: the trainer is about to free its buffers."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Digest:
    """Diagnostics: a digest of every parameter's bytes, by name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Forward:
    """Diagnostics: run the worker's model on ``inputs`` and return the output."""

    inputs: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown:
    """Close handles and exit."""


Request: TypeAlias = (
    ReportDevice
    | GetSpecs
    | BeginUpdate
    | LoadBucket
    | CommitUpdate
    | AbortUpdate
    | GetVersion
    | GetDestinations
    | ReleaseHandles
    | Digest
    | Forward
    | Shutdown
)

# --- replies -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceReply:
    device: DeviceId


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecsReply:
    specs: tuple[ParamSpec, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketAck(FastPickle):
    """The worker copied ``nbytes`` of ``bucket`` and dropped its views.

    ``copied`` is empty when the copies are complete; for an ``ordered`` handle it may
    be the token the producer waits for (on the GPU) before it repacks the slot: the
    copies were enqueued, ordered before that token, and the worker waits for them
    before it commits, aborts or releases its handles.
    """

    bucket: int
    nbytes: int
    seconds: float
    copied: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    """A request without a result succeeded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationsReply:
    destinations: Destinations | None


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionReply:
    version: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DigestReply:
    digests: dict[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardReply:
    output: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Aborted:
    """A vLLM worker's answer to an abort: the complete version it holds after it, and
    whether any byte of the aborted version had been written into its model."""

    version: int | None
    written: bool


#: What kind of failure an :class:`ErrorReply` reports, decided where it was raised
#: (see :func:`asyncrefit._wire._errors.error_reply`): ``"error"`` any error,
#: ``"integrity"`` a checksum mismatch, ``"stale_weights"`` a refused commit,
#: ``"protocol"`` a request the peer does not understand; ``""``: not said (a peer
#: that only names the error's type: the type name decides).
RemoteKind: TypeAlias = Literal["", "error", "integrity", "stale_weights", "protocol"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply:
    """The request failed on the worker: the error's type name and message, as text,
    and its ``kind`` as data (not compared: it follows from the type)."""

    type: str
    message: str
    kind: RemoteKind = field(default="", compare=False)


Reply: TypeAlias = (
    DeviceReply
    | SpecsReply
    | BucketAck
    | Done
    | VersionReply
    | DestinationsReply
    | DigestReply
    | ForwardReply
    | Aborted
    | ErrorReply
)


def encode(message: object) -> bytes:
    """Serialize a message (pickle protocol 5: local, trusted peers only)."""
    return pickle.dumps(message, protocol=5)


def decode(data: bytes) -> Any:
    """The inverse of :func:`encode`."""
    return pickle.loads(data)


def encoded_size(message: object) -> int:
    """Bytes :func:`encode` makes of ``message``: what handle accounting reports."""
    return len(encode(message))


class LoadSizes:
    """:func:`encoded_size` of :class:`LoadBucket` messages, remembered across pushes.

    The same bucket of the same slot comes with equal handles at every push, and a
    message's size depends on its version only through the length of the version's
    encoding (integers are written in line, never shared): so the size is kept by
    (handles, bucket, that length) and computed once, the exact number
    :func:`encoded_size` gives. Only the sizes used by the last push are kept (call
    :meth:`next_push` at the start of each), so handles that change every push (a
    checksum) do not accumulate.
    """

    __slots__ = ("_last", "_now", "_width")

    def __init__(self) -> None:
        self._last: dict[tuple[tuple[Handle, ...], int, int], int] = {}
        self._now: dict[tuple[tuple[Handle, ...], int, int], int] = {}
        self._width: tuple[int, int] = (0, 0)  # (version, length of its encoding)

    def next_push(self) -> None:
        self._last, self._now = self._now, {}

    def size(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> int:
        if self._width[0] != version or not self._width[1]:
            self._width = (version, len(encode(version)))
        key = (handles, bucket, self._width[1])
        size = self._now.get(key)
        if size is None:
            size = self._last.get(key)
            if size is None:
                size = encoded_size(LoadBucket(version=version, bucket=bucket, handles=handles))
            self._now[key] = size
        return size
