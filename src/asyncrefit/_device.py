"""Device identity: where a buffer lives and who may open its handle."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from functools import cache

from ._wire._pickling import FastPickle


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class DeviceId(FastPickle):
    """A device, named by the node it is on and its id on that node.

    A handle opened on one device is valid only for consumers on the same
    ``(node, device)``. On the CPU ``device`` may be a virtual name (``"cpu:3"``),
    which lets one machine stand in for many devices. On a GPU it is the GPU's UUID,
    never its index: processes may see different ``CUDA_VISIBLE_DEVICES``.
    """

    node: str
    device: str

    def __str__(self) -> str:
        return f"{self.node}/{self.device}"


@cache
def local_node_id() -> str:
    """This machine's node id: its host name."""
    return socket.gethostname()


def cpu_device(index: int | str = 0, *, node: str | None = None) -> DeviceId:
    """A (virtual) CPU device on ``node`` (this machine by default)."""
    name = index if isinstance(index, str) else f"cpu:{index}"
    return DeviceId(node=node if node is not None else local_node_id(), device=name)
