"""Destinations: a worker's parameters in memory it exports, for a trainer to write in.

The direct-write path. A worker that keeps its parameters in memory it can share
lays them out once in one region it allocates itself (a shared-memory segment under
``/dev/shm`` on the CPU, one CUDA allocation shared by CUDA IPC on a GPU), re-points
every parameter at its place there (:func:`share_parameters`), and describes the
region once as a :class:`Destinations` value: the region's name or IPC handle, and
each parameter's offset, shape and dtype. A trainer source on the same node opens it
(:func:`open_destinations`) and writes each parameter straight into its place, one
copy per byte, with no staging buffer and no message per bucket.

Who may write when is the coordinator's protocol (see ``README.md``, "What happens in
a push"): the trainer writes a worker's region only between that worker's
``begin_direct`` and its commit or abort, and the worker serves nothing from its
parameters meanwhile.

Lifetimes: the worker owns the region. A shared-memory segment is unlinked by the
first side that has mapped it (the trainer right after opening it, or the worker when
it closes), so a killed process leaves no name under ``/dev/shm``: the memory goes
with the last mapping. Its name has the library's form (the creating pid), so the
sweep of :mod:`asyncrefit.transport.shm` removes one whose creator died before anyone
opened it. A CUDA region is freed by the worker when it closes; the trainer's mapping
is dropped by :meth:`OpenedDestinations.close`.

torch is imported lazily: importing this module never initializes CUDA.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._device import DeviceId
from .._dtypes import dtype_name, torch_dtype
from .._exceptions import TransportError
from .shm import _Segment, _unlink, segment_name

if TYPE_CHECKING:
    import torch

#: Each parameter's place is aligned to this many bytes (a cache line; every dtype's size).
ALIGNMENT = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationEntry:
    """Where one parameter lives in a region: ``offset`` bytes in, contiguous."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class Destinations:
    """A worker's parameters, as a trainer on its node can open and write them.

    ``kind`` is ``"shm"`` (``segment`` names a shared-memory segment) or
    ``"cuda_ipc"`` (``ipc_handle`` names a CUDA allocation on the GPU ``device``
    names by UUID; the region starts ``storage_offset`` bytes into it). ``nbytes`` is
    the region's size; ``generation`` changes whenever the worker lays its
    parameters out anew, so a trainer re-opens it then.
    """

    kind: Literal["shm", "cuda_ipc"]
    device: DeviceId
    nbytes: int
    entries: tuple[DestinationEntry, ...]
    generation: int = 0
    segment: str = ""
    ipc_handle: bytes = b""
    storage_offset: int = 0

    def check(self) -> None:
        """Raise :class:`TransportError` if an entry lies outside the region or is
        misaligned for its dtype (a view there could not be made, or would read past)."""
        for e in self.entries:
            size = torch_dtype(e.dtype).itemsize
            if e.offset < 0 or e.offset % size or e.offset + e.nbytes > self.nbytes:
                raise TransportError(
                    f"destination of {e.name!r} ({e.dtype}{list(e.shape)} at byte {e.offset}) "
                    f"does not fit a region of {self.nbytes} bytes"
                )


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[DestinationEntry, ...], int]:
    """The places of ``tensors`` in one region, each aligned: the entries and the size."""
    entries, offset = [], 0
    for name, t in tensors.items():
        entries.append(
            DestinationEntry(
                name=name, offset=offset, shape=tuple(t.shape), dtype=dtype_name(t.dtype)
            )
        )
        offset += -(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT
    return tuple(entries), max(1, offset)


def views(region: torch.Tensor, entries: tuple[DestinationEntry, ...]) -> dict[str, torch.Tensor]:
    """Each entry's place in the flat ``uint8`` ``region``, shaped and of its dtype."""
    return {
        e.name: region[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape)
        for e in entries
    }


class SharedParameters:
    """A worker's parameters moved into one region it exported (made by
    :func:`share_parameters`): keep it for as long as the parameters live there.

    :meth:`close` unlinks a segment nobody unlinked yet and drops this side's
    reference to the region; the parameters keep viewing it (the memory goes with
    the last view). Idempotent.
    """

    def __init__(self, destinations: Destinations, region: torch.Tensor, segment: Any) -> None:
        self.destinations = destinations
        self._region: torch.Tensor | None = region
        self._segment = segment

    def __repr__(self) -> str:
        d = self.destinations
        return f"<SharedParameters {d.kind} {d.device} {len(d.entries)} tensors {d.nbytes} B>"

    def close(self) -> None:
        if self._segment is not None:
            _unlink(self._segment.name)
            self._segment.close()
            self._segment = None
        self._region = None


def share_parameters(
    parameters: Mapping[str, torch.Tensor], device: DeviceId, *, generation: int = 0
) -> SharedParameters:
    """Move ``parameters`` into one region this process allocates and exports.

    Each tensor's value is copied into its place and the tensor re-pointed there
    (``tensor.data = place``): the module keeps its parameter objects, now viewing the
    region. Every tensor must be on one device: the CPU (a shared-memory segment) or
    one GPU (a CUDA allocation, shared by CUDA IPC; ``device`` then names it by UUID).

    Raises :class:`TransportError` for tensors on several devices or on another kind
    of device, or when the region cannot be allocated; the parameters are then
    unchanged.
    """
    import torch

    devices = {t.device for t in parameters.values()}
    if len(devices) > 1:
        raise TransportError(
            f"parameters on several devices ({sorted(map(str, devices))}) cannot share one region"
        )
    where = next(iter(devices), torch.device("cpu"))
    entries, nbytes = layout(parameters)
    segment = None
    if where.type == "cpu":
        segment = _Segment.create(segment_name(secrets.token_hex(4), generation, 0), nbytes)
        assert segment.tensor is not None
        region = segment.tensor
        exported: dict[str, Any] = {"kind": "shm", "segment": segment.name}
    elif where.type == "cuda":
        from .cuda_ipc import share_cuda_tensor

        region = torch.empty(nbytes, dtype=torch.uint8, device=where)
        ipc_handle, _storage_bytes, storage_offset = share_cuda_tensor(region)
        exported = {"kind": "cuda_ipc", "ipc_handle": ipc_handle, "storage_offset": storage_offset}
    else:
        raise TransportError(f"parameters on {where} cannot be shared for direct writes")
    places = views(region, entries)
    with torch.no_grad():
        for name, t in parameters.items():
            places[name].copy_(t)
        for name, t in parameters.items():
            t.data = places[name]
    destinations = Destinations(
        device=device, nbytes=nbytes, entries=entries, generation=generation, **exported
    )
    return SharedParameters(destinations, region, segment)


class OpenedDestinations:
    """A worker's region as the trainer mapped it: ``views`` by parameter name.

    :meth:`close` drops the views and the mapping (idempotent); the worker's
    parameters are not affected.
    """

    def __init__(self, destinations: Destinations, region: torch.Tensor) -> None:
        self.destinations = destinations
        self.views: dict[str, torch.Tensor] = views(region, destinations.entries)
        self.device = region.device

    def close(self) -> None:
        self.views = {}


def open_destinations(destinations: Destinations) -> OpenedDestinations:
    """Map a worker's region in this process (the trainer's side of a direct write).

    The entries are checked to lie inside the region first. A shared-memory segment
    is unlinked right after it is mapped. Raises :class:`TransportError` when the
    region cannot be opened here (another machine's segment, a GPU this process does
    not see) or an entry does not fit.
    """
    destinations.check()
    if destinations.kind == "shm":
        segment = _Segment.open(destinations.segment)
        _unlink(segment.name)  # both sides mapped it: no name is left behind
        region = segment.tensor
        assert region is not None
        if region.numel() < destinations.nbytes:
            raise TransportError(
                f"segment {destinations.segment!r} holds {region.numel()} bytes, "
                f"not the {destinations.nbytes} its destinations say"
            )
        return OpenedDestinations(destinations, region[: destinations.nbytes])
    if destinations.kind == "cuda_ipc":
        return OpenedDestinations(destinations, _open_cuda(destinations))
    raise TransportError(f"unknown kind of destinations {destinations.kind!r}")


def _open_cuda(destinations: Destinations) -> torch.Tensor:
    import torch
    from torch.multiprocessing import reductions

    from .._cuda import cuda_index
    from .cuda_ipc import _NO_EVENT, _NO_REF_COUNTER

    index = cuda_index(destinations.device.device)
    rebuild: Any = reductions.rebuild_cuda_tensor
    try:
        tensor: torch.Tensor = rebuild(
            torch.Tensor,
            torch.Size([destinations.nbytes]),
            (1,),
            0,
            torch.UntypedStorage,
            torch.uint8,
            index,
            destinations.ipc_handle,
            destinations.nbytes,
            destinations.storage_offset,
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
    return tensor
