"""Parameters that live in their buckets' memory: the layout, re-pointing and refresh.

:class:`~asyncrefit.SharedParameterTrainer` (shared-memory segments on the CPU) and
:class:`~asyncrefit.trainer.CudaSharedParameterTrainer` (CUDA IPC allocations on one
GPU) lay the trainer's parameters out in one flat ``uint8`` buffer per bucket, a
*slab*, and re-point each parameter's ``.data`` at its place there, so that a push
exports the slabs without packing. What they share is here:

- :class:`SlabLayout`: the slabs to allocate and the place of every parameter, a pure
  value computed from the plan;
- :func:`refresh_action`: what a push does with one parameter (nothing, copy it in, or
  copy back one the training loop replaced), a pure decision;
- :func:`bind`: copy a parameter into its place and re-point it there if it can live
  there unchanged;
- :class:`_SlabSource`: the trainer source built on them. A trainer adds how a slab is
  allocated and released, its handles, and what a refresh orders on its device.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import anyio

from .._checksum import checksum
from .._exceptions import ClosedError, PackError
from ._local import NamesLike, _InProcessSource, entry_view

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket, Plan, TensorEntry
    from .._device import DeviceId

_S = TypeVar("_S")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlabSpec:
    """One bucket's slab: the bytes to allocate and the places of its parameters."""

    index: int
    #: At least one byte: a bucket of empty tensors still gets an allocation.
    nbytes: int
    entries: tuple[TensorEntry, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SlabLayout:
    """Where a plan's parameters live: one slab per bucket, in the plan's order.

    A pure value: it depends on the plan only. A source lays its parameters out anew
    when the layout changed: the parameter set, or only how it is cut into buckets.
    """

    fingerprint: str
    slabs: tuple[SlabSpec, ...]

    @classmethod
    def of(cls, plan: Plan) -> SlabLayout:
        """The layout of ``plan``'s buckets, each in a slab of its own."""
        return cls(
            fingerprint=plan.fingerprint,
            slabs=tuple(
                SlabSpec(index=b.index, nbytes=max(1, b.nbytes), entries=b.entries)
                for b in plan.buckets
            ),
        )

    @property
    def nbytes(self) -> int:
        """The bytes of all slabs together."""
        return sum(s.nbytes for s in self.slabs)


class Refresh(enum.Enum):
    """What a push does with one parameter before its slab is exported."""

    #: It lives in its slab (or holds no bytes): the slab already holds its value.
    KEEP = "keep"
    #: It keeps its own memory (not row-major, or cast to the engine's dtype): its
    #: value is copied (cast) into the slab at every push.
    COPY = "copy"
    #: It lived in its slab and the training loop replaced it: it is copied back into
    #: place (and counted in the source's ``relocated``).
    RELOCATE = "relocate"


def refresh_action(entry: TensorEntry, pointer: int, address: int | None) -> Refresh:
    """The refresh of ``entry``'s parameter, whose data is now at ``pointer``.

    ``address`` is where the parameter was re-pointed into its slab when it was last
    placed, or ``None`` where it kept its own memory.
    """
    if not entry.nbytes or pointer == address:
        return Refresh.KEEP
    return Refresh.COPY if address is None else Refresh.RELOCATE


def bind(view: torch.Tensor, tensor: torch.Tensor) -> int | None:
    """Copy ``tensor`` into its place ``view``; re-point it there if it can live there.

    ``view`` is the parameter's place in a slab, row-major in the engine's dtype. A
    tensor of the same strides and dtype has its ``.data`` re-pointed at ``view``
    (from now on it lives in the slab) and the address of its data is returned.
    Workers read a slab's bytes in row-major order and in the engine's dtype, so a
    transposed or ``channels_last`` tensor, or one the engine holds in another dtype,
    cannot live there without changing under the training loop: it keeps its own
    memory (its value was copied, cast) and ``None`` is returned.

    Call it under ``torch.no_grad()``.
    """
    view.copy_(tensor)
    if tensor.stride() == view.stride() and tensor.dtype == view.dtype:
        tensor.data = view
        return view.data_ptr()
    return None


class _SlabSource(_InProcessSource, Generic[_S]):
    """A source whose parameters live in one slab ``_S`` per bucket.

    ``prepare`` lays the parameters out (once per parameter set), an export refreshes
    a bucket's slab (:func:`refresh_action`) before the subclass makes its handles. A
    subclass implements :meth:`_allocate` and :meth:`_base`, and may add
    :meth:`_begin_layout`, :meth:`_layout_failed` and :meth:`_refreshed`; it
    implements ``export`` (with :meth:`_check_prepared` and :meth:`_refresh_in_thread`)
    and ``aclose``.

    Resource handling: the slabs are the subclass's (allocated by :meth:`_allocate`,
    held in ``_slabs``); a layout that fails part-way hands what it allocated to
    :meth:`_layout_failed`, and the parameters placed so far keep their memory (their
    views hold it) with their values unchanged.

    Error handling: a parameter that cannot be placed (it disappeared, changed shape
    or dtype, is on the wrong device, its copy failed) raises
    :class:`~asyncrefit.PackError` naming this source, the bucket and the parameter; a
    refresh or export after ``aclose`` raises :class:`~asyncrefit.ClosedError`.
    """

    #: What the slabs are called in errors.
    _noun: ClassVar[str] = "slabs"
    #: The slabs are the parameters' memory: nothing is staged (see SourceInfo).
    _stages = False

    def __init__(
        self,
        parameters: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        devices: Iterable[DeviceId | str] | None,
        node: str | None,
        name: str,
        names: NamesLike | None,
    ) -> None:
        # The parameters are re-homed into the slabs one by one: they are pushed under
        # their own names (a checkpoint layout's views would not be parameters).
        super().__init__(
            parameters,
            devices=devices,
            node=node,
            name=name,
            names=names,
            checkpoint_names=False,
        )
        self._generation = 0
        self._slabs: dict[int, _S] = {}
        self._addresses: dict[str, int] = {}  # parameter -> its data in its slab
        self._laid_out: SlabLayout | None = None  # the layout the slabs hold
        self._checksum = False
        self.relocated = 0  # parameters copied back into place after being replaced

    # What a subclass adds.

    def _begin_layout(self) -> None:
        """Before a new layout allocates (under the buffer lock)."""

    def _allocate(self, spec: SlabSpec) -> _S:
        """A new slab of ``spec.nbytes`` for bucket ``spec.index``."""
        raise NotImplementedError

    def _base(self, slab: _S) -> torch.Tensor | None:
        """The flat ``uint8`` tensor of ``slab``, ``None`` once it was released."""
        raise NotImplementedError

    def _layout_failed(self, slabs: Mapping[int, _S], exc: BaseException) -> None:
        """Release the slabs of a layout that failed with ``exc``; may raise instead."""

    def _device_error(self, tensor: torch.Tensor, base: torch.Tensor) -> str | None:
        """Why ``tensor`` cannot be placed in the slab ``base``, if it cannot."""
        if tensor.device != base.device:
            return f"is on {tensor.device}, not {base.device}"
        return None

    def _refreshed(self, slab: _S) -> None:
        """After a refresh wrote ``slab`` and before its handles are made."""

    # Layout.

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        await anyio.to_thread.run_sync(self._layout, plan, limiter=self._limiter)
        self._checksum = checksum

    def _layout(self, plan: Plan) -> bool:
        with self._buffer_lock:
            return self._layout_locked(plan)

    def _layout_locked(self, plan: Plan) -> bool:
        """Lay the parameters out in new slabs, unless laid out for this parameter set
        already; whether it did."""
        import torch

        layout = SlabLayout.of(plan)
        if layout == self._laid_out and self._slabs:
            return False
        self._begin_layout()
        tensors = self._read()
        slabs: dict[int, _S] = {}
        try:
            for spec in layout.slabs:
                slabs[spec.index] = self._allocate(spec)
            with torch.no_grad():
                for spec in layout.slabs:
                    base = self._base(slabs[spec.index])
                    assert base is not None
                    for e in spec.entries:
                        self._place(base, spec.index, e, tensors)
        except BaseException as exc:
            self._layout_failed(slabs, exc)
            raise
        self._slabs = slabs
        self._laid_out = layout
        return True

    def _place(
        self,
        base: torch.Tensor,
        bucket: int,
        e: TensorEntry,
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        with self._packing(bucket, e):
            tensor = self._tensor(tensors, bucket, e)
            problem = self._device_error(tensor, base)
            if problem is not None:
                raise PackError(self._name, bucket, e.name, problem)
            address = bind(entry_view(base, e).view(e.shape), tensor)
            if address is None:
                self._addresses.pop(e.name, None)  # copied (cast) in at every push
            else:
                self._addresses[e.name] = address

    # Refresh.

    def _check_prepared(self, bucket: Bucket) -> None:
        if bucket.index not in self._slabs:
            raise ClosedError(f"trainer source {self._name!r} has no {self._noun} (not prepared)")

    async def _refresh_in_thread(self, bucket: Bucket) -> int | None:
        """Refresh ``bucket``'s slab off the event loop; its checksum if asked for.

        Where nothing is to copy (no parameter of the bucket moved, no checksum asked
        for) the refresh is a check of addresses, done here without a thread's hand-off,
        which cost more than the check (see :meth:`_refresh_unmoved`).
        """
        if self._refresh_unmoved(bucket):
            await anyio.lowlevel.checkpoint()
            return None
        return await anyio.to_thread.run_sync(self._refresh, bucket, limiter=self._limiter)

    def _refresh_unmoved(self, bucket: Bucket) -> bool:
        """The refresh of ``bucket`` on the calling thread, if it writes nothing: every
        parameter is where it was placed and no checksum is asked for. Returns whether
        it was done; ``False`` (nothing done) also while a pack or close holds the
        buffers, or after a close: the thread's path then waits, or raises."""
        if self._checksum or not self._buffer_lock.acquire(blocking=False):
            return False
        try:
            slab = self._slabs.get(bucket.index)
            if slab is None or self._base(slab) is None:
                return False
            tensors = self._read()
            addresses = self._addresses
            for e in bucket.entries:
                pointer = self._tensor(tensors, bucket.index, e).data_ptr()
                if refresh_action(e, pointer, addresses.get(e.name)) is not Refresh.KEEP:
                    return False
            self._refreshed(slab)
            return True
        finally:
            self._buffer_lock.release()

    def _refresh(self, bucket: Bucket) -> int | None:
        with self._buffer_lock:
            return self._refresh_locked(bucket)

    def _refresh_locked(self, bucket: Bucket) -> int | None:
        import torch

        slab = self._slabs.get(bucket.index)
        base = None if slab is None else self._base(slab)
        if slab is None or base is None:  # closed while this waited
            raise ClosedError(f"trainer source {self._name!r} was closed")
        tensors = self._read()
        with torch.no_grad():
            for e in bucket.entries:
                tensor = self._tensor(tensors, bucket.index, e)
                action = refresh_action(e, tensor.data_ptr(), self._addresses.get(e.name))
                if action is not Refresh.KEEP:
                    self._place(base, bucket.index, e, tensors)
                    if action is Refresh.RELOCATE:
                        self.relocated += 1
        self._refreshed(slab)
        if not self._checksum:
            return None
        return checksum(base[e.offset : e.offset + e.nbytes] for e in bucket.entries)
