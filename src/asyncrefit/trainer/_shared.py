"""Zero-copy on the CPU: the trainer's parameters live in shared-memory segments."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio

from .._checksum import checksum
from .._device import DeviceId
from .._exceptions import ClosedError, PackError
from ..transport._base import Handle
from ._local import NamesLike, _InProcessSource, entry_view

if TYPE_CHECKING:
    import torch

    from .._plan import Bucket, Plan, TensorEntry
    from ..transport.shm import ShmHandle, _Segment


class SharedParameterTrainer(_InProcessSource):
    """A zero-copy :class:`~asyncrefit.TrainerSource` for CPU parameters.

    ``prepare`` lays the parameters out bucket by bucket in shared-memory segments
    (one copy, once per plan) and rebinds each parameter's ``.data`` to its place
    there; optimizer steps then update the shared memory in place, and a push exports
    handles to it without packing. A parameter the training loop replaced (its storage
    moved) is copied back into place at the next push. Strides never change: a
    parameter that is not laid out row-major (a transposed or ``channels_last`` weight)
    keeps its own memory and is copied into its segment at every push.

    ``names`` maps parameter names as for :class:`LocalTrainer`. A parameter the
    engine holds in another dtype is cast into its segment at every push.

    Workers read the parameters while a push runs: do not step the optimizer then (the
    push returns only after every worker acknowledged). A worker that hangs past the
    coordinator's timeout may still be reading when the next step runs; it is reported
    as holding no complete version and must be removed.

    Resource handling: ``aclose`` unlinks every segment name (nothing is left under
    ``/dev/shm``); the parameters keep their memory, which stays valid for as long as
    the tensors live. Shared memory counts against the ``/dev/shm`` size limit. A
    layout that fails part-way unlinks the segments it made.

    Error handling: a parameter that cannot be laid out or exported (not on the CPU,
    changed shape or dtype, its copy failed) raises :class:`~asyncrefit.PackError`
    naming this source, the bucket and the parameter.
    """

    def __init__(
        self,
        parameters: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        devices: Iterable[DeviceId | str] | None = None,
        node: str | None = None,
        name: str = "trainer",
        names: NamesLike | None = None,
    ) -> None:
        super().__init__(parameters, devices=devices, node=node, name=name, names=names)
        self._token = secrets.token_hex(4)
        self._generation = 0
        self._segments: dict[int, _Segment] = {}
        self._addresses: dict[str, int] = {}
        self._fingerprint: str | None = None
        self._checksum = False
        self.relocated = 0  # parameters copied back into place after being replaced

    def __repr__(self) -> str:
        size = sum(s.size for s in self._segments.values())
        return (
            f"<SharedParameterTrainer {self._name!r} segments={len(self._segments)} bytes={size}>"
        )

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        await anyio.to_thread.run_sync(self._layout, plan, limiter=self._limiter)
        self._checksum = checksum

    def _layout(self, plan: Plan) -> None:
        with self._buffer_lock:
            self._layout_locked(plan)

    def _layout_locked(self, plan: Plan) -> None:
        import torch

        from ..transport.shm import _Segment, segment_name

        if plan.fingerprint == self._fingerprint and self._segments:
            return
        self._unlink()
        self._generation += 1
        tensors = self._read()
        segments: dict[int, _Segment] = {}
        try:
            for bucket in plan.buckets:
                name = segment_name(self._token, self._generation, bucket.index)
                segments[bucket.index] = _Segment.create(name, max(1, bucket.nbytes))
        except BaseException:
            for seg in segments.values():
                _unlink_segment(seg)
            raise
        try:
            with torch.no_grad():
                for bucket in plan.buckets:
                    base = segments[bucket.index].tensor
                    assert base is not None
                    for e in bucket.entries:
                        self._place(base, bucket.index, e, tensors)
        except BaseException:
            # Parameters placed so far keep their memory (their views hold it).
            for seg in segments.values():
                _unlink_segment(seg)
            raise
        self._segments = segments
        self._fingerprint = plan.fingerprint

    def _place(
        self,
        base: torch.Tensor,
        bucket: int,
        e: TensorEntry,
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        with self._packing(bucket, e):
            tensor = self._tensor(tensors, bucket, e)
            if tensor.device.type != "cpu":
                raise PackError(self._name, bucket, e.name, f"is on {tensor.device}, not the CPU")
            view = entry_view(base, e).view(e.shape)
            view.copy_(tensor)
            if tensor.stride() == view.stride() and tensor.dtype == view.dtype:
                tensor.data = view  # from now on it lives in the segment
                self._addresses[e.name] = view.data_ptr()
            else:
                # Workers read a bucket's bytes in row-major order and in the engine's
                # dtype, so a transposed or channels_last tensor, or one the engine
                # holds in another dtype, cannot live in the segment without changing
                # under the training loop: it keeps its own memory, and its values are
                # copied (cast) into the segment at every push instead.
                self._addresses.pop(e.name, None)

    def _refresh(self, bucket: Bucket) -> int | None:
        with self._buffer_lock:
            return self._refresh_locked(bucket)

    def _refresh_locked(self, bucket: Bucket) -> int | None:
        import torch

        tensors = self._read()
        segment = self._segments.get(bucket.index)
        if segment is None or segment.tensor is None:  # closed while this waited
            raise ClosedError(f"trainer source {self._name!r} was closed")
        base = segment.tensor
        with torch.no_grad():
            for e in bucket.entries:
                tensor = self._tensor(tensors, bucket.index, e)
                address = self._addresses.get(e.name)
                if e.nbytes and tensor.data_ptr() != address:
                    self._place(base, bucket.index, e, tensors)
                    if address is not None:  # it lived in the segment and was replaced
                        self.relocated += 1
        if not self._checksum:
            return None
        return checksum(base[e.offset : e.offset + e.nbytes] for e in bucket.entries)

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        from ..transport.shm import ShmHandle

        if bucket.index not in self._segments:
            raise ClosedError(f"trainer source {self._name!r} has no segments (not prepared)")
        crc = await anyio.to_thread.run_sync(self._refresh, bucket, limiter=self._limiter)
        segment = self._segments[bucket.index].name
        handles: tuple[ShmHandle, ...] = tuple(
            ShmHandle(
                device=d,
                bucket=bucket.index,
                nbytes=bucket.nbytes,
                entries=bucket.entries,
                segment=segment,
                checksum=crc,
            )
            for d in devices
        )
        return handles

    def _unlink(self) -> None:
        segments, self._segments = self._segments, {}
        self._fingerprint = None
        for seg in segments.values():
            _unlink_segment(seg)

    async def aclose(self) -> None:
        """Unlink every segment name, after a refresh still running; also when cancelled."""
        await self._close_in_thread(self._unlink)


def _unlink_segment(segment: _Segment) -> None:
    """Remove the name; the memory lives on in the parameters' views."""
    from ..transport.shm import _unlink

    segment.tensor = None
    segment.mapping = None  # views hold the mapping; it is unmapped with the last one
    _unlink(segment.name)
