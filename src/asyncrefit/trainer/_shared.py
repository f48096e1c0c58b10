"""Zero-copy on the CPU: the trainer's parameters live in shared-memory segments."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from .._device import DeviceId
from ..transport._base import Handle
from ._local import NamesLike
from ._slabs import SlabSpec, _SlabSource

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket
    from ..transport.shm import _Segment


class SharedParameterTrainer(_SlabSource["_Segment"]):
    """A zero-copy :class:`~asyncrefit.abc.TrainerSource` for CPU parameters.

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

    _noun = "segments"

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

    def __repr__(self) -> str:
        size = sum(s.size for s in self._slabs.values())
        return f"<SharedParameterTrainer {self._name!r} segments={len(self._slabs)} bytes={size}>"

    def _begin_layout(self) -> None:
        self._unlink()
        self._generation += 1  # the new segments' names differ from the old ones'

    def _allocate(self, spec: SlabSpec) -> _Segment:
        from ..transport.shm import _Segment, segment_name

        name = segment_name(self._token, self._generation, spec.index)
        return _Segment.create(name, spec.nbytes)

    def _base(self, slab: _Segment) -> torch.Tensor | None:
        return slab.tensor

    def _layout_failed(self, slabs: Mapping[int, _Segment], exc: BaseException) -> None:
        # Parameters placed so far keep their memory (their views hold it).
        for seg in slabs.values():
            _unlink_segment(seg)

    def _device_error(self, tensor: torch.Tensor, base: torch.Tensor) -> str | None:
        if tensor.device.type != "cpu":
            return f"is on {tensor.device}, not the CPU"
        return None

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        from ..transport.shm import ShmHandle

        self._check_prepared(bucket)
        crc = await self._refresh_in_thread(bucket)
        segment = self._slabs[bucket.index].name
        return self._handles_for(
            bucket.index,
            bucket,
            devices,
            lambda d: ShmHandle(
                device=d,
                bucket=bucket.index,
                nbytes=bucket.nbytes,
                entries=bucket.entries,
                segment=segment,
                checksum=crc,
            ),
        )

    def _unlink(self) -> None:
        segments, self._slabs = self._slabs, {}
        self._handles.clear()
        self._laid_out = None
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
