"""The parameter sink: an endpoint that copies buckets into a worker's own tensors.

:class:`ParameterSink` is the :class:`~asyncrefit._worker._endpoint.Sink` of the local and Ray
backends (and of in-process workers): it copies each entry of a bucket into the
parameter of its name. :class:`ParameterReceiver` is the
:class:`~asyncrefit._worker._endpoint.Endpoint` over it, the public face of the worker side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from .._checksum import tensor_bytes, verify_checksum
from .._core._plan import ParamSpec
from .._device import DeviceId
from .._dtypes import dtype_name, torch_dtype
from .._wire._messages import Done
from ..transport._base import Handle, Importer
from ..transport.destinations import Destinations, SharedParameters, share_parameters
from ._endpoint import Endpoint
from ._layout import Declared

if TYPE_CHECKING:
    import torch


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's bytes (with its dtype and shape): equal iff bitwise equal.

    Reads the bytes through :func:`tensor_bytes` (no numpy; CUDA tensors are copied to
    the host first, non-contiguous ones copied contiguous).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype_name(tensor.dtype)}{tuple(tensor.shape)}".encode())
    with tensor_bytes(tensor) as data:
        h.update(data)
    return h.hexdigest()


#: At most this many distinct buffers are held through cached views (the CUDA IPC
#: importer keeps 16 slots mapped): a handle of a further buffer is loaded uncached.
MAX_VIEWED_BUFFERS = 16


class _Prepared:
    """A handle's copies out of an opened buffer: (parameter, view of the buffer) pairs.

    Reused while the handle's importer returns the very same buffer for it.
    ``epoch`` is the last push (``begin``) that used it. It holds its ``handle``, so
    the handle's ``id`` (its key) names no other object while it lives.
    """

    __slots__ = ("buffer", "copies", "epoch", "handle", "params")

    def __init__(
        self,
        handle: Handle,
        buffer: torch.Tensor,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        epoch: int,
    ) -> None:
        self.handle = handle
        self.buffer = buffer
        self.copies = copies  # (parameter, view of the buffer), in entry order
        self.params = [dst for dst, _ in copies]
        self.epoch = epoch


def _destination(param: torch.Tensor, part: tuple[int, int] | None) -> torch.Tensor:
    """Where an entry goes: the parameter, or the rows of it that a part carries."""
    return param if part is None else param[part[0] : part[1]]


class ParameterSink:
    """Copies a bucket's entries into the parameter tensors of their names.

    The parameters' shapes and dtypes are those of the tensors given here, for the
    sink's life (what it declares); each is taken whole or in parts (rows), so a
    parameter larger than a bucket is sent in parts. The copies of a handle (views of
    the opened buffer, paired with the parameters) are kept while its importer returns
    the same buffer for it.

    Resource handling: views of at most :data:`MAX_VIEWED_BUFFERS` distinct buffers
    are kept, and read only while the importer still returns the very buffer they
    were made of (a mapping the importer dropped is never read through an old view);
    before a handle without views is opened (only such an open maps anew, and may make
    the importer drop mappings) the views of earlier pushes are dropped, and
    :meth:`release` drops every view.

    Error handling: a handle with a ``checksum`` is verified after the copy, over the
    parameters: a mismatch raises :class:`~asyncrefit.IntegrityError` (the version
    stays incomplete).
    """

    def __init__(self, parameters: Mapping[str, torch.Tensor]) -> None:
        self.parameters = dict(parameters)
        self._declared = Declared(
            specs={
                name: ParamSpec(
                    name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype), parts=True
                )
                for name, t in self.parameters.items()
            }
        )
        # By id() of the handle the endpoint hands on (the first of equal handles it
        # saw): a lookup hashes an int, not the handle's entries.
        self._prepared: dict[int, _Prepared] = {}
        self._epoch = 0

    def __repr__(self) -> str:
        return f"<ParameterSink params={len(self.parameters)} views={len(self._prepared)}>"

    def declared(self) -> Declared:
        return self._declared

    def begin(self, version: int) -> None:
        self._epoch += 1

    def receiving(self, bucket: int) -> None:
        pass  # a parameter takes a bucket at any time

    def opening(self, handle: Handle) -> None:
        if self._cached(handle) is None:
            self._forget_views(older=True)

    def write(
        self,
        bucket: int,
        handle: Handle,
        buffer: torch.Tensor,
        importer: Importer,
        writing: Callable[[], None],
    ) -> bytes:
        import torch

        prepared = self._cached(handle)
        if prepared is None or prepared.buffer is not buffer:
            prepared = self._prepare(handle, buffer)
        prepared.epoch = self._epoch
        writing()
        if torch.is_grad_enabled() and any(p.requires_grad for p in prepared.params):
            with torch.no_grad():
                for dst, src in prepared.copies:
                    dst.copy_(src)
        else:
            for dst, src in prepared.copies:
                dst.copy_(src)
        token = importer.finish(handle)
        verify_checksum(bucket, handle.checksum, prepared.params)  # after the copies
        return token

    def commit(self, version: int, buckets: int) -> bool:
        return True

    def abort(self, version: int) -> None:
        pass  # what was copied stays: the version is incomplete

    def aborted(self, complete: int | None, written: bool) -> Done:
        return Done()

    def release(self) -> None:
        self._forget_views(older=False)

    def parameters_device(self) -> torch.device:
        """The device of the parameters (the CPU when there are none)."""
        import torch

        return next((t.device for t in self.parameters.values()), torch.device("cpu"))

    def digests(self) -> dict[str, str]:
        """:func:`tensor_digest` of every parameter, by name (the caller settles first)."""
        return {name: tensor_digest(t) for name, t in self.parameters.items()}

    def _prepare(self, handle: Handle, buffer: torch.Tensor) -> _Prepared:
        copies = [
            (
                _destination(self.parameters[e.name], e.part),
                buffer[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape),
            )
            for e in handle.entries
        ]
        prepared = _Prepared(handle, buffer, copies, self._epoch)
        old = self._prepared.pop(id(handle), None)
        del old  # its views of a buffer the importer no longer returns
        viewed = {id(p.buffer) for p in self._prepared.values()}
        if id(buffer) in viewed or len(viewed) < MAX_VIEWED_BUFFERS:
            self._prepared[id(handle)] = prepared
        return prepared

    def _cached(self, handle: Handle) -> _Prepared | None:
        prepared = self._prepared.get(id(handle))
        return prepared if prepared is not None and prepared.handle is handle else None

    def _forget_views(self, *, older: bool) -> None:
        """Drop the views of earlier pushes (``older``) or all of them."""
        if older:
            epoch = self._epoch
            self._prepared = {h: p for h, p in self._prepared.items() if p.epoch == epoch}
        else:
            self._prepared = {}


class ParameterReceiver(Endpoint[Done]):
    """Copies buckets from transport handles into a worker's own parameter tensors.

    An :class:`~asyncrefit._worker._endpoint.Endpoint` over a :class:`ParameterSink` of
    ``parameters`` (``parameter_sink``); it is synchronous (its copies block) and is
    driven by a worker's own event loop through a thread, by the local backend or a
    Ray actor alike. Importers are made on first use from the handle's ``kind`` by
    ``importer_factory`` (default: :func:`asyncrefit.transport.make_importer`).

    The parameters' shapes and dtypes are those of the tensors given here, for the
    receiver's life (they are what :meth:`specs` reports, and what the coordinator
    validated the plan against). A handle is validated in full the first time it
    arrives; a handle seen before is only checked to fit the buffer it opens to.

    Resource handling: handles are opened through per-transport importers that cache
    their mappings across pushes; the sink keeps views of those cached buffers and
    reads them only during :meth:`load`, so returning (the ack) means the worker no
    longer reads the trainer's buffer. :meth:`release_handles` and :meth:`close` drop
    every view before they release every cached mapping.

    Error handling: a bucket without a handle for this worker's device, or with any
    entry that does not match this worker's parameters (name, shape, dtype) or cannot
    be read as it says (see :func:`~asyncrefit._worker._layout.check_layout`), raises
    :class:`~asyncrefit.TransportError` before any of its bytes are written: the
    worker keeps its complete version. A handle with a ``checksum`` is verified after
    the copy: a mismatch raises :class:`~asyncrefit.IntegrityError` (the version stays
    incomplete).

    ``shared=True`` moves the parameters into one region the worker exports (a
    shared-memory segment on the CPU, a CUDA IPC allocation on a GPU; see
    :mod:`asyncrefit.transport.destinations`), so that a trainer on this node writes
    them directly: :meth:`destinations` describes it, :meth:`close` releases it.
    """

    def __init__(
        self,
        parameters: Mapping[str, torch.Tensor],
        device: DeviceId,
        *,
        importers: Mapping[str, Importer] | None = None,
        importer_factory: Callable[[str], Importer] | None = None,
        shared: bool = False,
    ) -> None:
        self.parameter_sink = ParameterSink(parameters)
        super().__init__(
            self.parameter_sink, device, importers=importers, importer_factory=importer_factory
        )
        self._shared: SharedParameters | None = None
        if shared:
            self._shared = share_parameters(self.parameter_sink.parameters, device)

    def destinations(self) -> Destinations | None:
        """The parameters' memory (with ``shared=True``), for a trainer's direct writes,
        on this receiver's device (which its owner may rebind after construction)."""
        if self._shared is None:
            return None
        found = self._shared.destinations
        return found if found.device == self.device else replace(found, device=self.device)

    def begin_direct(self, version: int) -> None:
        super().begin_direct(version)
        if self._shared is not None and self._shared.destinations.kind == "cuda_ipc":
            import torch

            # No kernel of this process may still read the parameters once the
            # trainer writes them.
            torch.cuda.synchronize(self.parameter_sink.parameters_device())

    @property
    def commit_waits(self) -> bool:
        """Whether a direct commit may block on the trainer's GPU writes (run it off an
        event loop: it waits for them, at most ``WRITES_TIMEOUT``)."""
        return self._shared is not None and bool(self._shared.destinations.event)

    def commit(self, version: int, buckets: int) -> None:
        """Commit ``version``; a direct one once the trainer's writes ran (on a GPU, the
        completion event it recorded after them: see
        :meth:`~asyncrefit.transport.destinations.SharedParameters.wait_for_writes`,
        whose :class:`~asyncrefit.TransportError` leaves the version uncommitted)."""
        state = self.state
        if self._shared is not None and state.direct and state.pending == version:
            self._shared.wait_for_writes()
        super().commit(version, buckets)

    def close(self) -> None:
        super().close()
        if self._shared is not None:
            self._shared.close()

    def __repr__(self) -> str:
        return (
            f"<ParameterReceiver device={self.device} "
            f"params={len(self.parameter_sink.parameters)} {self.state}>"
        )

    def digests(self) -> dict[str, str]:
        """:func:`tensor_digest` of every parameter, by name, once every copy is done."""
        self.settle()
        return self.parameter_sink.digests()
