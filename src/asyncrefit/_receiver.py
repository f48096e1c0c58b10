"""The worker side of a refit: version bookkeeping and copying buckets into parameters.

:class:`VersionState` is the pure state machine of what a worker holds.
:class:`ParameterReceiver` carries it out on real tensors; it is synchronous (its
copies block) and is driven by a worker's own event loop through a thread, by the
local backend, a Ray actor or a vLLM worker extension alike.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ._checksum import checksum, tensor_bytes
from ._device import DeviceId
from ._dtypes import dtype_itemsize, dtype_name, torch_dtype
from ._exceptions import AsyncRefitError, IntegrityError, PlanError, TransportError
from ._messages import BucketAck
from ._plan import ParamSpec
from .transport._base import Handle, Importer, make_importer

if TYPE_CHECKING:
    import torch


class UpdateStateError(AsyncRefitError):
    """A worker was asked to load or commit a version it is not receiving."""


class VersionState:
    """Which version a worker holds completely, and which one it is receiving.

    A worker that has had even one bucket of a new version written into it holds no
    complete version until that version is committed: ``complete`` is then ``None``.
    Aborting before any byte was written keeps the previous complete version.
    """

    __slots__ = ("complete", "dirty", "loaded", "pending")

    def __init__(self) -> None:
        self.complete: int | None = None
        self.pending: int | None = None
        self.dirty = False
        self.loaded: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"<VersionState complete={self.complete} pending={self.pending} "
            f"loaded={len(self.loaded)}>"
        )

    def begin(self, version: int) -> None:
        if self.pending is not None:
            self.abort(self.pending)
        self.pending, self.dirty, self.loaded = version, False, set()

    def check_loading(self, version: int) -> None:
        if self.pending != version:
            raise UpdateStateError(
                f"bucket of version {version} arrived, but the worker is receiving "
                f"{self.pending if self.pending is not None else 'nothing'}"
            )

    def loading(self, version: int, bucket: int) -> None:
        """Record that bytes of ``bucket`` are about to be written."""
        self.check_loading(version)
        self.dirty, self.complete = True, None
        self.loaded.add(bucket)

    def commit(self, version: int, buckets: int) -> None:
        self.check_loading(version)
        if len(self.loaded) != buckets:
            raise UpdateStateError(
                f"version {version} committed with {len(self.loaded)} of {buckets} buckets loaded"
            )
        self.complete, self.pending, self.dirty, self.loaded = version, None, False, set()

    def abort(self, version: int) -> None:
        if self.pending is None or self.pending != version:
            return  # nothing of that version here: aborting is idempotent
        if self.dirty:
            self.complete = None
        self.pending, self.dirty, self.loaded = None, False, set()


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


def check_layout(handle: Handle, buffer_bytes: int | None = None) -> None:
    """Check that every entry of ``handle`` can be read as it says, before any is read.

    Each entry must span exactly its shape's bytes (``numel * itemsize``), start at a
    non-negative offset aligned to its item size, and end inside the bucket
    (``handle.nbytes``) and inside the opened buffer (``buffer_bytes``, when given); no
    parameter may be named twice and no two entries may overlap. Raises
    :class:`TransportError` naming the bucket and the entry.
    """
    names: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for e in handle.entries:
        where = f"bucket {handle.bucket}, parameter {e.name!r}"
        if e.name in names:
            raise TransportError(f"{where}: named twice in the handle")
        names.add(e.name)
        try:
            itemsize = dtype_itemsize(e.dtype)
        except PlanError as exc:
            raise TransportError(f"{where}: {exc}") from None
        want = math.prod(e.shape) * itemsize
        if e.nbytes != want:
            raise TransportError(
                f"{where}: {e.nbytes} bytes for {e.dtype}{list(e.shape)}, which is {want}"
            )
        if e.offset < 0 or e.offset % itemsize:
            raise TransportError(
                f"{where}: offset {e.offset} is not a non-negative multiple of the "
                f"{e.dtype} item size {itemsize}"
            )
        end = e.offset + e.nbytes
        if end > handle.nbytes:
            raise TransportError(
                f"{where}: bytes {e.offset}..{end} lie outside the {handle.nbytes}-byte bucket"
            )
        if buffer_bytes is not None and end > buffer_bytes:
            raise TransportError(
                f"{where}: bytes {e.offset}..{end} lie outside the {buffer_bytes}-byte buffer"
            )
        if e.nbytes:
            spans.append((e.offset, end, e.name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise TransportError(
                f"bucket {handle.bucket}: the bytes of parameters {a!r} and {b!r} overlap"
            )


#: At most this many distinct buffers are held through cached views (the CUDA IPC
#: importer keeps 16 slots mapped): a handle of a further buffer is loaded uncached.
MAX_VIEWED_BUFFERS = 16


class _Prepared:
    """A handle validated against the parameters and an opened buffer, with its copies.

    Reused while the handle's importer returns the very same buffer for it: the
    entries were then checked against exactly these parameters and this buffer.
    ``epoch`` is the last push (``begin``) that used it.
    """

    __slots__ = ("buffer", "copies", "epoch", "nbytes", "params")

    def __init__(
        self,
        buffer: torch.Tensor,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        nbytes: int,
        epoch: int,
    ) -> None:
        self.buffer = buffer
        self.copies = copies  # (parameter, view of the buffer), in entry order
        self.params = [dst for dst, _ in copies]
        self.nbytes = nbytes
        self.epoch = epoch


class ParameterReceiver:
    """Copies buckets from transport handles into a worker's own parameter tensors.

    Importers are made on first use from the handle's ``kind`` by ``importer_factory``
    (default: :func:`asyncrefit.transport.make_importer`).

    The parameters' shapes and dtypes are those of the tensors given here, for the
    receiver's life (they are what :meth:`specs` reports, and what the coordinator
    validated the plan against). A handle is validated in full the first time it
    arrives (by value: the same bucket of the same slot comes with an equal handle at
    every push), and its copies (views of the opened buffer, paired with the
    parameters) are kept with it while its importer returns the same buffer for it;
    a handle seen before is not checked again.

    Resource handling: handles are opened through per-transport importers that cache
    their mappings across pushes; the receiver keeps views of those cached buffers (of
    at most :data:`MAX_VIEWED_BUFFERS` distinct buffers) and reads them only during
    :meth:`load`, so returning (the ack) means the worker no longer reads the
    trainer's buffer. A view is read only while the importer still returns the very
    buffer it was made of (a mapping the importer dropped, possibly unmapped, is never
    read through an old view); before a handle not seen before is opened (only such
    an open maps anew, and may make the importer drop mappings) the views of earlier
    pushes are dropped, and :meth:`release_handles` and :meth:`close` drop every view
    before they release every cached mapping.

    Error handling: a bucket without a handle for this worker's device, or with any
    entry that does not match this worker's parameters (name, shape, dtype) or cannot
    be read as it says (see :func:`check_layout`), raises :class:`TransportError`
    before any of its bytes are written: the worker keeps its complete version. A
    handle with a ``checksum`` is verified after the copy: a mismatch raises
    :class:`IntegrityError` (the version stays incomplete).
    """

    def __init__(
        self,
        parameters: Mapping[str, torch.Tensor],
        device: DeviceId,
        *,
        importers: Mapping[str, Importer] | None = None,
        importer_factory: Callable[[str], Importer] | None = None,
    ) -> None:
        self.device = device
        self._params = dict(parameters)
        self._importers: dict[str, Importer] = dict(importers or {})
        self._importer_factory = importer_factory or make_importer
        self.state = VersionState()
        self._prepared: dict[Handle, _Prepared] = {}
        self._epoch = 0

    def __repr__(self) -> str:
        return f"<ParameterReceiver device={self.device} params={len(self._params)} {self.state}>"

    @property
    def version(self) -> int | None:
        return self.state.complete

    def specs(self) -> tuple[ParamSpec, ...]:
        return tuple(
            ParamSpec(name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
            for name, t in self._params.items()
        )

    def begin(self, version: int) -> None:
        self.state.begin(version)
        self._epoch += 1

    def _importer(self, kind: str) -> Importer:
        importer = self._importers.get(kind)
        if importer is None:
            importer = self._importers[kind] = self._importer_factory(kind)
        return importer

    def _own_handle(self, handles: tuple[Handle, ...]) -> Handle:
        for handle in handles:
            if handle.device == self.device:
                return handle
        offered = ", ".join(str(h.device) for h in handles) or "none"
        raise TransportError(f"no handle for device {self.device} (offered: {offered})")

    def _check_entries(self, handle: Handle) -> None:
        for e in handle.entries:
            param = self._params.get(e.name)
            if param is None:
                raise TransportError(f"bucket {handle.bucket} names unknown parameter {e.name!r}")
            if tuple(param.shape) != e.shape or dtype_name(param.dtype) != e.dtype:
                raise TransportError(
                    f"bucket {handle.bucket}, parameter {e.name!r}: {e.dtype}{list(e.shape)} "
                    f"sent, {dtype_name(param.dtype)}{list(param.shape)} held"
                )
        check_layout(handle)

    def _prepare(self, handle: Handle, buffer: torch.Tensor) -> _Prepared:
        """Check ``handle`` against ``buffer`` and make its copies (before any write)."""
        check_layout(handle, buffer.numel())
        copies = [
            (
                self._params[e.name],
                buffer[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape),
            )
            for e in handle.entries
        ]
        prepared = _Prepared(buffer, copies, sum(e.nbytes for e in handle.entries), self._epoch)
        old = self._prepared.pop(handle, None)
        del old  # its views of a buffer the importer no longer returns
        viewed = {id(p.buffer) for p in self._prepared.values()}
        if id(buffer) in viewed or len(viewed) < MAX_VIEWED_BUFFERS:
            self._prepared[handle] = prepared
        return prepared

    def _forget_views(self, *, older: bool) -> None:
        """Drop the views of earlier pushes (``older``) or all of them."""
        if older:
            epoch = self._epoch
            self._prepared = {h: p for h, p in self._prepared.items() if p.epoch == epoch}
        else:
            self._prepared = {}

    def load(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> BucketAck:
        """Copy one bucket into the parameters.

        Returns once the copies are complete, or, for an ``ordered`` handle, once they
        are enqueued on the GPU, with the token ordering the producer's next write
        after them in the ack (:meth:`commit`, :meth:`abort` and :meth:`digests` wait
        for them first; closing an importer does too).
        """
        import torch

        start = time.perf_counter()
        self.state.check_loading(version)
        handle = self._own_handle(handles)
        prepared = self._prepared.get(handle)
        if prepared is None:
            self._check_entries(handle)
            # Opening a handle not seen before may map a new buffer, and its importer
            # may drop older mappings then: keep no views of earlier pushes' buffers.
            self._forget_views(older=True)
        importer = self._importer(handle.kind)
        buffer = importer.open(handle)
        try:
            if prepared is None or prepared.buffer is not buffer:
                prepared = self._prepare(handle, buffer)
            prepared.epoch = self._epoch
            self.state.loading(version, bucket)  # from here on, bytes get written
            if torch.is_grad_enabled() and any(p.requires_grad for p in prepared.params):
                with torch.no_grad():
                    for dst, src in prepared.copies:
                        dst.copy_(src)
            else:
                for dst, src in prepared.copies:
                    dst.copy_(src)
            token = importer.finish(handle)
        finally:
            del buffer  # no view is read after the ack
        if handle.checksum is not None:  # reads the parameters: after the copies
            got = checksum(prepared.params)
            if got != handle.checksum:
                raise IntegrityError(bucket, handle.checksum, got)
        return BucketAck(
            bucket=bucket,
            nbytes=prepared.nbytes,
            seconds=time.perf_counter() - start,
            copied=token,
        )

    def settle(self) -> None:
        """Wait for every copy an earlier :meth:`load` left running (ordered handles)."""
        for importer in self._importers.values():
            importer.settle()

    def commit(self, version: int, buckets: int) -> None:
        self.settle()
        self.state.commit(version, buckets)

    def abort(self, version: int) -> None:
        self.settle()
        self.state.abort(version)

    def digests(self) -> dict[str, str]:
        self.settle()
        return {name: tensor_digest(t) for name, t in self._params.items()}

    def release_handles(self) -> None:
        self._forget_views(older=False)  # before the mappings they view are closed
        for importer in self._importers.values():
            importer.close()

    def close(self) -> None:
        self.release_handles()
