"""The embedded default: worker subprocesses with their own event loops."""

from ._client import LocalWorker as LocalWorker
from ._client import spawn_local_workers as spawn_local_workers
from ._faults import WorkerFaults as WorkerFaults

__all__ = ("LocalWorker", "WorkerFaults", "spawn_local_workers")
