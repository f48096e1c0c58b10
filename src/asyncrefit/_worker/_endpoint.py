"""The worker side of a refit, once for every backend: an endpoint over a sink.

An :class:`Endpoint` answers the coordinator's requests (:mod:`asyncrefit._wire._messages`)
for one worker: it keeps the worker's :class:`~asyncrefit.planning.VersionState`, picks
the handle for its own device, validates every entry of that handle before any byte is
written (:class:`~asyncrefit._worker._layout.Declared`,
:func:`~asyncrefit._worker._layout.check_layout`),
opens it through an importer cached per transport kind, and hands the opened buffer
to its :class:`Sink`, which is where the bytes go: a module's own parameters
(:class:`~asyncrefit.ParameterReceiver`, the local and Ray backends) or a vLLM model's
``load_weights`` inside its layerwise reload (:mod:`asyncrefit.vllm._sink`).

The endpoint is synchronous (copies block); the local server, the Ray mixin and the
vLLM engine drive it from their own loops or threads, one request at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from .._core._plan import ParamSpec
from .._device import DeviceId
from .._exceptions import TransportError
from .._wire._errors import error_reply as error_reply
from .._wire._messages import (
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    DestinationsReply,
    DeviceReply,
    Done,
    GetDestinations,
    GetSpecs,
    GetVersion,
    LoadBucket,
    ReleaseHandles,
    Reply,
    ReportDevice,
    SpecsReply,
    VersionReply,
)
from ..transport._base import Handle, Importer, make_importer
from ..transport.destinations import Destinations
from ._layout import Declared, check_layout, reach
from ._state import VersionState

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

AbortReply = TypeVar("AbortReply")
AbortReply_co = TypeVar("AbortReply_co", covariant=True)


class Sink(Protocol[AbortReply_co]):
    """Where an :class:`Endpoint` puts the bytes of a bucket, and its hooks around them.

    The endpoint calls the hooks in the order of the requests, one at a time; each may
    raise to refuse its request (the endpoint's state is then left as it was, except
    where a hook says otherwise).
    """

    def declared(self) -> Declared:
        """What the worker accepts (its specs by name); the same for the sink's life."""

    def begin(self, version: int) -> None:
        """A push of ``version`` begins (before the endpoint's state records it)."""

    def receiving(self, bucket: int) -> None:
        """A bucket of the pending version arrived, before its handle is picked."""

    def opening(self, handle: Handle) -> None:
        """``handle`` (validated) is about to be opened: its importer may map anew."""

    def write(
        self,
        bucket: int,
        handle: Handle,
        buffer: torch.Tensor,
        importer: Importer,
        writing: Callable[[], None],
    ) -> bytes:
        """Put the entries of ``handle`` (validated, and inside ``buffer``) in place.

        ``buffer`` is the flat view ``importer`` opened; the sink calls
        ``importer.finish(handle)`` once it read what it needs of it, and calls
        ``writing()`` right before the worker's own bytes first change (from then on
        the worker holds no complete version). Returns the token of
        ``importer.finish`` (``b""`` when the copies are complete), and keeps no view
        of ``buffer`` it does not drop before the importer may unmap it (see
        :meth:`opening` and :meth:`release`). A ``handle.checksum`` is verified here.
        """

    def commit(self, version: int, buckets: int) -> bool:
        """Every bucket of ``version`` arrived (checked); may refuse the commit.

        Returns whether the version is complete now; ``False`` if the sink completes
        it later, through :meth:`Endpoint.complete`.
        """

    def abort(self, version: int) -> None:
        """``version`` is given up (before the endpoint's state forgets it)."""

    def aborted(self, complete: int | None, written: bool) -> AbortReply_co:
        """The reply to an abort: ``complete`` is held now; ``written``: bytes changed."""

    def release(self) -> None:
        """Drop every view of an opened buffer: the importers close their mappings next."""


class Endpoint(Generic[AbortReply]):
    """One worker's side of the refit protocol, over a :class:`Sink`.

    Importers are made on first use from a handle's ``kind`` by ``importer_factory``
    (default: :func:`asyncrefit.transport.make_importer`), or given in ``importers``.
    A handle is validated in full the first time it arrives (by value: the same
    bucket of the same slot comes with an equal handle at every push); the handles
    of the last two pushes are remembered as valid, and only checked to fit inside
    the buffer their importer opened.

    Resource handling: the importers cache their mappings across pushes;
    :meth:`release_handles` (and :meth:`close`) has the sink drop its views, then
    closes every mapping. :meth:`commit`, :meth:`abort` and :meth:`settle` first wait
    for copies an ordered handle left running.

    Error handling: a bucket without a handle for this worker's device, or with any
    entry that does not match the sink's declared specs (name, shape, dtype) or cannot
    be read as it says (see :func:`~asyncrefit._worker._layout.check_layout`), raises
    :class:`TransportError` before the sink sees it (no byte is written: the worker
    keeps its complete version); version mismatches raise
    :class:`~asyncrefit.UpdateStateError`. :meth:`handle` answers every
    failure with an :class:`ErrorReply` (its type name and message) and never raises.
    """

    def __init__(
        self,
        sink: Sink[AbortReply],
        device: DeviceId,
        *,
        importers: Mapping[str, Importer] | None = None,
        importer_factory: Callable[[str], Importer] | None = None,
    ) -> None:
        self.sink = sink
        self.device = device
        self.state = VersionState()
        self._importers: dict[str, Importer] = dict(importers or {})
        self._importer_factory = importer_factory or make_importer
        # Valid handles, by value: their reach, payload bytes and the first equal handle
        # seen (this push, the last). The sink is given that first one, so its own
        # lookups by handle find their key by identity, not by comparing entries.
        self._valid: dict[Handle, tuple[int, int, Handle]] = {}
        self._valid_before: dict[Handle, tuple[int, int, Handle]] = {}
        # The same, by the identity of the handle objects met (a source that hands out
        # the same handle object for a slot at every push, a link that hands on the
        # handle it decoded once): no hashing. An entry holds its object, so its id
        # is not reused while it is here.
        self._seen: dict[int, tuple[Handle, tuple[int, int, Handle]]] = {}
        self._seen_before: dict[int, tuple[Handle, tuple[int, int, Handle]]] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device={self.device} {self.state}>"

    @property
    def version(self) -> int | None:
        """The version held completely (``None``: none)."""
        return self.state.complete

    def specs(self) -> tuple[ParamSpec, ...]:
        return tuple(self.sink.declared().specs.values())

    # --- the requests -------------------------------------------------------------------

    def begin(self, version: int) -> None:
        self.sink.begin(version)
        self.state.begin(version)
        self._valid_before, self._valid = self._valid, {}
        self._seen_before, self._seen = self._seen, {}

    def destinations(self) -> Destinations | None:
        """This worker's parameters as a trainer may write them (``None``: not exported)."""
        return None

    def begin_direct(self, version: int) -> None:
        """Begin ``version`` written by the trainer into :meth:`destinations`.

        Raises :class:`TransportError` if this worker exports none. From here on the
        worker holds no complete version (the trainer may write at any time) until it
        commits; it serves nothing from its parameters meanwhile.
        """
        if self.destinations() is None:
            raise TransportError("this worker exports no destinations for direct writes")
        self.sink.begin(version)
        self.state.begin(version, direct=True)

    def load(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> BucketAck:
        """Validate the handle for this device, open it and have the sink write it.

        Returns once the sink is done with the buffer (for an ``ordered`` handle the
        ack may carry the token ordering the producer's next write after the copies).
        """
        start = time.perf_counter()
        self.state.check_loading(version)
        self.sink.receiving(bucket)
        end, nbytes, handle = self._validate(self.own_handle(handles))
        self.sink.opening(handle)
        importer = self._importer(handle.kind)
        buffer = importer.open(handle)
        try:
            if end > buffer.numel():
                check_layout(handle, buffer.numel())  # raises, naming the entry
            token = self.sink.write(
                bucket, handle, buffer, importer, lambda: self.state.loading(version, bucket)
            )
        finally:
            del buffer  # no view is read after the ack
        return BucketAck(
            bucket=bucket, nbytes=nbytes, seconds=time.perf_counter() - start, copied=token
        )

    def commit(self, version: int, buckets: int) -> None:
        self.settle()
        self.state.check_commit(version, buckets)
        if self.sink.commit(version, buckets):
            self.state.commit(version, buckets)

    def complete(self, version: int, buckets: int) -> None:
        """Make ``version`` complete, for a sink whose :meth:`Sink.commit` deferred it."""
        self.state.commit(version, buckets)

    def abort(self, version: int) -> None:
        self.settle()
        self.sink.abort(version)
        self.state.abort(version)

    def abort_unwritten(self, version: int) -> None:
        """Abort ``version``, begun direct, of which the coordinator says no byte was
        written: the version held before its begin is complete again."""
        self.state.unwritten(version)
        self.abort(version)

    def abandon(self) -> None:
        """Give up the pending version, if any, in the state alone (the sink is told
        nothing: its owner ends what it has open itself)."""
        if self.state.pending is not None:
            self.state.abort(self.state.pending)

    def settle(self) -> None:
        """Wait for every copy an earlier load left running (ordered handles)."""
        for importer in self._importers.values():
            importer.settle()

    def release_handles(self) -> None:
        self.sink.release()  # before the mappings its views view are closed
        for importer in self._importers.values():
            importer.close()

    def close(self) -> None:
        self.release_handles()

    def handle(self, request: object) -> Reply | AbortReply:
        """Serve one request of the refit protocol; failures become an :class:`ErrorReply`."""
        try:
            match request:
                case ReportDevice():
                    return DeviceReply(device=self.device)
                case GetSpecs():
                    return SpecsReply(specs=self.specs())
                case BeginUpdate(version=v, direct=False):
                    self.begin(v)
                    return Done()
                case BeginUpdate(version=v, direct=True):
                    self.begin_direct(v)
                    return Done()
                case GetDestinations():
                    return DestinationsReply(destinations=self.destinations())
                case LoadBucket(version=v, bucket=b, handles=h):
                    return self.load(v, b, h)
                case CommitUpdate(version=v, buckets=n):
                    self.commit(v, n)
                    return Done()
                case AbortUpdate(version=v, unwritten=unwritten):
                    if unwritten:
                        self.state.unwritten(v)
                    written = self.state.written(v)
                    self.abort(v)
                    return self.sink.aborted(self.state.complete, written)
                case GetVersion():
                    return VersionReply(version=self.version)
                case ReleaseHandles():
                    self.release_handles()
                    return Done()
        except Exception as exc:
            logger.debug("%r: request %r failed", self, request, exc_info=True)
            return error_reply(exc)
        return error_reply(TypeError(f"unknown request {type(request).__name__}"))

    # --- pieces -------------------------------------------------------------------------

    def own_handle(self, handles: tuple[Handle, ...]) -> Handle:
        """The handle for this worker's device; :class:`TransportError` if none."""
        for handle in handles:
            if handle.device == self.device:
                return handle
        offered = ", ".join(str(h.device) for h in handles) or "none"
        raise TransportError(f"no handle for device {self.device} (offered: {offered})")

    def _validate(self, handle: Handle) -> tuple[int, int, Handle]:
        """Check ``handle`` against the declared specs (once).

        Returns its reach, its payload bytes and the first handle equal to it that
        was seen (the one to hand on).
        """
        key = id(handle)
        seen = self._seen.get(key)
        if seen is not None and seen[0] is handle:
            return seen[1]
        seen = self._seen_before.get(key)
        if seen is None or seen[0] is not handle:
            known = self._valid.get(handle)
            if known is None:
                known = self._valid_before.get(handle)
                if known is None:
                    self.sink.declared().check(handle)
                    known = (reach(handle), sum(e.nbytes for e in handle.entries), handle)
                self._valid[known[2]] = known
            seen = (handle, known)
        self._seen[key] = seen
        return seen[1]

    def _importer(self, kind: str) -> Importer:
        importer = self._importers.get(kind)
        if importer is None:
            importer = self._importers[kind] = self._importer_factory(kind)
        return importer
