"""The in-process trainer source: the training loop's own tensors, packed into slots."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio

from ._device import DeviceId, local_node_id
from ._exceptions import ClosedError, PlanError
from ._plan import ParamSpec
from ._worker import SourceInfo
from .transport._base import Exporter, Handle, dtype_name, torch_dtype

if TYPE_CHECKING:
    import torch

    from ._plan import Bucket, Plan

TensorsLike = (
    "torch.nn.Module | Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]"
)


class LocalTrainer:
    """A :class:`~asyncrefit.TrainerSource` over tensors of this process.

    ``parameters`` is a ``torch.nn.Module`` (its ``named_parameters()``), a mapping of
    names to tensors, or a callable returning one; it is read afresh at every push, so
    in-place optimizer steps and replaced tensors are both seen. Packing runs in a
    worker thread so the event loop keeps serving acks meanwhile; do not step the
    optimizer while a push is running.

    ``exporter`` picks the transport (shared memory by default). ``devices`` restricts
    the devices served (default: every device on this node).

    Resource handling: buffers are allocated by ``prepare`` and freed by ``aclose``
    (also on every error path of the coordinator that owns this source).
    """

    def __init__(
        self,
        parameters: torch.nn.Module
        | Mapping[str, torch.Tensor]
        | Callable[[], Mapping[str, torch.Tensor]],
        *,
        exporter: Exporter | None = None,
        devices: Iterable[DeviceId | str] | None = None,
        node: str | None = None,
        name: str = "trainer",
    ) -> None:
        import torch

        if isinstance(parameters, torch.nn.Module):
            module = parameters
            self._tensors: Callable[[], Mapping[str, torch.Tensor]] = lambda: dict(
                module.named_parameters()
            )
        elif isinstance(parameters, Mapping):
            mapping = parameters
            self._tensors = lambda: mapping
        else:
            self._tensors = parameters
        if exporter is None:
            from .transport.shm import SharedMemoryExporter

            exporter = SharedMemoryExporter()
        self._exporter = exporter
        self._node = node if node is not None else local_node_id()
        self._devices = (
            None
            if devices is None
            else frozenset(d.device if isinstance(d, DeviceId) else d for d in devices)
        )
        self._name = name
        self._limiter = anyio.CapacityLimiter(1)
        self._closed = False

    def __repr__(self) -> str:
        return f"<LocalTrainer {self._name!r} node={self._node} exporter={self._exporter!r}>"

    @property
    def exporter(self) -> Exporter:
        return self._exporter

    def specs(self) -> tuple[ParamSpec, ...]:
        return tuple(
            ParamSpec(name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
            for name, t in self._tensors().items()
        )

    async def describe(self) -> SourceInfo:
        return SourceInfo(
            name=self._name, node=self._node, devices=self._devices, specs=self.specs()
        )

    async def prepare(self, plan: Plan, slots: int, slot_bytes: int) -> None:
        if self._closed:
            raise ClosedError(f"trainer source {self._name!r} is closed")
        await anyio.to_thread.run_sync(
            self._exporter.allocate, slots, slot_bytes, limiter=self._limiter
        )

    def _pack(self, bucket: Bucket, slot: int) -> None:
        import torch

        tensors = self._tensors()
        buffer = self._exporter.buffer(slot)
        with torch.no_grad():
            for e in bucket.entries:
                tensor = tensors.get(e.name)
                if tensor is None:
                    raise PlanError(f"parameter {e.name!r} disappeared from the trainer")
                if tuple(tensor.shape) != e.shape or dtype_name(tensor.dtype) != e.dtype:
                    raise PlanError(f"parameter {e.name!r} changed shape or dtype mid-push")
                dst = buffer[e.offset : e.offset + e.nbytes]
                dst.view(torch_dtype(e.dtype)).view(e.shape).copy_(tensor)
        self._exporter.seal(slot)

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        if self._closed:
            raise ClosedError(f"trainer source {self._name!r} is closed")
        await anyio.to_thread.run_sync(self._pack, bucket, slot, limiter=self._limiter)
        return tuple(self._exporter.handle(slot, bucket, d) for d in devices)

    async def aclose(self) -> None:
        self._closed = True
        # Wait for a pack still running in its thread before unmapping its buffer.
        async with self._limiter:
            self._exporter.close()
