"""asyncrefit: push freshly trained weights into LLM inference workers, awaited.

The public API is re-exported here; everything in underscored modules is private.
"""

import warnings as _warnings

with _warnings.catch_warnings():
    # torch warns once per process when numpy is missing; numpy is not a dependency of
    # asyncrefit, so its absence is not worth a warning in every worker process.
    _warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch as _torch  # noqa: F401

from ._adapters import register_adapter as register_adapter
from ._budget import BudgetStatistics as BudgetStatistics
from ._budget import ByteBudget as ByteBudget
from ._checksum import checksum as checksum
from ._coordinator import RefitCoordinator as RefitCoordinator
from ._device import DeviceId as DeviceId
from ._device import cpu_device as cpu_device
from ._device import local_node_id as local_node_id
from ._exceptions import AsyncRefitError as AsyncRefitError
from ._exceptions import BudgetTooSmallError as BudgetTooSmallError
from ._exceptions import CapacityExceededError as CapacityExceededError
from ._exceptions import ClosedError as ClosedError
from ._exceptions import ConversionError as ConversionError
from ._exceptions import DiscoveryError as DiscoveryError
from ._exceptions import DuplicateWorkerError as DuplicateWorkerError
from ._exceptions import IntegrityError as IntegrityError
from ._exceptions import PackError as PackError
from ._exceptions import ParameterMismatchError as ParameterMismatchError
from ._exceptions import PeerWorkerError as PeerWorkerError
from ._exceptions import PlanError as PlanError
from ._exceptions import PushError as PushError
from ._exceptions import SourceDiedError as SourceDiedError
from ._exceptions import SourceError as SourceError
from ._exceptions import SourceRemoteError as SourceRemoteError
from ._exceptions import SourceTimeoutError as SourceTimeoutError
from ._exceptions import StaleWeightsError as StaleWeightsError
from ._exceptions import TransportError as TransportError
from ._exceptions import UnknownDeviceError as UnknownDeviceError
from ._exceptions import UnknownWorkerError as UnknownWorkerError
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
from ._plan import Bucket as Bucket
from ._plan import ParamSpec as ParamSpec
from ._plan import Plan as Plan
from ._plan import TensorEntry as TensorEntry
from ._plan import plan_buckets as plan_buckets
from ._plan import validate_worker as validate_worker
from ._receiver import ParameterReceiver as ParameterReceiver
from ._report import RefitReport as RefitReport
from ._report import StageTimes as StageTimes
from ._version import VersionState as VersionState
from ._wire._messages import BucketAck as BucketAck
from ._worker import SourceInfo as SourceInfo
from ._worker import TrainerSource as TrainerSource
from ._worker import TransmittingSource as TransmittingSource
from ._worker import Worker as Worker
from .trainer._local import LocalTrainer as LocalTrainer
from .trainer._shared import SharedParameterTrainer as SharedParameterTrainer

__version__ = "0.1.0"

__all__ = (
    "AsyncRefitError",
    "Bucket",
    "BucketAck",
    "BudgetStatistics",
    "BudgetTooSmallError",
    "ByteBudget",
    "CapacityExceededError",
    "ClosedError",
    "ConversionError",
    "DeviceId",
    "DiscoveryError",
    "DuplicateWorkerError",
    "IntegrityError",
    "LocalTrainer",
    "NameMap",
    "PackError",
    "ParamSpec",
    "ParameterMismatchError",
    "ParameterReceiver",
    "PeerWorkerError",
    "Plan",
    "PlanError",
    "PushError",
    "RefitCoordinator",
    "RefitReport",
    "SharedParameterTrainer",
    "SourceDiedError",
    "SourceError",
    "SourceInfo",
    "SourceRemoteError",
    "SourceTimeoutError",
    "StageTimes",
    "StaleWeightsError",
    "TensorEntry",
    "TrainerSource",
    "TransmittingSource",
    "TransportError",
    "UnknownDeviceError",
    "UnknownWorkerError",
    "VersionError",
    "VersionState",
    "WRAPPER_PREFIXES",
    "Worker",
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
    "plan_buckets",
    "register_adapter",
    "strip_wrappers",
    "validate_worker",
)
