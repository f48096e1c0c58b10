"""Destinations: a worker's parameters in memory it exports, for a trainer to write in.

The direct-write path. A worker exports the memory its parameters live in once
(:func:`share_parameters`): on the CPU it moves them into one shared-memory segment
under ``/dev/shm`` that it creates (each parameter re-pointed at its place); on a GPU
it exports the storages of its own parameters by CUDA IPC, in place. It describes that
memory once as a :class:`Destinations` value: its regions (the segment's name, or
each storage's IPC handle) and each parameter's region, offset, shape and dtype. A
trainer source on the same node opens it (:func:`open_destinations`) and writes each
parameter straight into its place, one copy per byte, with no staging buffer and no
message per bucket.

Who may write when is the coordinator's protocol (see ``README.md``, "What happens in
a push"): the trainer writes a worker's memory only between that worker's
``begin_direct`` and its commit or abort, and the worker serves nothing from its
parameters meanwhile.

Lifetimes: the worker owns its memory. Its shared-memory segment keeps its name for
as long as the worker lives, so any trainer (a second coordinator, one after a
re-plan) can open it again; the worker unlinks it when it closes, and the local
backend's client unlinks it once it reaped a worker process that died (the memory
goes with the last mapping). The name has the library's form (the creating pid), so
the sweep of :mod:`asyncrefit.transport.shm` removes one whose creator died without
either. GPU parameters stay the worker's; the trainer's mappings of them are dropped
by :meth:`OpenedDestinations.close`.

torch is imported lazily: importing this module never initializes CUDA.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from .._device import DeviceId
from .._dtypes import dtype_name, torch_dtype
from .._exceptions import TransportError
from .shm import _Segment, _unlink, segment_name

if TYPE_CHECKING:
    import torch

#: How long a worker waits at a direct commit for the trainer's writes to run (seconds).
WRITES_TIMEOUT = 60.0
#: The longest pause between two looks at the trainer's completion event (seconds). The
#: commit arrives while the GPU still copies the push's tail, and every pause past the
#: event's completion delays the commit: pauses doubling up to 1 ms overshot it by up to
#: a millisecond (0.1 of a 7B push on an H100). A look costs a microsecond or two.
WRITES_POLL_MAX = 50e-6

#: Each parameter's place is aligned to this many bytes (a cache line; every dtype's size).
ALIGNMENT = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """One piece of memory a worker exported: ``nbytes`` long.

    On the CPU, the shared-memory segment ``segment``; on a GPU, the storage that
    starts ``storage_offset`` bytes into the CUDA allocation ``ipc_handle`` names.
    """

    nbytes: int
    segment: str = ""
    ipc_handle: bytes = b""
    storage_offset: int = 0


#: A block of a tensor: ``(start, stop)`` along each dimension.
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationEntry:
    """Where (a block of) one parameter lives: ``offset`` bytes into region ``region``.

    The place is contiguous unless ``strides`` (in elements) says otherwise. It holds
    the whole tensor ``name``, or with ``source_box`` the block of it that box names
    (its extents are ``shape``): an engine that fuses or shards tensors holds a
    checkpoint tensor as blocks of its own parameters. A name may have several
    entries (one tensor written to several places).
    """

    name: str
    region: int
    offset: int
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None = None
    source_box: Box | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize

    @property
    def extent(self) -> int:
        """The bytes from the place's first element to just past its last."""
        if self.strides is None or math.prod(self.shape) == 0:
            return self.nbytes
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return (last + 1) * torch_dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class Destinations:
    """A worker's parameters, as a trainer on its node can open and write them.

    ``kind`` is ``"shm"`` (one region: a shared-memory segment the worker created,
    its parameters moved into it) or ``"cuda_ipc"`` (the storages of the worker's own
    GPU parameters, in place, on the GPU ``device`` names by UUID: one region per
    storage). ``generation`` changes whenever the worker lays its parameters out
    anew, so a trainer re-opens them then.

    ``event`` (GPU only; may be empty) is the IPC handle of an interprocess CUDA event
    the worker made: a trainer that opened it records it on its stream after its last
    write of a push, and the worker waits for it before it commits that push
    (:meth:`SharedParameters.wait_for_writes`). The commit can then be sent while the
    writes still run, instead of after the trainer waited for them on the host.
    """

    kind: Literal["shm", "cuda_ipc"]
    device: DeviceId
    regions: tuple[Region, ...]
    entries: tuple[DestinationEntry, ...]
    generation: int = 0
    event: bytes = b""

    @property
    def nbytes(self) -> int:
        """The bytes of every parameter together."""
        return sum(e.nbytes for e in self.entries)

    def check(self) -> None:
        """Raise :class:`TransportError` if an entry lies outside its region or is
        misaligned for its dtype (a view there could not be made, or would reach past)."""
        for e in self.entries:
            size = torch_dtype(e.dtype).itemsize
            if any(n < 0 for n in e.shape):
                raise TransportError(f"destination of {e.name!r} has shape {list(e.shape)}")
            if e.strides is not None and (
                len(e.strides) != len(e.shape) or any(s < 0 for s in e.strides)
            ):
                raise TransportError(
                    f"destination of {e.name!r} has strides {list(e.strides)} "
                    f"for shape {list(e.shape)}"
                )
            if e.source_box is not None and (
                len(e.source_box) != len(e.shape)
                or any(
                    b - a != n or a < 0 for (a, b), n in zip(e.source_box, e.shape, strict=False)
                )
            ):
                raise TransportError(
                    f"destination of {e.name!r} takes block {list(e.source_box)}, "
                    f"which is not of its shape {list(e.shape)}"
                )
            if e.region == -1 and e.nbytes == 0:
                continue  # an empty tensor lives nowhere
            if not 0 <= e.region < len(self.regions):
                raise TransportError(f"destination of {e.name!r} names no region ({e.region})")
            region = self.regions[e.region].nbytes
            if e.offset < 0 or e.offset % size or e.offset + e.extent > region:
                raise TransportError(
                    f"destination of {e.name!r} ({e.dtype}{list(e.shape)} at byte {e.offset}) "
                    f"does not fit its region of {region} bytes"
                )


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[DestinationEntry, ...], int]:
    """The places of ``tensors`` in one region, each aligned: the entries and the size."""
    entries, offset = [], 0
    for name, t in tensors.items():
        entries.append(
            DestinationEntry(
                name=name, region=0, offset=offset, shape=tuple(t.shape), dtype=dtype_name(t.dtype)
            )
        )
        offset += -(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT
    return tuple(entries), max(1, offset)


def place(regions: Sequence[torch.Tensor], e: DestinationEntry) -> torch.Tensor:
    """The entry's place in its flat ``uint8`` region, shaped and of its dtype."""
    import torch

    dtype = torch_dtype(e.dtype)
    if e.region == -1:
        device = regions[0].device if regions else torch.device("cpu")
        return torch.empty(e.shape, dtype=dtype, device=device)
    raw = regions[e.region][e.offset : e.offset + e.extent].view(dtype)
    if e.strides is None:
        return raw.view(e.shape)
    return raw.as_strided(e.shape, e.strides)


def views(
    regions: Sequence[torch.Tensor], entries: tuple[DestinationEntry, ...]
) -> dict[str, torch.Tensor]:
    """Each entry's place by name (entries of whole, contiguous tensors: one each)."""
    return {e.name: place(regions, e) for e in entries}


class SharedParameters:
    """A worker's parameters exported for direct writes (made by
    :func:`share_parameters`): keep it for as long as the parameters live there.

    :meth:`close` unlinks a segment nobody unlinked yet and drops this side's
    reference to it; the parameters keep viewing it (the memory goes with the last
    view). GPU parameters stay the worker's own. Idempotent.
    """

    def __init__(self, destinations: Destinations, segment: Any = None, event: Any = None) -> None:
        self.destinations = destinations
        self._segment = segment
        self._event = event  # torch.cuda.Event(interprocess=True): destinations.event

    def wait_for_writes(self, timeout: float = WRITES_TIMEOUT) -> None:
        """Return once the trainer's writes of the push being committed ran: the last
        record of :attr:`Destinations.event` completed (nothing to wait for on the CPU,
        where writes are complete when the trainer's write call returns, or for an
        event never recorded).

        Polls, bounded by ``timeout`` seconds: the record of a trainer that died before
        it ran never completes, and this worker must then neither commit nor hang.
        Raises :class:`TransportError` when the time is up; the version stays
        uncommitted.
        """
        event = self._event
        if event is None or event.query():
            return
        deadline = time.monotonic() + timeout
        pause = 10e-6
        while not event.query():
            if time.monotonic() > deadline:
                raise TransportError(
                    f"the trainer's writes into this worker did not complete within {timeout} s "
                    "(a trainer that died with writes in flight): not committed"
                )
            time.sleep(pause)
            pause = min(pause * 2, WRITES_POLL_MAX)

    def __repr__(self) -> str:
        d = self.destinations
        return (
            f"<SharedParameters {d.kind} {d.device} {len(d.entries)} tensors "
            f"in {len(d.regions)} regions>"
        )

    def close(self) -> None:
        if self._segment is not None:
            _unlink(self._segment.name)
            self._segment.close()
            self._segment = None


def share_parameters(
    parameters: Mapping[str, torch.Tensor], device: DeviceId, *, generation: int = 0
) -> SharedParameters:
    """Export ``parameters`` for a trainer on this node to write directly.

    Every tensor must be on one device. On the CPU, they are moved into one
    shared-memory segment this process creates: each value is copied into its place
    and the tensor re-pointed there (``tensor.data = place``), so the module keeps its
    parameter objects. On a GPU they stay where they are (nothing is copied or
    allocated): each storage is exported by CUDA IPC, and ``device`` names the GPU
    by UUID; each tensor must then be contiguous.

    Raises :class:`TransportError` for tensors on several devices, on another kind of
    device, or not contiguous on a GPU, or when the segment cannot be allocated; the
    parameters are then unchanged.
    """
    import torch

    devices = {t.device for t in parameters.values()}
    if len(devices) > 1:
        raise TransportError(
            f"parameters on several devices ({sorted(map(str, devices))}) cannot be shared"
        )
    where = next(iter(devices), torch.device("cpu"))
    if where.type == "cuda":
        from .cuda_ipc import interprocess_event

        event, handle = interprocess_event(where.index if where.index is not None else 0)
        shared = replace(_share_cuda(parameters, device, generation), event=handle)
        return SharedParameters(shared, event=event)
    if where.type != "cpu":
        raise TransportError(f"parameters on {where} cannot be shared for direct writes")
    entries, nbytes = layout(parameters)
    segment = _Segment.create(segment_name(secrets.token_hex(4), generation, 0), nbytes)
    assert segment.tensor is not None
    places = views([segment.tensor], entries)
    with torch.no_grad():
        for name, t in parameters.items():
            places[name].copy_(t)
        for name, t in parameters.items():
            t.data = places[name]
    region = Region(nbytes=nbytes, segment=segment.name)
    shared = Destinations(
        kind="shm", device=device, regions=(region,), entries=entries, generation=generation
    )
    return SharedParameters(shared, segment)


def _share_cuda(
    parameters: Mapping[str, torch.Tensor], device: DeviceId, generation: int
) -> Destinations:
    from .cuda_ipc import share_cuda_tensor

    regions: list[Region] = []
    index: dict[int, int] = {}  # a storage's address -> its region
    entries = []
    for name, t in parameters.items():
        if not t.is_contiguous():
            raise TransportError(f"parameter {name!r} is not contiguous: it cannot be shared")
        if t.numel() == 0:  # no memory to share: no region
            entries.append(
                DestinationEntry(
                    name=name, region=-1, offset=0, shape=tuple(t.shape), dtype=dtype_name(t.dtype)
                )
            )
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            ipc_handle, storage_bytes, storage_offset = share_cuda_tensor(t)
            index[key] = len(regions)
            regions.append(
                Region(nbytes=storage_bytes, ipc_handle=ipc_handle, storage_offset=storage_offset)
            )
        entries.append(
            DestinationEntry(
                name=name,
                region=index[key],
                offset=int(t.storage_offset()) * t.element_size(),
                shape=tuple(t.shape),
                dtype=dtype_name(t.dtype),
            )
        )
    return Destinations(
        kind="cuda_ipc",
        device=device,
        regions=tuple(regions),
        entries=tuple(entries),
        generation=generation,
    )


class OpenedDestinations:
    """A worker's regions as the trainer mapped them: ``places`` by tensor name.

    Each name has one or more places, each with the block of the tensor it holds
    (``None``: all of it). :meth:`close` drops the views and the mappings
    (idempotent); the worker's parameters are not affected.
    """

    def __init__(self, destinations: Destinations, regions: Sequence[torch.Tensor]) -> None:
        self.destinations = destinations
        self.places: dict[str, list[tuple[torch.Tensor, Box | None]]] = {}
        for e in destinations.entries:
            self.places.setdefault(e.name, []).append((place(regions, e), e.source_box))
        self.device = regions[0].device if regions else None
        # The worker's completion event, opened here (None: the writes are waited for).
        self.event: Any = None
        if destinations.event and self.device is not None and self.device.type == "cuda":
            from .cuda_ipc import _open_event

            self.event = _open_event(destinations.event, self.device.index or 0)

    def mark(self) -> bool:
        """Record the worker's completion event on this thread's stream of the device
        (after the writes issued on it); ``False`` if there is none to record."""
        if self.event is None:
            return False
        import torch

        self.event.record(torch.cuda.current_stream(self.device))
        return True

    def close(self) -> None:
        self.places = {}
        self.event = None


def unlink_segments(destinations: Destinations) -> None:
    """Unlink the shared-memory segments of ``destinations`` (their owner is gone)."""
    for region in destinations.regions:
        if region.segment:
            _unlink(region.segment)


def open_destinations(destinations: Destinations) -> OpenedDestinations:
    """Map a worker's regions in this process (the trainer's side of a direct write).

    The entries are checked to lie inside their regions first. Raises
    :class:`TransportError` when a region
    cannot be opened here (another machine's segment, a GPU this process does not
    see) or an entry does not fit.
    """
    destinations.check()
    if destinations.kind == "shm":
        regions = []
        for region in destinations.regions:
            segment = _Segment.open(region.segment)
            assert segment.tensor is not None
            if segment.tensor.numel() < region.nbytes:
                raise TransportError(
                    f"segment {region.segment!r} holds {segment.tensor.numel()} bytes, "
                    f"not the {region.nbytes} its destinations say"
                )
            regions.append(segment.tensor[: region.nbytes])
        return OpenedDestinations(destinations, regions)
    if destinations.kind == "cuda_ipc":
        return OpenedDestinations(destinations, _open_cuda(destinations))
    raise TransportError(f"unknown kind of destinations {destinations.kind!r}")


def _open_cuda(destinations: Destinations) -> list[torch.Tensor]:
    import torch
    from torch.multiprocessing import reductions

    from .._cuda import cuda_index
    from .cuda_ipc import _NO_EVENT, _NO_REF_COUNTER

    index = cuda_index(destinations.device.device)
    rebuild: Any = reductions.rebuild_cuda_tensor
    opened = []
    for region in destinations.regions:
        try:
            tensor: torch.Tensor = rebuild(
                torch.Tensor,
                torch.Size([region.nbytes]),
                (1,),
                0,
                torch.UntypedStorage,
                torch.uint8,
                index,
                region.ipc_handle,
                region.nbytes,
                region.storage_offset,
                False,
                _NO_REF_COUNTER,
                0,
                _NO_EVENT,
                False,
            )
        except Exception as exc:
            raise TransportError(
                f"cannot open the CUDA destinations on {destinations.device}: {exc}"
            ) from exc
        opened.append(tensor)
    return opened
