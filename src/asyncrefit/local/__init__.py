"""The embedded default: worker subprocesses with their own event loops."""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._client import LocalWorker as LocalWorker
from ._client import spawn_local_workers as spawn_local_workers

__all__ = ("LocalWorker", "spawn_local_workers")


if not _TYPE_CHECKING:
    # Not seen by type checkers: a moved name is an error there, not Any.

    def __getattr__(name: str) -> _Any:
        if name == "WorkerFaults":
            import warnings

            from ._faults import WorkerFaults

            warnings.warn(
                "asyncrefit.local.WorkerFaults is test-only and moved to "
                "asyncrefit.local._faults; the old name goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return WorkerFaults
        raise AttributeError(f"module 'asyncrefit.local' has no attribute {name!r}")
