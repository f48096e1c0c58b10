"""Discovery: what the trainer sources hold, and each worker's device and parameters.

The coordinator decides when to discover (on entry, when a worker is added, before
every push for the sources); these functions do the asking, and turn the
constructor's arguments into sources and workers (adapted, checked). Each asks all of its
sources or workers concurrently in one task group and raises the one error a failure
stands for (see :func:`~asyncrefit._exceptions.one_error`), never a group; worker
calls are bounded by the coordinator's timeout and their errors typed. Nothing here
holds a resource.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import anyio

from .._device import DeviceId
from .._exceptions import DuplicateWorkerError, WorkerProtocolError, one_error
from .._protocols import SourceInfo, TrainerSource, Worker
from ..trainer._local import LocalTrainer
from ._adapters import adapt
from ._ledger import Member
from ._plan import check_specs
from ._push import call_worker

T = TypeVar("T")


def as_sources(trainer: Any) -> list[TrainerSource]:
    """The trainer argument as sources: adapted, and wrapped in a LocalTrainer if need be."""
    if isinstance(trainer, Sequence) and not isinstance(trainer, str):
        trainer = [adapt(t, "source") for t in trainer]
    else:
        trainer = adapt(trainer, "source")
    if isinstance(trainer, TrainerSource):
        return [trainer]
    if (
        isinstance(trainer, Sequence)
        and trainer
        and all(isinstance(t, TrainerSource) for t in trainer)
    ):
        return list(trainer)
    return [LocalTrainer(trainer)]


def as_workers(workers: Iterable[Worker | Any]) -> list[Worker]:
    """The workers argument, adapted; raises :class:`DuplicateWorkerError` on a name twice."""
    adapted: list[Worker] = []
    for worker in (adapt(w, "worker") for w in workers):
        if any(w.name == worker.name for w in adapted):
            raise DuplicateWorkerError(worker.name)
        adapted.append(worker)
    return adapted


async def describe_sources(sources: Sequence[TrainerSource]) -> list[SourceInfo]:
    """Ask every source, concurrently, what it holds; raises the one error of a failure."""
    if len(sources) == 1:  # every push asks: no task group for one source
        return [await sources[0].describe()]
    infos: list[SourceInfo | None] = [None] * len(sources)

    async def one(i: int) -> None:
        infos[i] = await sources[i].describe()

    with one_error():
        async with anyio.create_task_group() as tg:
            for i in range(len(sources)):
                tg.start_soon(one, i)
    return [i for i in infos if i is not None]


async def discover(workers: Sequence[Worker], within: float | None) -> list[Member]:
    """Ask every worker, concurrently, for its device and parameter specs.

    Each call is bounded by ``within`` seconds; the one error of a failure is raised.
    """
    found: dict[int, Member] = {}

    async def call(probe: Member, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        # A worker being discovered reads no slot: finding it dead frees nothing.
        return await call_worker(probe, what, fn, within=within, died=lambda _: None)

    async def one(i: int, worker: Worker) -> None:
        name = worker.name
        probe = Member(name=name, worker=worker, device=DeviceId(node="", device=""), specs=())
        device = await call(probe, "report_device_id_async", worker.report_device_id_async)
        if not isinstance(device, DeviceId):
            raise WorkerProtocolError(
                name, f"report_device_id_async returned {type(device).__name__}, not a DeviceId"
            )
        specs = await call(probe, "parameter_specs", worker.parameter_specs)
        found[i] = Member(name=name, worker=worker, device=device, specs=check_specs(name, specs))

    with one_error():
        async with anyio.create_task_group() as tg:
            for i, worker in enumerate(workers):
                tg.start_soon(one, i, worker)
    return [found[i] for i in range(len(workers))]
