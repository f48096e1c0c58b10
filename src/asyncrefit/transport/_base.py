"""What every transport provides: handles, an exporter (trainer) and an importer (worker)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from .._core._plan import TensorEntry
from .._device import DeviceId
from .._dtypes import dtype_name as dtype_name
from .._dtypes import torch_dtype as torch_dtype
from .._wire._pickling import FastPickle

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket


@dataclass(frozen=True, slots=True, kw_only=True)
class Handle(FastPickle):
    """A small record naming one exported bucket buffer on one device.

    Subclasses add what their transport needs to open the buffer (a shared-memory
    segment's name, a CUDA IPC handle). A handle never carries tensor data.
    ``checksum``, when set (``verify=True``), is the CRC-32 of the entries' bytes in
    order (see :func:`asyncrefit.checksum`); the worker recomputes it over its copy.
    ``ordered`` says that the producer orders its next write into this buffer after
    the token the consumer's :meth:`Importer.finish` returns (it comes back in the
    ack): the consumer may then ack once its copies are enqueued, before they ran.
    """

    kind: ClassVar[str] = "abstract"
    device: DeviceId
    bucket: int
    nbytes: int
    entries: tuple[TensorEntry, ...]
    checksum: int | None = None
    ordered: bool = False


class Exporter(Protocol):
    """The trainer side of a transport: reusable slots that buckets are packed into."""

    kind: str

    def allocate(self, slots: int, slot_bytes: int) -> None:
        """Make ``slots`` buffers of ``slot_bytes`` each, reusing what fits."""

    def buffer(self, slot: int) -> torch.Tensor:
        """The flat ``uint8`` tensor of ``slot``, to pack a bucket into."""

    def seal(self, slot: int) -> None:
        """Called after packing: the bytes must be visible to consumers on return."""

    def handle(self, slot: int, bucket: Bucket, device: DeviceId) -> Handle:
        """A handle for ``slot`` holding ``bucket``, for consumers on ``device``."""

    def close(self) -> None:
        """Free every slot. Idempotent."""


class Importer(Protocol):
    """The worker side of a transport: opens handles (cached) into flat tensors."""

    def open(self, handle: Handle) -> torch.Tensor:
        """A flat ``uint8`` view of the handle's buffer; cached across calls."""

    def finish(self, handle: Handle) -> bytes:
        """Called after the copies out of the view.

        Returns ``b""`` once the copies are complete; for an ``ordered`` handle it may
        instead return a token (a CUDA interprocess event's handle, recorded after the
        copies) that the producer waits for before it writes the buffer again. Copies
        left running that way are waited for by :meth:`settle`.
        """

    def settle(self) -> None:
        """Wait until every copy that :meth:`finish` left running is complete."""

    def close(self) -> None:
        """Drop every cached view and mapping. Idempotent."""


#: Importer classes by handle kind, as ``(module, class name)``: imported on first use so
#: that a transport's heavy dependencies load only where its handles arrive.
IMPORTERS: dict[str, tuple[str, str]] = {
    "shm": ("asyncrefit.transport.shm", "SharedMemoryImporter"),
    "cuda_ipc": ("asyncrefit.transport.cuda_ipc", "CudaIpcImporter"),
    "collective": ("asyncrefit.transport.collective", "CollectiveImporter"),
}


def make_importer(kind: str) -> Importer:
    """A new importer for handles of ``kind``; raises ``TransportError`` if unknown."""
    import importlib

    from .._exceptions import TransportError

    try:
        module_name, class_name = IMPORTERS[kind]
    except KeyError:
        raise TransportError(f"no transport can open {kind!r} handles") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    importer: Importer = cls()
    return importer


@runtime_checkable
class OrderingExporter(Exporter, Protocol):
    """An exporter whose repack of a slot can wait for the consumers on the device.

    ``ordered`` (off by default) marks its handles ``ordered``: a consumer then acks
    once its copies are enqueued, returning a token from :meth:`Importer.finish`.
    :meth:`order_after` makes the packing thread's stream wait for those tokens; the
    owner of the exporter must pass it every consumer's token for a slot before it
    packs the slot again, or leave ``ordered`` off.
    """

    ordered: bool

    def order_after(self, slot: int, tokens: Sequence[bytes]) -> None: ...
