"""What the coordinator needs of an inference worker and of a trainer source."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ._core._plan import ParamSpec
from ._device import DeviceId
from ._wire._messages import BucketAck
from .transport._base import Handle

if TYPE_CHECKING:
    from ._core._plan import Bucket, Plan
    from ._gate import WriteGate
    from .transport.destinations import Destinations


@runtime_checkable
class Worker(Protocol):
    """An inference worker, as the coordinator sees it.

    Every method is a coroutine function that the coordinator awaits on its own loop.
    An implementation that talks to a worker living elsewhere (a process, a Ray actor,
    a vLLM engine) sends a request and awaits the reply: the worker's own code runs on
    the worker's own event loop, and no coroutine or future object ever crosses over.

    ``load_bucket`` returns only after the worker finished copying and dropped its
    views of the buffer: that return is the ack the coordinator frees buffers on.
    """

    @property
    def name(self) -> str: ...

    async def report_device_id_async(self) -> DeviceId: ...

    async def parameter_specs(self) -> Sequence[ParamSpec]: ...

    async def begin_update(self, version: int) -> None: ...

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck: ...

    async def commit_update(self, version: int, buckets: int) -> None: ...

    async def abort_update(self, version: int) -> None: ...

    async def weight_version(self) -> int | None: ...

    async def release_handles(self) -> None: ...


@runtime_checkable
class DirectWorker(Worker, Protocol):
    """A worker whose parameters a trainer on its node may write directly.

    ``destinations`` describes the memory the worker exported its parameters in
    (``None``: it exports none now, and is sent buckets as any worker). The
    coordinator asks once, when it plans, and has a source that can write there
    (:class:`WritingSource`) open it. A push then costs such a worker two calls:
    ``begin_direct(version)``, after which the trainer may write its parameters at any
    time (it holds no complete version from then on, and serves nothing from them),
    and ``commit_update`` (with the plan's bucket count) once every byte is written,
    or ``abort_update``. No bucket is loaded.

    Workers that take their steps together (the ranks of one vLLM engine) may name
    the same ``direct_group`` (an optional attribute, a string): the coordinator then
    writes all of them directly or none of them.
    """

    async def destinations(self) -> Destinations | None: ...

    async def begin_direct(self, version: int) -> None: ...


@runtime_checkable
class RestoringWorker(DirectWorker, Protocol):
    """A :class:`DirectWorker` that can take a direct begin back before any write.

    ``abort_unwritten(version)`` aborts ``version`` as ``abort_update`` does, and
    tells the worker that the trainer wrote no byte of it: the worker holds the
    complete version it held before the begin again, and serves it as before. The
    coordinator sends it only when no write of the push was issued. With every worker
    of a push written directly and restoring, the coordinator begins them while it
    reads the trainer's tensors; should those no longer match the plan, it takes the
    begins back this way and plans again, so nothing is lost.
    """

    async def abort_unwritten(self, version: int) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceInfo:
    """What a trainer source holds and which devices it can serve.

    ``devices`` is ``None`` when the source serves every device on its node (shared
    memory), or the device names it serves (a GPU's UUID for CUDA IPC). ``remote``
    names devices anywhere that the source reaches without sharing memory (by a
    collective), or is ``None`` for any device at all; the coordinator routes each
    worker to the first source that serves its device, so list sharing sources first.

    ``gathers`` marks one rank of a sharded trainer: its exports take part in
    collectives with the other ranks' sources, so the coordinator drives it through
    every bucket, in plan order, whether or not it serves a worker, and lets a bucket's
    exports on all such sources finish once they began (a rank left out of a gather
    would leave the others waiting).

    ``stages`` is ``False`` for a source whose buckets are its parameters' own memory
    (zero-copy slabs): it packs nothing into staging slots, so when no source of a
    coordinator stages, the staging budget bounds nothing and every bucket of a push
    may be in flight at once.

    ``splits`` is whether the source can pack rows of a parameter (a part, see
    :attr:`TensorEntry.part <asyncrefit.planning.TensorEntry>`): parameters larger than a bucket
    are split only when every source can, and every worker takes them in parts.
    """

    name: str
    node: str
    devices: frozenset[str] | None
    specs: tuple[ParamSpec, ...]
    remote: frozenset[DeviceId] | None = frozenset()
    gathers: bool = False
    stages: bool = True
    splits: bool = True

    def serves(self, device: DeviceId) -> bool:
        if self.remote is None or device in self.remote:
            return True
        return device.node == self.node and (self.devices is None or device.device in self.devices)


@runtime_checkable
class TrainerSource(Protocol):
    """The trainer side: holds the parameters and exports packed buckets.

    ``prepare`` allocates ``slots`` reusable buffers of ``slot_bytes``; with
    ``checksum=True`` (passed only when the coordinator verifies) every handle must
    carry the bucket's :func:`~asyncrefit.checksum`. ``export`` packs ``bucket`` into
    ``slot`` and returns one handle per device asked for, with the packed bytes visible
    to consumers by the time it returns. ``aclose`` frees every buffer and may be
    called more than once.
    """

    async def describe(self) -> SourceInfo: ...

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None: ...

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class TransmittingSource(TrainerSource, Protocol):
    """A source that must act while its workers load a bucket (a collective's root).

    The coordinator awaits ``transmit(bucket, slot)`` concurrently with the workers'
    ``load_bucket`` calls for that bucket, in the same task group: if either side fails,
    the other is cancelled, and the bucket's slot is released only after both ended.
    """

    async def transmit(self, bucket: Bucket, slot: int) -> None: ...


@runtime_checkable
class PushEndingSource(TrainerSource, Protocol):
    """A source that is told when a push ends (a trainer rank in another process).

    The coordinator awaits ``end_push(version, ok)`` on every such source after every
    push that described it, whatever happened (shielded, bounded by its
    ``cleanup_timeout``; errors are logged): a rank that serves the push returns to
    training then.
    """

    async def end_push(self, version: int, ok: bool) -> None: ...


@runtime_checkable
class OrderedSource(TrainerSource, Protocol):
    """A source whose next pack into a slot can wait for the consumers on the device.

    Before every export the coordinator calls ``order_after(slot, tokens)`` with the
    ``copied`` tokens of the acks of the workers it routes to this source, for the
    bucket last packed into ``slot`` in this push (none for a slot's first bucket). A
    source that marks its handles ``ordered`` (so that workers ack once their copies
    are enqueued) must order its pack after those tokens.
    """

    def order_after(self, slot: int, tokens: Sequence[bytes]) -> None: ...


@runtime_checkable
class WritingSource(TrainerSource, Protocol):
    """A source that writes buckets straight into workers' exported parameters.

    ``attach(worker, destinations, plan)`` opens a :class:`DirectWorker`'s
    destinations for ``plan`` and returns whether this source can write there (the
    worker then gets no staged buckets from it); it raises for destinations that do
    not match the plan. ``write(buckets, workers)`` writes the tensors of
    ``buckets`` (consecutive buckets of the plan, in order; together they may exceed
    the budget, so it materialises what it must one bucket at a time) into each
    attached worker's places, complete on return except on a device, where
    ``flush(wait=True)`` waits for every write issued, and ``flush(wait=False)``
    records the completion event of each worker that exported one
    (:attr:`~asyncrefit.transport.destinations.Destinations.event`: the worker waits
    for it before it commits) and waits for the writes into the others;
    ``detach(worker)`` closes what ``attach`` opened (``aclose`` closes them all).
    """

    async def attach(self, worker: str, destinations: Destinations, plan: Plan) -> bool: ...

    async def write(self, buckets: Sequence[Bucket], workers: Sequence[str]) -> None: ...

    async def flush(self, *, wait: bool = True) -> None: ...

    async def detach(self, worker: str) -> None: ...


@runtime_checkable
class GatedWritingSource(WritingSource, Protocol):
    """A :class:`WritingSource` that takes a push's writes before its workers began.

    ``write_gated(buckets, workers, gate)`` is ``write(buckets, workers)``, called
    while the workers may still be beginning and the trainer's tensors not yet read
    (:meth:`~TrainerSource.describe`), with every bucket of the push: the source hands
    it to its thread, which waits for ``gate`` and writes nothing before the push opens
    it (:meth:`WriteGate.wait <asyncrefit.abc.WriteGate.wait>` returns ``True``: every
    worker began, and the tensors read match the plan), then writes bucket after
    bucket, materialising one at a time, and stops before the next bucket once the
    gate is :attr:`~asyncrefit.abc.WriteGate.stopped` (the push failed or was cancelled
    meanwhile). It returns ``True`` once it wrote every bucket, as ``write`` does;
    ``False`` if the gate was shut first (the plan no longer holds, or the push failed
    or was cancelled: nothing written) or stopped. The first write starts as soon as
    the last begin is answered, without a hand-off to a thread after it, and the
    writes go on without one between buckets. The push opens or shuts the gate in
    every case (also when the call is cancelled), so waiting for it cannot hang.
    """

    async def write_gated(
        self, buckets: Sequence[Bucket], workers: Sequence[str], gate: WriteGate
    ) -> bool: ...
