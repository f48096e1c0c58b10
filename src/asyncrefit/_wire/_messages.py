"""The codec and the vocabulary: what a coordinator and its peers say to each other.

Owns :func:`encode` / :func:`decode` (pickle protocol 5: local, trusted peers only;
the few messages every push sends go in a compact form of the codec's own, see
:func:`encode`) and the messages. Every message is a frozen, slotted, keyword-only dataclass.
Requests and replies each form one union, dispatched with ``match``. Handles are
transport records (see :mod:`asyncrefit.transport`): small, and never tensors or
coroutines. A peer's first frame on a connection is a :class:`Hello`; a request that
failed is answered with an :class:`ErrorReply` (turned back into a typed error by
:mod:`asyncrefit._wire._errors`). The trainer ranks' requests and replies live with
the ranks (:mod:`asyncrefit.trainer._rank`) and travel with this codec.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
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
    """Give up ``version``; answered only after every view of a buffer is dropped.

    ``unwritten``: the coordinator says no byte of ``version`` was written into the
    worker (a direct version begun ahead of the writes): the worker holds the complete
    version it held before the begin again (see
    :meth:`~asyncrefit.planning.VersionState.unwritten`).
    """

    version: int
    unwritten: bool = False


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


# --- the codec -----------------------------------------------------------------------
#
# A frame's payload is a pickle (protocol 5: its first byte is 0x80), except for the
# few messages every push sends to every worker: ``(request id, message)`` of one of the
# kinds below goes as a tag byte (never the first byte of a pickle) and the message's
# fields at a fixed width. Pickling a dataclass looks its class up by name at both ends
# and walks its fields: several times the cost of packing these few bytes. A message
# whose fields do not fit (an int beyond 64 bits, a field of another type than its
# annotation's) goes as a pickle. The compact form is this module's own: both ends
# decode with :func:`decode`, which rebuilds the very message.

_ID = struct.Struct("<Bq")  # tag, request id
_ID_INT = struct.Struct("<Bqq")  # tag, request id, an int
_ID_INT_BOOL = struct.Struct("<Bqq?")
_ID_INT_INT = struct.Struct("<Bqqq")
_ID_ACK = struct.Struct("<Bqqqd")  # tag, request id, bucket, nbytes, seconds; copied follows

_DONE, _BEGIN, _COMMIT, _ABORT, _GET_VERSION, _VERSION, _NO_VERSION, _ACK = range(1, 9)


def _encode_done(request_id: int, message: Done) -> bytes | None:
    return _ID.pack(_DONE, request_id)


def _encode_begin(request_id: int, message: BeginUpdate) -> bytes | None:
    version, direct = message.version, message.direct
    if type(version) is int and type(direct) is bool:
        return _ID_INT_BOOL.pack(_BEGIN, request_id, version, direct)
    return None


def _encode_commit(request_id: int, message: CommitUpdate) -> bytes | None:
    version, buckets = message.version, message.buckets
    if type(version) is int and type(buckets) is int:
        return _ID_INT_INT.pack(_COMMIT, request_id, version, buckets)
    return None


def _encode_abort(request_id: int, message: AbortUpdate) -> bytes | None:
    version, unwritten = message.version, message.unwritten
    if type(version) is int and type(unwritten) is bool:
        return _ID_INT_BOOL.pack(_ABORT, request_id, version, unwritten)
    return None


def _encode_get_version(request_id: int, message: GetVersion) -> bytes | None:
    return _ID.pack(_GET_VERSION, request_id)


def _encode_version(request_id: int, message: VersionReply) -> bytes | None:
    version = message.version
    if version is None:
        return _ID.pack(_NO_VERSION, request_id)
    if type(version) is int:
        return _ID_INT.pack(_VERSION, request_id, version)
    return None


def _encode_ack(request_id: int, message: BucketAck) -> bytes | None:
    bucket, nbytes, seconds = message.bucket, message.nbytes, message.seconds
    copied = message.copied
    if (
        type(bucket) is int
        and type(nbytes) is int
        and type(seconds) is float
        and type(copied) is bytes
    ):
        return _ID_ACK.pack(_ACK, request_id, bucket, nbytes, seconds) + copied
    return None


_ENCODERS: dict[type, Callable[[int, Any], bytes | None]] = {
    Done: _encode_done,
    BeginUpdate: _encode_begin,
    CommitUpdate: _encode_commit,
    AbortUpdate: _encode_abort,
    GetVersion: _encode_get_version,
    VersionReply: _encode_version,
    BucketAck: _encode_ack,
}


def _decode_done(data: bytes) -> tuple[int, Any]:
    return _ID.unpack(data)[1], Done()


def _decode_begin(data: bytes) -> tuple[int, Any]:
    _, request_id, version, direct = _ID_INT_BOOL.unpack(data)
    return request_id, BeginUpdate(version=version, direct=direct)


def _decode_commit(data: bytes) -> tuple[int, Any]:
    _, request_id, version, buckets = _ID_INT_INT.unpack(data)
    return request_id, CommitUpdate(version=version, buckets=buckets)


def _decode_abort(data: bytes) -> tuple[int, Any]:
    _, request_id, version, unwritten = _ID_INT_BOOL.unpack(data)
    return request_id, AbortUpdate(version=version, unwritten=unwritten)


def _decode_get_version(data: bytes) -> tuple[int, Any]:
    return _ID.unpack(data)[1], GetVersion()


def _decode_version(data: bytes) -> tuple[int, Any]:
    _, request_id, version = _ID_INT.unpack(data)
    return request_id, VersionReply(version=version)


def _decode_no_version(data: bytes) -> tuple[int, Any]:
    return _ID.unpack(data)[1], VersionReply(version=None)


def _decode_ack(data: bytes) -> tuple[int, Any]:
    _, request_id, bucket, nbytes, seconds = _ID_ACK.unpack_from(data)
    copied = bytes(data[_ID_ACK.size :])
    return request_id, BucketAck(bucket=bucket, nbytes=nbytes, seconds=seconds, copied=copied)


_DECODERS: dict[int, Callable[[bytes], tuple[int, Any]]] = {
    _DONE: _decode_done,
    _BEGIN: _decode_begin,
    _COMMIT: _decode_commit,
    _ABORT: _decode_abort,
    _GET_VERSION: _decode_get_version,
    _VERSION: _decode_version,
    _NO_VERSION: _decode_no_version,
    _ACK: _decode_ack,
}


def encode(message: object) -> bytes:
    """Serialize a message (pickle protocol 5: local, trusted peers only).

    ``(request id, message)`` of the kinds a push sends to every worker (begin, commit,
    abort, their ``Done``, a bucket's ack, the version asked and told) goes in a
    compact form instead, which only :func:`decode` reads.
    """
    if type(message) is tuple and len(message) == 2:
        request_id, body = message
        fast = _ENCODERS.get(type(body))
        if fast is not None and type(request_id) is int:
            try:
                data = fast(request_id, body)
            except struct.error:  # an int beyond 64 bits
                data = None
            if data is not None:
                return data
    return pickle.dumps(message, protocol=5)


def decode(data: bytes) -> Any:
    """The inverse of :func:`encode`."""
    if data:
        fast = _DECODERS.get(data[0])
        if fast is not None:
            try:
                return fast(data)
            except struct.error as exc:
                raise pickle.UnpicklingError(f"a malformed frame: {exc}") from None
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
