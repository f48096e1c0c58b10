"""An in-process worker for the benchmarks: the worker protocol over a receiver.

:class:`InProcessWorker` is a :class:`~asyncrefit.abc.Worker` (and, with
``shared=True``, a :class:`~asyncrefit.abc.DirectWorker`) whose parameters are tensors
of the coordinator's own process: it answers on the coordinator's loop at once, so a
benchmark measures the coordinator's work and the copies, not a transport's latency.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._worker._receiver import ParameterReceiver, tensor_digest

if TYPE_CHECKING:
    import torch

    from .._core._plan import ParamSpec
    from .._device import DeviceId
    from .._wire._messages import BucketAck
    from ..transport._base import Handle
    from ..transport.destinations import Destinations


@dataclass
class InProcessWorker:
    """A worker over a :class:`ParameterReceiver` of ``parameters`` in this process.

    Loads copy on the calling loop (blocking it for the copy), as an in-process engine
    would; ``load_seconds`` sums the wall time spent in ``ParameterReceiver.load``.
    ``shared=True`` exports the parameters (a shared-memory segment) for direct
    writes; :meth:`close` unlinks it.
    """

    name: str
    device: DeviceId
    parameters: dict[str, torch.Tensor]
    shared: bool = False
    load_seconds: float = 0.0
    receiver: ParameterReceiver = field(init=False)

    def __post_init__(self) -> None:
        self.receiver = ParameterReceiver(self.parameters, self.device, shared=self.shared)

    async def report_device_id_async(self) -> DeviceId:
        return self.device

    async def parameter_specs(self) -> Sequence[ParamSpec]:
        return self.receiver.specs()

    async def destinations(self) -> Destinations | None:
        return self.receiver.destinations()

    async def begin_update(self, version: int) -> None:
        self.receiver.begin(version)

    async def begin_direct(self, version: int) -> None:
        self.receiver.begin_direct(version)

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        t = time.perf_counter()
        try:
            return self.receiver.load(version, bucket, handles)
        finally:
            self.load_seconds += time.perf_counter() - t

    async def commit_update(self, version: int, buckets: int) -> None:
        self.receiver.commit(version, buckets)

    async def abort_update(self, version: int) -> None:
        self.receiver.abort(version)

    async def abort_unwritten(self, version: int) -> None:
        self.receiver.abort_unwritten(version)

    async def weight_version(self) -> int | None:
        return self.receiver.version

    async def release_handles(self) -> None:
        self.receiver.release_handles()

    async def parameter_digests(self) -> dict[str, str]:
        return {n: tensor_digest(t) for n, t in self.parameters.items()}

    def close(self) -> None:
        """Release the receiver (and unlink an exported segment)."""
        self.receiver.close()
