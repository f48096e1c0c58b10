"""Transports: how a packed bucket travels from the trainer to a worker."""

from ._base import Exporter as Exporter
from ._base import Handle as Handle
from ._base import Importer as Importer
from ._base import make_importer as make_importer
from .shm import SharedMemoryExporter as SharedMemoryExporter
from .shm import SharedMemoryImporter as SharedMemoryImporter
from .shm import ShmHandle as ShmHandle

__all__ = (
    "Exporter",
    "Handle",
    "Importer",
    "SharedMemoryExporter",
    "SharedMemoryImporter",
    "ShmHandle",
    "make_importer",
)
