"""GPU identity: a CUDA device is named by its UUID, never by its index.

Two processes may see the same GPU under different indices (``CUDA_VISIBLE_DEVICES``
differs, or lists GPUs in another order), so a :class:`~asyncrefit.DeviceId` of a GPU
carries its UUID (``"GPU-8f2c..."``) and each process maps it back to the index it
sees with :func:`cuda_index`.

Everything here imports torch lazily, so that importing asyncrefit never touches
CUDA; the functions that read UUIDs initialize CUDA in the calling process.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING

from ._device import DeviceId, local_node_id
from ._exceptions import TransportError

if TYPE_CHECKING:
    import torch

_PREFIXES = ("GPU-", "MIG-")


def normalize_uuid(uuid: str) -> str:
    """The canonical form of a GPU UUID: ``"GPU-"`` prefix, lower-case hex digits.

    torch reports a UUID without prefix and NVML with ``"GPU-"`` (``"MIG-"`` for a
    MIG instance); both forms of the same GPU normalize to the same string.
    """
    text = uuid.strip()
    for prefix in _PREFIXES:
        if text[: len(prefix)].upper() == prefix:
            return prefix + text[len(prefix) :].lower()
    return "GPU-" + text.lower()


def index_of_uuid(uuid: str, visible: Sequence[str]) -> int:
    """The index, among ``visible`` UUIDs (this process's GPUs in order), of ``uuid``.

    Raises :class:`TransportError` naming the visible GPUs if ``uuid`` is not one of
    them (the GPU is hidden from this process, or on another machine).
    """
    wanted = normalize_uuid(uuid)
    for index, candidate in enumerate(visible):
        if normalize_uuid(candidate) == wanted:
            return index
    seen = ", ".join(f"{i}: {normalize_uuid(u)}" for i, u in enumerate(visible)) or "none"
    raise TransportError(f"GPU {wanted} is not visible to this process (visible: {seen})")


@cache
def visible_gpu_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, by index (empty without CUDA).

    Cached: the set of visible GPUs of a process is fixed once CUDA is initialized.
    """
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(
        normalize_uuid(str(torch.cuda.get_device_properties(i).uuid))
        for i in range(torch.cuda.device_count())
    )


def gpu_uuid(index: int | None = None) -> str:
    """The UUID of GPU ``index`` as this process sees it (default: the current one).

    Raises :class:`TransportError` if CUDA is unavailable or there is no such GPU.
    """
    import torch

    uuids = visible_gpu_uuids()
    if not uuids:
        raise TransportError("CUDA is not available in this process")
    if index is None:
        index = torch.cuda.current_device()
    if not 0 <= index < len(uuids):
        raise TransportError(f"no GPU {index}: this process sees {len(uuids)}")
    return uuids[index]


def cuda_index(uuid: str) -> int:
    """The index under which this process sees the GPU ``uuid``.

    Raises :class:`TransportError` if this process does not see that GPU.
    """
    return index_of_uuid(uuid, visible_gpu_uuids())


def cuda_device(index: int | None = None, *, node: str | None = None) -> DeviceId:
    """The :class:`~asyncrefit.DeviceId` of GPU ``index`` of this process: its UUID.

    ``index`` is this process's index (default: the current device); the id names
    the GPU by UUID, so another process with other ``CUDA_VISIBLE_DEVICES`` finds the
    same GPU with :func:`cuda_index`. ``node`` defaults to this machine.
    """
    return DeviceId(node=node if node is not None else local_node_id(), device=gpu_uuid(index))


def device_index(device: int | str | torch.device | None, *, transport: str) -> int:
    """This process's index of a CUDA ``device`` (an index, ``"cuda:1"``, a ``torch.device``).

    ``None``, or ``"cuda"`` without an index, is the calling thread's current device:
    resolve it on the thread that selected the device (the training loop's), not on a
    transport thread, whose current device is ``cuda:0``. Raises
    :class:`TransportError` naming ``transport`` for a device that is not a GPU.
    """
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise TransportError(f"the {transport} transport needs a CUDA device, not {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()
