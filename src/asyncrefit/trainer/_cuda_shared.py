"""Zero-copy on the GPU: the trainer's parameters live in CUDA IPC-shared slabs."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._cuda import cuda_device, device_index
from .._device import DeviceId
from .._exceptions import ClosedError, PackError, TransportError
from ..transport._base import Handle
from ._local import NamesLike, _InProcessSource, entry_view

if TYPE_CHECKING:
    import torch

    from .._plan import Bucket, Plan, TensorEntry


@dataclass(slots=True)
class _Slab:
    """One bucket's memory: the parameters of the bucket are views into ``tensor``."""

    tensor: torch.Tensor
    ipc_handle: bytes
    storage_bytes: int
    storage_offset: int
    event: Any  # interprocess event recorded at each export
    event_handle: bytes


class CudaSharedParameterTrainer(_InProcessSource):
    """A zero-copy :class:`~asyncrefit.TrainerSource` for parameters on one GPU.

    The GPU counterpart of :class:`~asyncrefit.SharedParameterTrainer`: ``prepare``
    lays the parameters out bucket by bucket in one CUDA allocation per bucket (a
    *slab*, shared once by CUDA IPC) and rebinds each parameter's ``.data`` to its place
    there. Optimizer steps then update the slabs in place, and a push hands the
    consumers on this GPU the slabs' handles without packing: each consumer's copy is
    the only copy. A parameter the training loop replaced (its storage moved), one not
    laid out row-major, or one the engine holds in another dtype is copied (cast) into
    its slab at every push instead.

    ``device`` is the trainer's GPU (default the current one); only workers on that GPU
    are served (route others to another source). ``names`` maps names as for
    :class:`~asyncrefit.LocalTrainer`.

    Workers read the parameters while a push runs: do not step the optimizer then. An
    export records the slab's interprocess event on this thread's current stream, so
    consumers read what the training stream wrote before the push; the push returns
    only after every worker's copies completed (workers ack once their copies are
    enqueued and wait for them before they commit).

    Resource handling: ``aclose`` drops the slabs' handles and events; the parameters
    keep their memory (views of the slabs), which lives as long as the tensors do.
    A layout that fails part-way leaves the parameters it moved in the new slabs
    (their values unchanged) and frees the rest.

    Error handling: a parameter not on this GPU, changed in shape or dtype, or whose
    copy failed raises :class:`~asyncrefit.PackError` naming the source, bucket and
    parameter; no CUDA, or a slab that does not fit, raises
    :class:`~asyncrefit.TransportError`.
    """

    def __init__(
        self,
        parameters: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        device: int | str | torch.device | None = None,
        node: str | None = None,
        name: str = "trainer",
        names: NamesLike | None = None,
    ) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TransportError("CudaSharedParameterTrainer needs CUDA, which is not available")
        self._index = device_index(device, transport="cuda_ipc")
        self.device_id: DeviceId = cuda_device(self._index, node=node)
        super().__init__(parameters, devices=[self.device_id], node=node, name=name, names=names)
        self._owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._generation = 0
        self._slabs: dict[int, _Slab] = {}
        self._addresses: dict[str, int] = {}
        self._fingerprint: str | None = None
        self._checksum = False
        self.relocated = 0  # parameters copied back into place after being replaced

    def __repr__(self) -> str:
        size = sum(s.storage_bytes for s in self._slabs.values())
        return (
            f"<CudaSharedParameterTrainer {self._name!r} cuda:{self._index} "
            f"slabs={len(self._slabs)} bytes={size}>"
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

        from ..transport.cuda_ipc import interprocess_event, share_cuda_tensor

        if plan.fingerprint == self._fingerprint and self._slabs:
            return
        tensors = self._read()
        device = torch.device("cuda", self._index)
        slabs: dict[int, _Slab] = {}
        try:
            for bucket in plan.buckets:
                tensor = torch.empty(max(1, bucket.nbytes), dtype=torch.uint8, device=device)
                ipc_handle, storage_bytes, storage_offset = share_cuda_tensor(tensor)
                event, event_handle = interprocess_event(self._index)
                slabs[bucket.index] = _Slab(
                    tensor, ipc_handle, storage_bytes, storage_offset, event, event_handle
                )
            with torch.no_grad():
                for bucket in plan.buckets:
                    for e in bucket.entries:
                        self._place(slabs[bucket.index].tensor, bucket.index, e, tensors)
        except RuntimeError as exc:
            raise TransportError(
                f"cannot lay out the parameters of {self._name!r} in slabs on "
                f"cuda:{self._index}: {exc}"
            ) from exc
        self._slabs = slabs
        self._generation += 1
        self._fingerprint = plan.fingerprint

    def _place(
        self, base: torch.Tensor, bucket: int, e: TensorEntry, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        with self._packing(bucket, e):
            tensor = self._tensor(tensors, bucket, e)
            if tensor.device != base.device:
                raise PackError(
                    self._name, bucket, e.name, f"is on {tensor.device}, not {base.device}"
                )
            view = entry_view(base, e).view(e.shape)
            view.copy_(tensor)
            if tensor.stride() == view.stride() and tensor.dtype == view.dtype:
                tensor.data = view  # from now on it lives in the slab
                self._addresses[e.name] = view.data_ptr()
            else:
                self._addresses.pop(e.name, None)  # copied (cast) in at every push

    def _refresh(self, bucket: Bucket) -> int | None:
        with self._buffer_lock:
            return self._refresh_locked(bucket)

    def _refresh_locked(self, bucket: Bucket) -> int | None:
        import torch

        from .._checksum import checksum

        slab = self._slabs.get(bucket.index)
        if slab is None:  # closed while this waited
            raise ClosedError(f"trainer source {self._name!r} was closed")
        tensors = self._read()
        with torch.no_grad():
            for e in bucket.entries:
                tensor = self._tensor(tensors, bucket.index, e)
                address = self._addresses.get(e.name)
                if e.nbytes and tensor.data_ptr() != address:
                    self._place(slab.tensor, bucket.index, e, tensors)
                    if address is not None:  # it lived in the slab and was replaced
                        self.relocated += 1
        # Consumers' reads start after everything this stream did so far (the
        # optimizer step, the copies above).
        slab.event.record(torch.cuda.current_stream(self._index))
        if not self._checksum:
            return None
        return checksum(slab.tensor[e.offset : e.offset + e.nbytes] for e in bucket.entries)

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        from ..transport.cuda_ipc import CudaIpcHandle

        if bucket.index not in self._slabs:
            raise ClosedError(f"trainer source {self._name!r} has no slabs (not prepared)")
        for d in devices:
            if d != self.device_id:
                raise TransportError(
                    f"a slab on {self.device_id} cannot serve device {d}: route workers "
                    "on other GPUs to another source"
                )
        crc = await anyio.to_thread.run_sync(self._refresh, bucket, limiter=self._limiter)
        slab = self._slabs[bucket.index]
        return tuple(
            CudaIpcHandle(
                device=d,
                bucket=bucket.index,
                nbytes=bucket.nbytes,
                entries=bucket.entries,
                checksum=crc,
                # Nothing writes a slab again before the push ended (which waits for
                # every consumer's copies): consumers may ack as soon as they enqueued.
                ordered=True,
                owner=self._owner,
                slot=bucket.index,
                generation=self._generation,
                ipc_handle=slab.ipc_handle,
                storage_bytes=slab.storage_bytes,
                storage_offset=slab.storage_offset,
                event_handle=slab.event_handle,
            )
            for d in devices
        )

    def _drop(self) -> None:
        import torch

        slabs, self._slabs = self._slabs, {}
        self._fingerprint = None
        if slabs:
            torch.cuda.current_stream(self._index).synchronize()
        slabs.clear()  # the parameters' views keep the memory

    async def aclose(self) -> None:
        """Drop the slabs' handles and events, after an export still running."""
        await self._close_in_thread(self._drop)
