"""Zero-copy on the GPU: the trainer's parameters live in CUDA IPC-shared slabs."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._cuda import cuda_device, device_index
from .._device import DeviceId
from .._exceptions import TransportError
from ..transport._base import Handle
from ._local import NamesLike
from ._slabs import SlabSpec, _SlabSource

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket, Plan


@dataclass(slots=True)
class _Slab:
    """One bucket's memory: the parameters of the bucket are views into ``tensor``."""

    tensor: torch.Tensor
    ipc_handle: bytes
    storage_bytes: int
    storage_offset: int
    event: Any  # interprocess event recorded at each export
    event_handle: bytes


class CudaSharedParameterTrainer(_SlabSource[_Slab]):
    """A zero-copy :class:`~asyncrefit.abc.TrainerSource` for parameters on one GPU.

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

    def __repr__(self) -> str:
        size = sum(s.storage_bytes for s in self._slabs.values())
        return (
            f"<CudaSharedParameterTrainer {self._name!r} cuda:{self._index} "
            f"slabs={len(self._slabs)} bytes={size}>"
        )

    def _layout_locked(self, plan: Plan) -> bool:
        laid_out = super()._layout_locked(plan)
        if laid_out:
            self._generation += 1  # consumers open the new slabs' handles afresh
        return laid_out

    def _allocate(self, spec: SlabSpec) -> _Slab:
        import torch

        from ..transport.cuda_ipc import interprocess_event, share_cuda_tensor

        device = torch.device("cuda", self._index)
        tensor = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
        ipc_handle, storage_bytes, storage_offset = share_cuda_tensor(tensor)
        event, event_handle = interprocess_event(self._index)
        return _Slab(tensor, ipc_handle, storage_bytes, storage_offset, event, event_handle)

    def _base(self, slab: _Slab) -> torch.Tensor:
        return slab.tensor

    def _layout_failed(self, slabs: Mapping[int, _Slab], exc: BaseException) -> None:
        # The slabs no parameter was placed in are freed with the last reference.
        if isinstance(exc, RuntimeError):
            raise TransportError(
                f"cannot lay out the parameters of {self._name!r} in slabs on "
                f"cuda:{self._index}: {exc}"
            ) from exc

    def _refreshed(self, slab: _Slab) -> None:
        import torch

        # Consumers' reads start after everything this stream did so far (the
        # optimizer step, the copies of the refresh).
        slab.event.record(torch.cuda.current_stream(self._index))

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        from ..transport.cuda_ipc import CudaIpcHandle

        self._check_prepared(bucket)
        for d in devices:
            if d != self.device_id:
                raise TransportError(
                    f"a slab on {self.device_id} cannot serve device {d}: route workers "
                    "on other GPUs to another source"
                )
        crc = await self._refresh_in_thread(bucket)
        slab = self._slabs[bucket.index]
        return self._handles_for(
            bucket.index,
            bucket,
            devices,
            lambda d: CudaIpcHandle(
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
            ),
        )

    def _drop(self) -> None:
        import torch

        slabs, self._slabs = self._slabs, {}
        self._handles.clear()
        self._laid_out = None
        if slabs:
            torch.cuda.current_stream(self._index).synchronize()
        slabs.clear()  # the parameters' views keep the memory

    async def aclose(self) -> None:
        """Drop the slabs' handles and events, after an export still running."""
        await self._close_in_thread(self._drop)
