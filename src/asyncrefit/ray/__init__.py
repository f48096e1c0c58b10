"""Ray integration: inference workers and trainer shards as Ray async actors.

Install with ``pip install 'asyncrefit[ray]'``. ``import asyncrefit`` never imports
Ray; importing this package does.

- :class:`RefitWorkerMixin`: inherit it in your inference actor (the one that owns
  your engine or module); :class:`RayWorker` wraps the actor's handle for the
  coordinator.
- :class:`RefitTrainerMixin`: inherit it in a trainer actor (one per shard or device,
  or one per rank of a sharded trainer); :class:`RayTrainerSource` wraps its handle.
- :func:`init_trainer_group`: form the ``torch.distributed`` group of a sharded
  trainer's rank actors from the driver (:func:`destroy_trainer_group` ends it).

The coordinator awaits the actors' ``ObjectRef``\\ s on its own loop; every actor
method runs on the actor's own loop and returns a plain value. Device identity is
``DeviceId(node=<Ray node id>, device=<device name>)``: shared-memory handles go only
to workers on the trainer shard's node and device.
"""

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("asyncrefit.ray needs Ray: pip install 'asyncrefit[ray]'") from exc

from .._exceptions import AwaitableReturnedError as AwaitableReturnedError
from .._exceptions import SourceDiedError as SourceDiedError
from .._exceptions import SourceError as SourceError
from .._exceptions import SourceRemoteError as SourceRemoteError
from ._adapt import as_source as as_source
from ._adapt import as_worker as as_worker
from ._adapt import as_workers as as_workers
from ._adapt import is_actor_handle as is_actor_handle
from ._cluster import current_node_id as current_node_id
from ._cluster import ray_device as ray_device
from ._cluster import sweep_cluster_segments as sweep_cluster_segments
from ._cluster import sweep_node_segments as sweep_node_segments
from ._group import TrainerGroup as TrainerGroup
from ._group import destroy_trainer_group as destroy_trainer_group
from ._group import init_trainer_group as init_trainer_group
from ._trainer import RayTrainerSource as RayTrainerSource
from ._trainer import RefitTrainerMixin as RefitTrainerMixin
from ._worker import RayWorker as RayWorker
from ._worker import RefitWorkerMixin as RefitWorkerMixin

__all__ = (
    "AwaitableReturnedError",
    "RayTrainerSource",
    "RayWorker",
    "RefitTrainerMixin",
    "RefitWorkerMixin",
    "SourceDiedError",
    "SourceError",
    "SourceRemoteError",
    "TrainerGroup",
    "as_source",
    "as_worker",
    "as_workers",
    "current_node_id",
    "destroy_trainer_group",
    "init_trainer_group",
    "is_actor_handle",
    "ray_device",
    "sweep_cluster_segments",
    "sweep_node_segments",
)
