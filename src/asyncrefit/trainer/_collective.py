"""The trainer side of the collective transport: pack, then broadcast from rank 0.

See :mod:`asyncrefit.transport.collective` for the transport itself (the stateless
group, the handles, the workers' importer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import anyio

from .._device import DeviceId
from .._exceptions import TransportError
from .._protocols import SourceInfo
from ..transport._base import Handle
from ..transport.collective import (
    _SURFACE_GRACE,
    DEFAULT_TIMEOUT,
    Backend,
    _Root,
    _slot_device,
)
from ._local import LocalTrainer, TensorsLike

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket, ParamSpec, Plan


class CollectiveTrainer(LocalTrainer):
    """A :class:`~asyncrefit.abc.TransmittingSource` that broadcasts buckets to remote workers.

    ``parameters`` as for :class:`~asyncrefit.LocalTrainer` (read afresh at every push).
    ``remote`` lists the devices this source serves (default ``None``: any device that
    no source listed before it serves; give the colocated sources first). ``host`` is
    the address the trainer's ``TCPStore`` and its end of the group bind to and that
    workers connect to: ``127.0.0.1`` for workers on this machine, this node's IP
    otherwise (with Ray, ``ray.util.get_node_ip_address()`` on the trainer); ``port``
    0 picks a free one. ``backend`` is ``"gloo"`` (CPU buffers) or ``"nccl"`` (CUDA
    buffers; exercised by the multi-GPU issue). With NCCL, ``device`` is the trainer's
    GPU (an index, ``"cuda:1"``, a ``torch.device``; default: the current device of the
    thread constructing the source): the slots, the group's probe and the broadcasts
    live there, whichever thread runs them. A worker receives on the GPU its handle
    names (by UUID). ``timeout`` bounds the group's
    formation and every broadcast, in seconds; keep it below the coordinator's
    ``timeout`` so that a receiver that never joins is reported by the transport.

    One worker per device: the receiving devices are the group's ranks. The
    coordinator's slots and budget apply unchanged: with two slots, packing bucket
    k+1 overlaps broadcasting bucket k. Broadcasts run in bucket order, one at a time.

    Resource handling: ``prepare`` allocates the slots and starts the store;
    ``aclose`` waits for a running pack and broadcast (each bounded by ``timeout``),
    then tears the group down and frees the slots and the store. A slot is reused only
    after its broadcast ended, which the coordinator guarantees by awaiting
    :meth:`transmit` before releasing the slot.

    Error handling: a broadcast that fails (a receiver died, or did not join within
    ``timeout``) raises :class:`~asyncrefit.TransportError` and tears the group down,
    so receivers blocked in it fail promptly too; the next push forms a new generation.
    A push that ends early for any other reason (cancelled, another worker failed) also
    makes the next push re-form the group.
    """

    _writes_direct = False  # its workers receive by broadcast

    def __init__(
        self,
        parameters: TensorsLike,
        *,
        remote: Iterable[DeviceId] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: Backend = "gloo",
        device: int | str | torch.device | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        node: str | None = None,
        name: str = "collective",
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self._root = _Root(host, port, backend, timeout, _slot_device(backend, device))
        super().__init__(parameters, exporter=self._root, devices=(), node=node, name=name)
        self._remote = frozenset(remote) if remote is not None else None
        # One broadcast at a time, in bucket order (every rank must issue them alike).
        self._send_limiter = anyio.CapacityLimiter(1)
        self._next = 0
        self._advanced: anyio.Event | None = None  # made on the loop that pushes
        self._buckets = 0

    def __repr__(self) -> str:
        return f"<CollectiveTrainer {self._name!r} {self._root!r}>"

    @property
    def address(self) -> tuple[str, int]:
        """The store's ``(host, port)`` (the port is known after ``prepare``)."""
        return self._root.host, self._root.port

    @property
    def generation(self) -> int:
        """The current group generation (grows each time the group is re-formed)."""
        return self._root.generation

    @property
    def device(self) -> torch.device:
        """Where the slots live and the broadcasts start: the CPU (gloo) or the GPU (NCCL)."""
        return self._root.device

    def _info(self, specs: tuple[ParamSpec, ...]) -> SourceInfo:
        # No device of its own (it shares no memory with its workers): it reaches them
        # by the collective.
        return dataclasses.replace(super()._info(specs), devices=frozenset(), remote=self._remote)

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        await super().prepare(plan, slots, slot_bytes, checksum=checksum)
        self._buckets = len(plan.buckets)

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        if bucket.index == 0:
            if self._next not in (0, self._buckets):
                self._root.broken = True  # the last push stopped half-way
            self._next = 0
            self._root.form(devices)
        elif tuple(sorted(set(devices))) != self._root.members:
            raise TransportError("the receiving devices changed in the middle of a push")
        return await super().export(bucket, slot, devices)

    async def transmit(self, bucket: Bucket, slot: int) -> None:
        """Broadcast ``slot`` (holding ``bucket``) to every receiver; returns when sent.

        Waits for the broadcasts of the buckets before it. The broadcast itself runs in
        a thread that cannot be interrupted: a cancellation waits for it, which
        ``timeout`` bounds.
        """
        try:
            while self._next < bucket.index:
                if self._advanced is None:
                    self._advanced = anyio.Event()
                await self._advanced.wait()
            if self._next != bucket.index:
                raise TransportError(f"bucket {bucket.index} was transmitted already")
            await anyio.to_thread.run_sync(
                self._root.send, slot, bucket, limiter=self._send_limiter
            )
        except BaseException as exc:
            self._root.broken = True
            # Receivers may wait in this generation for buckets that will never come:
            # tear it down now (after a broadcast still running), so they fail at once.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._root.timeout + 5):
                await anyio.to_thread.run_sync(self._root.drop_group, limiter=self._send_limiter)
            if isinstance(exc, TransportError):
                # A broadcast fails because a receiver died or stalled, and the
                # coordinator learns which one a moment later: give that worker's error
                # time to cancel this one, so that the push names the worker.
                await anyio.sleep(_SURFACE_GRACE)
            raise
        self._next = bucket.index + 1
        advanced, self._advanced = self._advanced, None
        if advanced is not None:
            advanced.set()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            async with self._send_limiter:
                await super().aclose()
