"""asyncrefit: push freshly trained weights into LLM inference workers, awaited.

What a user writes is exported here; :mod:`asyncrefit.abc` holds the protocols a backend
implements, :mod:`asyncrefit.planning` the planner for advanced use, and the backends
live in :mod:`asyncrefit.local` (worker processes, the embedded default),
:mod:`asyncrefit.ray`, :mod:`asyncrefit.vllm`, :mod:`asyncrefit.trainer` (sharded and
converting trainer sources) and :mod:`asyncrefit.transport` (how a bucket travels).

Reading order for the source (every underscored module is private):

1. ``_core/``: the coordinator side. ``_coordinator`` (lifecycle, membership,
   re-planning, settling) runs one ``_push.Push`` per push, whose ``_recorder`` keeps
   its timing, events and report; the pure state machines ``_ledger`` (who is in, who
   holds which slot) and ``_slots``; ``_topology`` and ``_plan`` (which source serves
   which worker, which bytes go in which bucket) and ``_budget`` (the memory budget).
2. ``_worker/``: the worker side, once for every backend. ``_endpoint`` answers the
   coordinator's requests over a sink (``_receiver``: a module's own tensors), checks
   every handle (``_layout``) and keeps the worker's weight versions (``_state``).
3. ``_wire/``: how the two sides talk, bottom-up: framing (``_channel``, and the
   blocking ``_framing`` of processes without an event loop), the codec and its
   vocabulary (``_messages``, ``_refs``, ``_pickling``), the multiplexer (``_mux``),
   the error map and the serve loop.
4. ``_protocols`` (re-exported by :mod:`asyncrefit.abc`) and ``_exceptions`` (every
   error, all exported here); then the backends, each only its lifecycle code.
"""

import warnings as _warnings
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._checksum import checksum as checksum
from ._core._adapters import register_adapter as register_adapter
from ._core._budget import BudgetStatistics as BudgetStatistics
from ._core._coordinator import RefitCoordinator as RefitCoordinator
from ._core._plan import ParamSpec as ParamSpec
from ._core._report import RefitReport as RefitReport
from ._core._report import StageTimes as StageTimes
from ._device import DeviceId as DeviceId
from ._device import cpu_device as cpu_device
from ._device import local_node_id as local_node_id
from ._exceptions import AsyncRefitError as AsyncRefitError
from ._exceptions import AwaitableReturnedError as AwaitableReturnedError
from ._exceptions import BudgetTooSmallError as BudgetTooSmallError
from ._exceptions import CapacityExceededError as CapacityExceededError
from ._exceptions import ChannelFailedError as ChannelFailedError
from ._exceptions import ClosedError as ClosedError
from ._exceptions import ConversionError as ConversionError
from ._exceptions import DiscoveryError as DiscoveryError
from ._exceptions import DuplicateWorkerError as DuplicateWorkerError
from ._exceptions import EngineConfigError as EngineConfigError
from ._exceptions import EngineLoopError as EngineLoopError
from ._exceptions import GatherError as GatherError
from ._exceptions import IntegrityError as IntegrityError
from ._exceptions import PackError as PackError
from ._exceptions import ParameterMismatchError as ParameterMismatchError
from ._exceptions import PeerWorkerError as PeerWorkerError
from ._exceptions import PlanError as PlanError
from ._exceptions import PushError as PushError
from ._exceptions import SessionError as SessionError
from ._exceptions import SourceDiedError as SourceDiedError
from ._exceptions import SourceError as SourceError
from ._exceptions import SourceRemoteError as SourceRemoteError
from ._exceptions import SourceTimeoutError as SourceTimeoutError
from ._exceptions import StaleWeightsError as StaleWeightsError
from ._exceptions import TransportError as TransportError
from ._exceptions import UnknownDeviceError as UnknownDeviceError
from ._exceptions import UnknownHandleError as UnknownHandleError
from ._exceptions import UnknownWorkerError as UnknownWorkerError
from ._exceptions import UpdateStateError as UpdateStateError
from ._exceptions import VersionError as VersionError
from ._exceptions import WorkerDiedError as WorkerDiedError
from ._exceptions import WorkerError as WorkerError
from ._exceptions import WorkerIntegrityError as WorkerIntegrityError
from ._exceptions import WorkerProtocolError as WorkerProtocolError
from ._exceptions import WorkerRemoteError as WorkerRemoteError
from ._exceptions import WorkerStaleWeightsError as WorkerStaleWeightsError
from ._exceptions import WorkerTimeoutError as WorkerTimeoutError
from ._names import WRAPPER_PREFIXES as WRAPPER_PREFIXES
from ._names import NameMap as NameMap
from ._names import strip_wrappers as strip_wrappers
from ._public import fix_modules as _fix_modules
from ._worker._receiver import ParameterReceiver as ParameterReceiver
from .trainer._local import LocalTrainer as LocalTrainer
from .trainer._shared import SharedParameterTrainer as SharedParameterTrainer

__version__ = "0.1.0"

__all__ = (
    "AsyncRefitError",
    "AwaitableReturnedError",
    "BudgetStatistics",
    "BudgetTooSmallError",
    "CapacityExceededError",
    "ChannelFailedError",
    "ClosedError",
    "ConversionError",
    "DeviceId",
    "DiscoveryError",
    "DuplicateWorkerError",
    "EngineConfigError",
    "EngineLoopError",
    "GatherError",
    "IntegrityError",
    "LocalTrainer",
    "NameMap",
    "PackError",
    "ParamSpec",
    "ParameterMismatchError",
    "ParameterReceiver",
    "PeerWorkerError",
    "PlanError",
    "PushError",
    "RefitCoordinator",
    "RefitReport",
    "SessionError",
    "SharedParameterTrainer",
    "SourceDiedError",
    "SourceError",
    "SourceRemoteError",
    "SourceTimeoutError",
    "StageTimes",
    "StaleWeightsError",
    "TransportError",
    "UnknownDeviceError",
    "UnknownHandleError",
    "UnknownWorkerError",
    "UpdateStateError",
    "VersionError",
    "WRAPPER_PREFIXES",
    "WorkerDiedError",
    "WorkerError",
    "WorkerIntegrityError",
    "WorkerProtocolError",
    "WorkerRemoteError",
    "WorkerStaleWeightsError",
    "WorkerTimeoutError",
    "checksum",
    "cpu_device",
    "local_node_id",
    "register_adapter",
    "strip_wrappers",
)

#: Names this package exported before 0.2, and where they live now: importing them from
#: here still works, with a DeprecationWarning, for one release.
_MOVED = {
    "Bucket": "asyncrefit.planning",
    "ByteBudget": "asyncrefit.planning",
    "Plan": "asyncrefit.planning",
    "TensorEntry": "asyncrefit.planning",
    "VersionState": "asyncrefit.planning",
    "plan_buckets": "asyncrefit.planning",
    "validate_worker": "asyncrefit.planning",
    "BucketAck": "asyncrefit.abc",
    "SourceInfo": "asyncrefit.abc",
    "TrainerSource": "asyncrefit.abc",
    "TransmittingSource": "asyncrefit.abc",
    "Worker": "asyncrefit.abc",
}


if not _TYPE_CHECKING:
    # Not seen by type checkers: a moved name is an error there, not Any.

    def __getattr__(name: str) -> _Any:
        module = _MOVED.get(name)
        if module is None:
            raise AttributeError(f"module 'asyncrefit' has no attribute {name!r}")
        import importlib

        _warnings.warn(
            f"asyncrefit.{name} moved to {module}.{name}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)


_fix_modules(globals(), __all__)
