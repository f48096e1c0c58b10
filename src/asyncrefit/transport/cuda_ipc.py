"""The CUDA IPC transport: buckets in GPU memory, shared with colocated processes.

The trainer packs a bucket into a *slot*, one flat ``uint8`` CUDA tensor it allocated
once and reuses (two slots alternate with the default budget: ping-pong). Each slot
is exported once as a CUDA IPC memory handle; a :class:`CudaIpcHandle` carries those
64-odd bytes, the slot's place in its allocation and the bucket's layout, and never
tensor data. A worker maps the slot once, on the GPU with the handle's UUID under
whatever index it has there, and keeps the mapping for later pushes.

Ordering, the part that CUDA does not do for us:

- **Pack before use.** The trainer's copies into a slot are asynchronous, and the
  consumer reads the slot in another process, on its own stream. Nothing orders
  those reads after the pack by itself: the event torch records when a storage is
  shared covers only the moment of the first share, not later packs into the same
  reused slot. So each slot has its own interprocess CUDA event:
  :meth:`~CudaIpcExporter.seal` records it on the packing stream before any handle
  leaves the process, and :meth:`CudaIpcImporter.open` makes the consumer's stream
  wait for it before its copies are enqueued. The trainer's host need not wait for
  the pack, so the next bucket's launch overlaps this one's copies. With
  ``CudaIpcExporter(host_sync=True)`` ``seal`` synchronizes the stream on the host
  instead, and the handle carries no event.
- **Copy before ack.** :meth:`CudaIpcImporter.finish` synchronizes the consumer's
  stream after its copies out of the slot, so the ack (sent after ``finish``)
  means the slot is no longer read, and the trainer may pack the next bucket into it.

Lifetimes are the coordinator's protocol, not torch's reference counters: torch
counts, per share, one reader that must release before the producer may free the
memory, so a consumer that is killed would pin the slot's memory in the producer
forever ("limbo"). The exporter therefore releases torch's count as soon as it
shares a slot and consumers are handed no counter; a slot is freed only by
:meth:`CudaIpcExporter.close`, which the coordinator calls after every worker was
told to release its handles (or is dead). Teardown on the worker side is in order:
views (the receiver drops its slices before acking), then the cached bases, then
``torch.cuda.ipc_collect()``.

torch is imported lazily: importing this module never initializes CUDA.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._cuda import cuda_device, cuda_index, device_index, normalize_uuid
from .._device import DeviceId
from .._exceptions import TransportError
from ._base import Handle

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket

logger = logging.getLogger(__name__)

#: Slot sizes are rounded up to this many bytes.
SLOT_ALIGNMENT = 512
#: The reference-counter name handed to consumers: it names no shared memory, so
#: torch's release of a counter when a consumer drops its mapping does nothing
#: (torch ignores a counter it cannot open). See the module docstring for why.
_NO_REF_COUNTER = b"/asyncrefit-cuda-ipc-no-refcount"
#: No share-time event for torch to wait on: each pack has its own (the slot's event).
_NO_EVENT = bytes(64)


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaIpcHandle(Handle):
    """A bucket in a CUDA IPC-shared slot on the GPU named by ``device`` (its UUID).

    ``ipc_handle`` is the CUDA IPC memory handle of the allocation holding the slot,
    which starts ``storage_offset`` bytes into it and is ``storage_bytes`` long.
    ``owner`` (the exporter's process and token) and ``slot`` identify the slot, and
    ``generation`` changes whenever the exporter re-allocates its slots: a worker
    keeps one mapping per ``(owner, slot)`` and re-opens it when the generation moves.
    ``event_handle`` is the IPC handle of the slot's event, recorded after each pack
    (empty when the exporter synchronizes on the host instead).
    """

    kind: ClassVar[str] = "cuda_ipc"
    owner: str
    slot: int
    generation: int
    ipc_handle: bytes
    storage_bytes: int
    storage_offset: int
    event_handle: bytes


def share_cuda_tensor(tensor: torch.Tensor) -> tuple[bytes, int, int]:
    """Share the allocation under a CUDA ``tensor``: ``(ipc_handle, bytes, offset)``.

    The handle names the whole allocation; ``offset`` is where the tensor's storage
    starts in it and ``bytes`` its size. torch's own reader count for the share is
    dropped at once: our protocol (acks, ``release_handles``, close) decides when the
    memory is freed, and a reader that is killed would never release torch's count.
    """
    import torch

    storage: Any = tensor.untyped_storage()
    (
        _device,
        ipc_handle,
        storage_bytes,
        storage_offset,
        ref_counter,
        ref_counter_offset,
        _event,
        _event_sync,
    ) = storage._share_cuda_()
    release: Any = torch.UntypedStorage._release_ipc_counter_cuda
    release(ref_counter, ref_counter_offset)
    return bytes(ipc_handle), int(storage_bytes), int(storage_offset)


def interprocess_event(index: int) -> tuple[Any, bytes]:
    """A new interprocess CUDA event on local GPU ``index``, and its IPC handle."""
    import torch

    event_cls: Any = torch.cuda.Event  # untyped in torch's stubs
    with torch.cuda.device(index):  # the event is created on this GPU
        event = event_cls(interprocess=True)
        return event, bytes(event.ipc_handle())


def _ipc_collect() -> None:
    """``torch.cuda.ipc_collect()``: free what torch kept for IPC consumers."""
    import torch

    cuda: Any = torch.cuda  # untyped in torch's stubs
    cuda.ipc_collect()


@dataclass(slots=True)
class _Slot:
    tensor: torch.Tensor
    ipc_handle: bytes
    storage_bytes: int
    storage_offset: int
    event: Any  # torch.cuda.Event(interprocess=True) recorded after each pack, or None
    event_handle: bytes


class CudaIpcExporter:
    """Trainer-side slots in the memory of one GPU, exported as CUDA IPC handles.

    ``device`` is this process's GPU (an index, ``"cuda:1"``, a ``torch.device``;
    default the current one); :attr:`device_id` names it by UUID. Give the trainer
    source the same device (``LocalTrainer(..., devices=[exporter.device_id])``) so
    that only workers on this GPU are routed to it. With ``release_cached_memory``
    (default), :meth:`close` also returns the freed slots to the driver
    (``torch.cuda.empty_cache()``), so that colocated processes can use the memory.
    With ``host_sync``, :meth:`seal` waits for the pack on the host instead of
    recording the slot's event for the consumers to wait on.

    With ``device_ordering`` (off by default), a trainer source that passes it the consumers'
    tokens (:class:`~asyncrefit.LocalTrainer` under a coordinator does) marks handles
    ``ordered``: a consumer acks once its copies are enqueued, and the repack of the
    slot waits on the GPU for the consumer's "copied" event instead of a host round
    trip (1.3x faster pushes on one H200, see ``benchmarks/RESULTS.md``). The price,
    measured: a consumer process killed after its ack but before its copies ran leaves
    an event whose last record never completes, and the trainer's stream then waits
    on it forever. So it is opt-in; by default every ack comes after the copies
    completed on the consumer's host.

    Resource handling: :meth:`allocate` allocates (or keeps) the slots and shares
    each one once; :meth:`close` waits for the stream, frees every slot, collects
    torch's IPC bookkeeping (``torch.cuda.ipc_collect()``) and is idempotent. The
    caller must make sure no consumer still reads a slot when it closes (the
    coordinator tells every worker to release its handles first). A failed
    allocation frees what it allocated before raising.

    Error handling: no CUDA, an allocation that does not fit (out of memory), or a
    handle asked for another GPU raise :class:`TransportError`.
    """

    kind = "cuda_ipc"

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        *,
        node: str | None = None,
        release_cached_memory: bool = True,
        host_sync: bool = False,
        device_ordering: bool = False,
    ) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TransportError("the cuda_ipc transport needs CUDA, which is not available")
        self._index = device_index(device, transport="cuda_ipc")
        self.device_id: DeviceId = cuda_device(self._index, node=node)
        self._release_cached = release_cached_memory
        self._host_sync = host_sync
        self._owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._generation = 0
        self._slots: list[_Slot] = []
        self._slot_bytes = 0
        self._ordered = False
        self._device_ordering = device_ordering
        self._consumer_events: dict[bytes, Any] = {}  # token -> the consumer's event, opened

    def __repr__(self) -> str:
        return (
            f"<CudaIpcExporter cuda:{self._index} {self.device_id.device} "
            f"slots={len(self._slots)}x{self._slot_bytes} generation={self._generation}>"
        )

    @property
    def index(self) -> int:
        """This process's index of the exporter's GPU."""
        return self._index

    @property
    def slot_bytes(self) -> int:
        """The size of each slot (0 before :meth:`allocate`)."""
        return self._slot_bytes if self._slots else 0

    @property
    def ordered(self) -> bool:
        """Whether handles say ``ordered``: consumers may ack before their copies ran.

        Set by the trainer source that owns the exporter when its coordinator passes it
        every consumer's token (:meth:`order_after`) before each pack; never set it
        otherwise, or a repack may overwrite a bucket still being copied.
        """
        return self._ordered

    @ordered.setter
    def ordered(self, value: bool) -> None:
        self._ordered = value and self._device_ordering

    def order_after(self, slot: int, tokens: Sequence[bytes]) -> None:
        """Make this thread's stream wait for the consumers' copies out of ``slot``.

        ``tokens`` are what the consumers' :meth:`CudaIpcImporter.finish` returned for
        the bucket last packed into ``slot`` (interprocess events they recorded after
        their copies): the pack that follows is ordered after those copies on the GPU,
        with no round trip through the host. Call it in the packing thread, before the
        pack. Each consumer's event is opened once and kept until :meth:`close`.
        """
        import torch

        stream = torch.cuda.current_stream(self._index)
        for token in tokens:
            event = self._consumer_events.get(token)
            if event is None:
                try:
                    event = self._consumer_events[token] = _open_event(token, self._index)
                except RuntimeError as exc:
                    raise TransportError(
                        f"cannot open a consumer's CUDA IPC event for slot {slot} on "
                        f"cuda:{self._index}: {exc}"
                    ) from exc
            event.wait(stream)

    def allocate(self, slots: int, slot_bytes: int) -> None:
        """Allocate ``slots`` slots of at least ``slot_bytes`` each and share them.

        Keeps the current slots if they already have that count and size.
        """
        size = max(SLOT_ALIGNMENT, -(-slot_bytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT)
        if len(self._slots) == slots and self._slot_bytes == size:
            return
        self._free(release_cached=False)
        self._generation += 1
        self._slot_bytes = size
        try:
            for _ in range(slots):
                self._slots.append(self._new_slot(size))
        except BaseException:
            self._free(release_cached=self._release_cached)
            raise
        logger.debug("allocated %d CUDA IPC slots of %d bytes on cuda:%d", slots, size, self._index)

    def _new_slot(self, size: int) -> _Slot:
        import torch

        try:
            tensor = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", self._index))
            ipc_handle, storage_bytes, storage_offset = share_cuda_tensor(tensor)
            event: Any = None
            event_handle = b""
            if not self._host_sync:
                event, event_handle = interprocess_event(self._index)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            raise TransportError(
                f"cannot allocate a {size}-byte CUDA IPC slot on cuda:{self._index}: {exc}"
            ) from exc
        return _Slot(
            tensor=tensor,
            ipc_handle=ipc_handle,
            storage_bytes=storage_bytes,
            storage_offset=storage_offset,
            event=event,
            event_handle=event_handle,
        )

    def buffer(self, slot: int) -> torch.Tensor:
        """The flat ``uint8`` CUDA tensor of ``slot``."""
        return self._slots[slot].tensor

    def seal(self, slot: int) -> None:
        """Mark the end of the pack into ``slot``: consumers' reads are ordered after it."""
        import torch

        # The pack's copies were only enqueued on this thread's current stream (the
        # trainer packs and seals in the same thread). A consumer in another process
        # reads the slot on its own stream as soon as it gets the handle, and nothing
        # else orders that read after our writes (torch's IPC event covers only the
        # first share of the slot, not this pack into the reused slot). So record the
        # slot's interprocess event here, on the packing stream and before the handle
        # leaves the process; the consumer's stream waits for it before it copies
        # (CudaIpcImporter.open). The slot is packed again only after every consumer
        # acked, i.e. after they waited and their copies completed, so one event per
        # slot is enough. With host_sync, wait on the host instead: once the handle
        # leaves, the bytes are in device memory.
        stream = torch.cuda.current_stream(self._index)
        if self._host_sync:
            stream.synchronize()
        else:
            self._slots[slot].event.record(stream)

    def handle(self, slot: int, bucket: Bucket, device: DeviceId) -> CudaIpcHandle:
        """The handle of ``slot`` holding ``bucket``, for consumers on this GPU."""
        if device != self.device_id:
            raise TransportError(
                f"a CUDA IPC slot on {self.device_id} cannot serve device {device}: "
                "give the trainer source devices=[exporter.device_id]"
            )
        s = self._slots[slot]
        if bucket.nbytes > s.storage_bytes:
            raise TransportError(
                f"bucket {bucket.index} needs {bucket.nbytes} bytes, slot {slot} holds "
                f"{s.storage_bytes}"
            )
        return CudaIpcHandle(
            device=device,
            bucket=bucket.index,
            nbytes=bucket.nbytes,
            entries=bucket.entries,
            owner=self._owner,
            slot=slot,
            generation=self._generation,
            ipc_handle=s.ipc_handle,
            storage_bytes=s.storage_bytes,
            storage_offset=s.storage_offset,
            event_handle=s.event_handle,
            ordered=self._ordered,
        )

    def _free(self, *, release_cached: bool) -> None:
        import torch

        slots, self._slots = self._slots, []
        if not slots:
            return
        # Nothing enqueued by this process may still write into a slot we free.
        torch.cuda.current_stream(self._index).synchronize()
        slots.clear()  # the last references: the memory goes back to the allocator
        self._consumer_events.clear()
        _ipc_collect()
        if release_cached:
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Free every slot. Idempotent."""
        self._free(release_cached=self._release_cached)


@dataclass(slots=True)
class _Opened:
    """One mapped slot of a producer: the base tensor over the whole slot, its event."""

    generation: int
    ipc_handle: bytes
    index: int
    base: torch.Tensor | None
    event: Any  # the producer's torch.cuda.Event for this slot, opened here, or None
    copied: Any = None  # this process's interprocess event, recorded after its copies
    token: bytes = b""  # the IPC handle of ``copied``


def _rebuild(handle: CudaIpcHandle, index: int) -> torch.Tensor:
    """Open ``handle``'s allocation on local GPU ``index``: a flat ``uint8`` tensor."""
    import torch
    from torch.multiprocessing import reductions

    rebuild: Any = reductions.rebuild_cuda_tensor
    tensor: torch.Tensor = rebuild(
        torch.Tensor,
        torch.Size([handle.storage_bytes]),
        (1,),
        0,  # the tensor's offset in its storage
        torch.UntypedStorage,
        torch.uint8,
        index,  # the producer's device, remapped to this process's index by UUID
        handle.ipc_handle,
        handle.storage_bytes,
        handle.storage_offset,
        False,  # requires_grad
        _NO_REF_COUNTER,
        0,
        _NO_EVENT,
        False,  # event_sync_required: open() waits on the slot's own event instead
    )
    return tensor


def _open_event(event_handle: bytes, index: int) -> Any:
    """The producer's interprocess event of a slot, opened on local GPU ``index``."""
    import torch

    event_cls: Any = torch.cuda.Event
    return event_cls.from_ipc_handle(index, event_handle)


class CudaIpcImporter:
    """Worker-side mappings of CUDA IPC slots, one per producer slot, kept across pushes.

    :meth:`open` maps a slot the first time its handle arrives, on the GPU that has
    the handle's UUID in this process (``CUDA_VISIBLE_DEVICES`` may differ from the
    producer's), and returns the cached mapping afterwards. A handle of a new
    generation for a slot (the producer re-allocated) replaces the old mapping.
    Every ``open`` also makes this thread's stream wait for the slot's event (when
    the handle has one), so copies enqueued after it read the bucket the producer
    sealed.

    Resource handling: callers copy out of the returned tensor, call :meth:`finish`
    (which waits for those copies) and drop their slices before acknowledging.
    :meth:`close` drops every cached base, then runs ``torch.cuda.ipc_collect()``;
    at most ``max_cached`` slots stay mapped (least recently used go first).

    Error handling: a handle of another kind, for a GPU this process does not see,
    that cannot be opened, or too small for its bucket raises :class:`TransportError`
    before any byte is copied.
    """

    def __init__(self, max_cached: int = 1024) -> None:
        self._max = max_cached
        self._cache: OrderedDict[tuple[str, int], _Opened] = OrderedDict()
        self._running: set[int] = set()  # GPUs with copies that finish() left running

    def __len__(self) -> int:
        return len(self._cache)

    def __repr__(self) -> str:
        return f"<CudaIpcImporter mapped={len(self._cache)}>"

    def open(self, handle: Handle) -> torch.Tensor:
        """The flat ``uint8`` tensor over ``handle``'s slot, mapped once and cached."""
        import torch

        if not isinstance(handle, CudaIpcHandle):
            raise TransportError(f"cuda_ipc cannot open a {handle.kind!r} handle")
        key = (handle.owner, handle.slot)
        entry = self._cache.get(key)
        if entry is not None and (
            entry.generation != handle.generation or entry.ipc_handle != handle.ipc_handle
        ):
            self._drop(key)  # the producer re-allocated this slot
            entry = None
        if entry is None:
            index = cuda_index(handle.device.device)
            try:
                opened = _rebuild(handle, index)
                event = _open_event(handle.event_handle, index) if handle.event_handle else None
            except RuntimeError as exc:
                raise TransportError(
                    f"cannot open the CUDA IPC handle of bucket {handle.bucket} "
                    f"(slot {handle.slot} of {handle.owner}) on "
                    f"{normalize_uuid(handle.device.device)} (cuda:{index}): {exc}"
                ) from exc
            entry = self._cache[key] = _Opened(
                generation=handle.generation,
                ipc_handle=handle.ipc_handle,
                index=index,
                base=opened,
                event=event,
            )
            while len(self._cache) > self._max:
                self._drop(next(iter(self._cache)))
        else:
            self._cache.move_to_end(key)
        base = entry.base
        if base is None or base.numel() < handle.nbytes:
            raise TransportError(
                f"slot {handle.slot} of {handle.owner} holds {handle.storage_bytes} bytes, "
                f"bucket {handle.bucket} needs {handle.nbytes}"
            )
        if entry.event is not None:
            # Copies this thread enqueues from now on start after the producer's pack.
            entry.event.wait(torch.cuda.current_stream(entry.index))
        return base

    def finish(self, handle: Handle) -> bytes:
        """End this thread's copies out of ``handle``'s slot.

        For an ``ordered`` handle, record the slot's "copied" event after the copies and
        return its IPC handle: the producer's next pack into the slot waits for it on
        the GPU, and the ack may go at once. Otherwise wait for the copies on the host
        and return ``b""``.
        """
        import torch

        if not isinstance(handle, CudaIpcHandle):
            raise TransportError(f"cuda_ipc cannot finish a {handle.kind!r} handle")
        entry = self._cache.get((handle.owner, handle.slot))
        index = entry.index if entry is not None else cuda_index(handle.device.device)
        # A copy between devices runs on the source device's current stream and
        # synchronizes with the destination's, so the slot's device's stream covers
        # copies into parameters on any GPU.
        stream = torch.cuda.current_stream(index)
        if handle.ordered and entry is not None:
            if entry.copied is None:
                entry.copied, entry.token = interprocess_event(index)
            entry.copied.record(stream)
            self._running.add(index)
            return entry.token
        stream.synchronize()
        return b""

    def settle(self) -> None:
        """Wait for every copy that :meth:`finish` left running."""
        import torch

        running, self._running = self._running, set()
        for index in running:
            torch.cuda.current_stream(index).synchronize()

    def _drop(self, key: tuple[str, int]) -> None:
        entry = self._cache.pop(key, None)
        if entry is not None:
            if entry.copied is not None:
                self.settle()  # a copy may still read the slot
            entry.base = None  # unmaps once torch holds no other storage on it
            entry.event = None
            entry.copied = None

    def close(self) -> None:
        """Drop every mapping (bases), then collect torch's IPC bookkeeping. Idempotent."""
        import torch

        self.settle()
        for key in list(self._cache):
            self._drop(key)
        cuda: Any = torch.cuda
        if cuda.is_initialized():
            _ipc_collect()
