"""The coordinator: discovery, planning, and the per-bucket pipeline of a push."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ._budget import BudgetStatistics, ByteBudget
from ._device import DeviceId
from ._exceptions import (
    AsyncRefitError,
    BudgetTooSmallError,
    ClosedError,
    DuplicateWorkerError,
    PeerWorkerError,
    PlanError,
    PushError,
    TransportError,
    UnknownDeviceError,
    VersionError,
    WorkerDiedError,
    WorkerError,
    WorkerRemoteError,
    WorkerTimeoutError,
    one_error,
    primary_error,
    remote_error,
)
from ._messages import LoadBucket, encoded_size
from ._plan import DEFAULT_ALIGNMENT, ParamSpec, Plan, plan_buckets, validate_worker
from ._report import RefitReport, StageTimes
from ._slots import SlotTable
from ._trainer import LocalTrainer
from ._worker import SourceInfo, TrainerSource, TransmittingSource, Worker
from .transport._base import Handle

if TYPE_CHECKING:
    import torch

    from ._plan import Bucket

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a push waits for workers that never confirmed an abort before it starts.
_SETTLE_BEFORE_PUSH = 0.1


@dataclass(slots=True)
class _PushAccount:
    """Mutable tallies of one push, frozen into a :class:`RefitReport` at the end."""

    begin: float = 0.0
    wait_budget: float = 0.0
    pack: float = 0.0
    load: float = 0.0
    commit: float = 0.0
    handle_bytes: dict[str, int] = field(default_factory=dict)
    transport_bytes: dict[str, int] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)


def _adapt(obj: Any, *, worker: bool = True) -> Any:
    """A Ray actor handle wrapped by :mod:`asyncrefit.ray` (imported only for one).

    Checked before anything else: an actor handle answers to any method name of its
    class, so it could pass for a worker or source protocol without being one.
    """
    kind = type(obj)
    if kind.__name__ == "ActorHandle" and kind.__module__.startswith("ray."):
        from .ray import as_source, as_worker

        return as_worker(obj) if worker else as_source(obj)
    return obj


class RefitCoordinator:
    """Pushes the trainer's weights to inference workers; an async context manager.

    ``trainer`` is a :class:`TrainerSource` (or several: one per trainer shard), or a
    ``torch.nn.Module`` / mapping of tensors of this process, which is wrapped in a
    :class:`LocalTrainer` over shared memory. ``workers`` are :class:`Worker` objects
    with distinct names. Ray actor handles (of actors using the :mod:`asyncrefit.ray`
    mixins) may be given for either and are wrapped as they come.

    ``verify=True`` has the trainer checksum every bucket (CRC-32) and every worker
    re-check its copy against it; a mismatch fails the push with
    :class:`WorkerIntegrityError` as its cause.

    ``budget_bytes`` bounds the staging memory of each trainer source: buckets in
    flight times the slot size never exceed it. ``bucket_bytes`` (default: half the
    budget, so two buckets alternate; never more than the budget) bounds a bucket; a
    tensor larger than that gets a bucket of its own, and the budget must still hold it.

    Entering the context discovers every worker's device (awaiting its
    ``report_device_id_async``, which runs on that worker's own loop), plans the
    buckets, validates every worker's parameters against the trainer's, and allocates
    the staging slots: no byte moves before all of that succeeded.

    Resource handling: slots are allocated on entry and freed on exit, also when entry
    or the body fails. A slot is reused only after every worker that was sent its
    handle acknowledged it, or acknowledged an abort, or is known to be dead.

    Error handling: errors of entry are :class:`PlanError` and
    :class:`DiscoveryError` subclasses; see :meth:`push` for a push's errors.
    """

    def __init__(
        self,
        *,
        trainer: TrainerSource
        | Sequence[TrainerSource]
        | torch.nn.Module
        | Mapping[str, torch.Tensor],
        workers: Iterable[Worker | Any],
        budget_bytes: int,
        bucket_bytes: int | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        timeout: float | None = 60.0,
        cleanup_timeout: float = 10.0,
        broadcast_all_handles: bool = False,
        verify: bool = False,
    ) -> None:
        if budget_bytes <= 0:
            raise PlanError(f"budget_bytes must be positive, got {budget_bytes}")
        self._sources = self._as_sources(trainer)
        self._workers: dict[str, Worker] = {}
        for worker in map(_adapt, workers):
            self._check_new_worker(worker)
            self._workers[worker.name] = worker
        self._budget_bytes = budget_bytes
        # A bucket larger than the budget could never be staged: clamp it.
        self._bucket_bytes = min(
            budget_bytes, bucket_bytes if bucket_bytes is not None else max(1, budget_bytes // 2)
        )
        self._alignment = alignment
        self._timeout = timeout
        self._cleanup_timeout = cleanup_timeout
        self._broadcast_all = broadcast_all_handles
        self._verify = verify

        self._devices: dict[str, DeviceId] = {}
        self._worker_specs: dict[str, tuple[ParamSpec, ...]] = {}
        self._source_of: dict[str, int] = {}
        self._infos: list[SourceInfo] = []
        self._plan: Plan | None = None
        self._slots = SlotTable(0)
        self._slot_bytes = 0
        self._budget: ByteBudget | None = None
        self._versions: dict[str, int | None] = {}
        self._last_version: int | None = None
        # Workers (in the set or removed) that may read slots and never confirmed an
        # abort, with the version to abort: their slots stay quarantined until then.
        self._unsettled: dict[str, tuple[Worker, int]] = {}
        self._lock = anyio.Lock()
        self._state = "new"

    # --- construction helpers ----------------------------------------------------------

    @staticmethod
    def _as_sources(trainer: Any) -> list[TrainerSource]:
        if isinstance(trainer, Sequence) and not isinstance(trainer, str):
            trainer = [_adapt(t, worker=False) for t in trainer]
        else:
            trainer = _adapt(trainer, worker=False)
        if isinstance(trainer, TrainerSource):
            return [trainer]
        if (
            isinstance(trainer, Sequence)
            and trainer
            and all(isinstance(t, TrainerSource) for t in trainer)
        ):
            return list(trainer)
        return [LocalTrainer(trainer)]

    def _check_new_worker(self, worker: Worker) -> None:
        if worker.name in self._workers:
            raise DuplicateWorkerError(worker.name)

    def __repr__(self) -> str:
        return (
            f"<RefitCoordinator {self._state} workers={len(self._workers)} "
            f"version={self._last_version} slots={len(self._slots)}x{self._slot_bytes} "
            f"budget={self._budget!r}>"
        )

    # --- public state ---------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The current bucket plan (``None`` before entry)."""
        return self._plan

    @property
    def devices(self) -> dict[str, DeviceId]:
        """Each worker's device, as it reported it at discovery."""
        return dict(self._devices)

    @property
    def version(self) -> int | None:
        """The last version every worker received completely."""
        return self._last_version

    def versions(self) -> dict[str, int | None]:
        """The complete version each worker holds, as far as the coordinator knows."""
        return dict(self._versions)

    def statistics(self) -> BudgetStatistics:
        """The staging budget's statistics (capacity is what the slots can use)."""
        if self._budget is None:
            return BudgetStatistics(capacity=0, in_use=0, waiters=0, peak=0)
        return self._budget.statistics()

    def quarantined_slots(self) -> dict[int, frozenset[str]]:
        """Slots held back because these workers may still read them."""
        return self._slots.quarantined()

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> RefitCoordinator:
        if self._state != "new":
            raise ClosedError("a RefitCoordinator can be entered once")
        self._state = "open"
        try:
            self._infos = await self._describe_sources()
            await self._discover(list(self._workers))
            await self._replan()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Tell workers to drop their cached handles, then free every slot. Idempotent.

        Runs shielded from cancellation and bounded by ``cleanup_timeout``; errors of
        workers that are gone are logged, not raised.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        with anyio.CancelScope(shield=True):
            async with self._lock:
                if self._slots.quarantined():
                    logger.warning(
                        "closing with slots still read by workers: %s", self._slots.quarantined()
                    )
                with anyio.move_on_after(self._cleanup_timeout):
                    async with anyio.create_task_group() as tg:
                        for name in self._devices:
                            tg.start_soon(self._release_handles, name)
                for source in self._sources:
                    with anyio.move_on_after(self._cleanup_timeout):
                        await source.aclose()

    async def _release_handles(self, name: str) -> None:
        try:
            await self._workers[name].release_handles()
        except Exception as exc:  # a dead worker has nothing to release
            logger.info("worker %s could not release handles: %s", name, exc)

    # --- worker calls ---------------------------------------------------------------------

    async def _call(self, name: str, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Await one worker call under the timeout, translating errors to typed ones."""
        try:
            with anyio.fail_after(self._timeout):
                return await fn()
        except TimeoutError:
            raise WorkerTimeoutError(
                name, f"{what} got no answer within {self._timeout} s"
            ) from None
        except WorkerDiedError:
            self._stop_reading(name)
            raise
        except WorkerError:
            raise
        except Exception as exc:  # raised by an in-process worker: attribute it to it
            raise remote_error(name, type(exc).__name__, str(exc)) from exc

    def _stop_reading(self, name: str) -> None:
        """``name`` reads no slot any more (it confirmed an abort, or it is dead)."""
        self._unsettled.pop(name, None)
        self._release_slots(self._slots.worker_done(name))

    def _release_slots(self, freed: Iterable[int]) -> None:
        assert self._budget is not None or not freed
        for _ in freed:
            assert self._budget is not None
            self._budget.release(self._slot_bytes)

    # --- discovery and planning -------------------------------------------------------

    async def _describe_sources(self) -> list[SourceInfo]:
        infos: list[SourceInfo | None] = [None] * len(self._sources)

        async def one(i: int) -> None:
            infos[i] = await self._sources[i].describe()

        with one_error():
            async with anyio.create_task_group() as tg:
                for i in range(len(self._sources)):
                    tg.start_soon(one, i)
        return [i for i in infos if i is not None]

    async def _discover(self, names: Sequence[str]) -> None:
        found: dict[str, tuple[DeviceId, tuple[ParamSpec, ...]]] = {}

        async def one(name: str) -> None:
            worker = self._workers[name]
            device = await self._call(name, "report_device_id_async", worker.report_device_id_async)
            if not isinstance(device, DeviceId):
                raise WorkerRemoteError(
                    name,
                    "TypeError",
                    f"report_device_id_async returned {type(device).__name__}, not a DeviceId",
                )
            specs = await self._call(name, "parameter_specs", worker.parameter_specs)
            found[name] = (device, tuple(specs))

        with one_error():
            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(one, name)
        for name in names:
            device, specs = found[name]
            self._source_of[name] = self._route(name, device)
            self._devices[name] = device
            self._worker_specs[name] = specs
            self._versions.setdefault(name, None)

    def _route(self, name: str, device: DeviceId) -> int:
        for i, info in enumerate(self._infos):
            if info.serves(device):
                return i
        raise UnknownDeviceError(
            name,
            device,
            [
                f"{i.node}/{'*' if i.devices is None else ','.join(sorted(i.devices))}"
                for i in self._infos
            ],
        )

    async def _replan(self) -> None:
        """Plan from the sources' specs, validate every worker, (re)allocate slots."""
        specs = self._infos[0].specs
        for info in self._infos[1:]:
            if info.specs != specs:
                raise PlanError(
                    f"trainer sources {self._infos[0].name!r} and {info.name!r} hold "
                    "different parameter sets"
                )
        plan = plan_buckets(specs, self._bucket_bytes, alignment=self._alignment)
        slot_bytes = max(1, plan.max_bucket_bytes)
        if slot_bytes > self._budget_bytes:
            largest = max(plan.buckets, key=lambda b: b.nbytes)
            what = (
                f"parameter {largest.entries[0].name!r}"
                if len(largest.entries) == 1
                else f"bucket {largest.index}"
            )
            raise BudgetTooSmallError(self._budget_bytes, slot_bytes, what)
        expected = plan.specs
        for name in self._workers:
            validate_worker(expected, name, self._worker_specs[name])
        if self._slots.quarantined():
            raise AsyncRefitError(
                "cannot re-plan while workers may still read slots: "
                f"{self._slots.quarantined()}; remove those workers first"
            )
        slots = max(1, min(self._budget_bytes // slot_bytes, len(plan.buckets)))
        with one_error():
            async with anyio.create_task_group() as tg:
                for i in self._used_sources():
                    tg.start_soon(self._prepare_source, i, plan, slots, slot_bytes)
        self._plan = plan
        self._slot_bytes = slot_bytes
        self._slots = SlotTable(slots)
        self._budget = ByteBudget(slots * slot_bytes)

    async def _prepare_source(self, i: int, plan: Plan, slots: int, slot_bytes: int) -> None:
        source = self._sources[i]
        if self._verify:
            await source.prepare(plan, slots, slot_bytes, checksum=True)
        else:
            await source.prepare(plan, slots, slot_bytes)

    def _used_sources(self) -> list[int]:
        return sorted(set(self._source_of.values())) if self._source_of else [0]

    # --- membership -------------------------------------------------------------------

    async def add_worker(self, worker: Worker) -> None:
        """Discover and validate ``worker``, then include it in later pushes.

        It holds no version until the next push. Raises like entry does; on error the
        worker is not added.
        """
        async with self._lock:
            self._check_open()
            self._check_new_worker(worker)
            prepared = set(self._used_sources())
            self._workers[worker.name] = worker
            try:
                await self._discover([worker.name])
                assert self._plan is not None
                validate_worker(self._plan.specs, worker.name, self._worker_specs[worker.name])
                source = self._source_of[worker.name]
                if source not in prepared:
                    await self._prepare_source(
                        source, self._plan, len(self._slots), self._slot_bytes
                    )
            except BaseException:
                self._forget(worker.name)
                raise

    async def remove_worker(self, name: str) -> None:
        """Stop pushing to worker ``name`` (for instance after it died or hung).

        Slots the worker may still be reading (it timed out and never confirmed an
        abort) are not released by removing it: they stay quarantined until the worker
        confirms an abort or is known dead. That is tried now, bounded by
        ``cleanup_timeout``, and again, briefly, before every later push; killing a hung
        worker's process settles it at the next try.
        """
        async with self._lock:
            self._check_open()
            if name not in self._workers:
                raise KeyError(name)
            self._forget(name)
            if name in self._unsettled:
                await self._settle(self._cleanup_timeout)

    async def _settle(self, within: float) -> None:
        """Retry the aborts that were never confirmed; release what gets confirmed."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + within
            async with anyio.create_task_group() as tg:
                for name, (worker, version) in list(self._unsettled.items()):
                    tg.start_soon(self._settle_one, name, worker, version)

    async def _settle_one(self, name: str, worker: Worker, version: int) -> None:
        try:
            await worker.abort_update(version)
        except WorkerDiedError:
            pass  # gone: reads nothing
        except Exception as exc:
            logger.info("worker %s still does not confirm abort of %s: %s", name, version, exc)
            return
        self._stop_reading(name)

    def _forget(self, name: str) -> None:
        for table in (
            self._workers,
            self._devices,
            self._worker_specs,
            self._source_of,
            self._versions,
        ):
            table.pop(name, None)

    def _check_open(self) -> None:
        if self._state != "open":
            raise ClosedError(f"the coordinator is {self._state}, not open")

    # --- the push ---------------------------------------------------------------------

    async def push(self, version: int) -> RefitReport:
        """Send the trainer's current weights to every worker as ``version``.

        Returns when every worker holds ``version`` completely. Concurrent calls are
        served one at a time, in order; they never interleave on a worker.

        Resource handling: each bucket takes a slot through the budget, is packed and
        exported once, and each worker is sent only the handle for its own device,
        concurrently; the slot is reused only after every ack. On failure or
        cancellation every touched worker is told to abort (shielded, bounded by
        ``cleanup_timeout``), and slots come back as their readers confirm.

        Error handling: :class:`VersionError` if ``version`` is not newer than the last
        complete one; :class:`PlanError` if the trainer's parameter set changed so that a
        worker no longer matches (nothing is sent); :class:`PushError` for a failure
        during the transfer, naming the failing worker and every worker left without a
        complete version, with the typed cause (:class:`WorkerDiedError`,
        :class:`WorkerTimeoutError`, ...) chained. A cancelled push aborts the same way
        and then lets the cancellation propagate.
        """
        async with self._lock:
            self._check_open()
            if self._last_version is not None and version <= self._last_version:
                raise VersionError(version, self._last_version)
            if not self._workers:
                raise AsyncRefitError("no workers to push to")
            start = time.perf_counter()
            infos = await self._describe_sources()
            assert self._plan is not None
            if infos[0].specs != self._infos[0].specs or len(infos) != len(self._infos):
                self._infos = infos
                await self._replan()
            if self._unsettled:
                await self._settle(_SETTLE_BEFORE_PUSH)
            if not self._slots.free():
                raise AsyncRefitError(
                    "no staging slot is free: workers that never confirmed an abort may "
                    f"still read them ({self._slots.quarantined()}); kill those workers "
                    "(or wait for them) and try again"
                )
            plan_seconds = time.perf_counter() - start
            account = _PushAccount(handle_bytes=dict.fromkeys(self._workers, 0))
            try:
                await self._transfer(version, account)
            except BaseException as exc:
                await self._abort(version, account)
                primary = primary_error(exc)
                if primary is None or not isinstance(primary, Exception):
                    raise  # cancelled (or interrupted): clean, then let it propagate
                failed = primary.worker if isinstance(primary, WorkerError) else None
                if isinstance(primary, PeerWorkerError):
                    failed = primary.peer  # only the peer's report of it got here
                raise PushError(
                    version, primary, account.touched - account.committed, failed
                ) from primary
            self._last_version = version
            return RefitReport(
                version=version,
                buckets=len(self._plan.buckets),
                bytes=self._plan.payload_bytes,
                seconds=time.perf_counter() - start,
                stages=StageTimes(
                    plan=plan_seconds,
                    begin=account.begin,
                    wait_budget=account.wait_budget,
                    pack=account.pack,
                    load=account.load,
                    commit=account.commit,
                ),
                workers=tuple(self._workers),
                handle_bytes_per_worker=account.handle_bytes,
                bytes_per_transport=account.transport_bytes,
                slots=len(self._slots),
                slot_bytes=self._slot_bytes,
                peak_budget_bytes=self.statistics().peak,
            )

    async def _transfer(self, version: int, account: _PushAccount) -> None:
        assert self._plan is not None and self._budget is not None
        names = list(self._workers)

        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for name in names:
                account.touched.add(name)
                self._versions[name] = None
                worker = self._workers[name]
                tg.start_soon(
                    self._call, name, "begin_update", lambda w=worker: w.begin_update(version)
                )
        account.begin = time.perf_counter() - t

        async with anyio.create_task_group() as tg:
            for bucket in self._plan.buckets:
                t = time.perf_counter()
                await self._budget.acquire(self._slot_bytes)
                account.wait_budget += time.perf_counter() - t
                slot = self._slots.take()
                tg.start_soon(self._send_bucket, version, bucket, slot, account)

        t = time.perf_counter()
        buckets = len(self._plan.buckets)

        async def commit(name: str) -> None:
            worker = self._workers[name]
            await self._call(name, "commit_update", lambda: worker.commit_update(version, buckets))
            account.committed.add(name)
            self._versions[name] = version

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(commit, name)
        account.commit = time.perf_counter() - t

    def _devices_to_export(self, source: int) -> list[DeviceId]:
        mine = {d for n, d in self._devices.items() if self._source_of[n] == source}
        info = self._infos[source]
        if self._broadcast_all and info.devices is not None:
            mine |= {DeviceId(node=info.node, device=d) for d in info.devices}
        return sorted(mine)

    async def _send_bucket(
        self, version: int, bucket: Bucket, slot: int, account: _PushAccount
    ) -> None:
        try:
            t = time.perf_counter()
            handles: dict[DeviceId, Handle] = {}

            async def export(source: int) -> None:
                devices = self._devices_to_export(source)
                exported = await self._sources[source].export(bucket, slot, devices)
                if self._verify and any(h.checksum is None for h in exported):
                    raise TransportError(
                        f"trainer source {self._infos[source].name!r} sent bucket "
                        f"{bucket.index} without a checksum, but verify=True"
                    )
                handles.update(zip(devices, exported, strict=True))

            async with anyio.create_task_group() as tg:
                for source in self._used_sources():
                    tg.start_soon(export, source)
            account.pack += time.perf_counter() - t

            t = time.perf_counter()
            every = tuple(handles[d] for d in sorted(handles))
            async with anyio.create_task_group() as tg:
                for source in self._used_sources():
                    src = self._sources[source]
                    if isinstance(src, TransmittingSource):
                        tg.start_soon(src.transmit, bucket, slot)
                for name, device in self._devices.items():
                    mine = every if self._broadcast_all else (handles[device],)
                    account.handle_bytes[name] += encoded_size(
                        LoadBucket(version=version, bucket=bucket.index, handles=mine)
                    )
                    kind = handles[device].kind
                    account.transport_bytes[kind] = (
                        account.transport_bytes.get(kind, 0) + bucket.payload_bytes
                    )
                    self._slots.reading(slot, name)
                    tg.start_soon(self._load_one, name, version, bucket.index, mine, slot)
            account.load += time.perf_counter() - t
        finally:
            if self._slots.finish(slot):
                self._release_slots([slot])

    async def _load_one(
        self, name: str, version: int, bucket: int, handles: tuple[Handle, ...], slot: int
    ) -> None:
        worker = self._workers[name]
        await self._call(
            name, f"load_bucket({bucket})", lambda: worker.load_bucket(version, bucket, handles)
        )
        self._slots.acked(slot, name)

    async def _abort(self, version: int, account: _PushAccount) -> None:
        """Tell every touched worker to abort; shielded and bounded."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self._cleanup_timeout
            async with anyio.create_task_group() as tg:
                for name in sorted(account.touched - account.committed):
                    tg.start_soon(self._abort_one, name, version)
        if self._slots.quarantined():
            logger.warning(
                "push %s aborted; slots still held for unresponsive workers: %s",
                version,
                self._slots.quarantined(),
            )

    async def _abort_one(self, name: str, version: int) -> None:
        worker = self._workers[name]
        if self._slots.reads_any(name):
            # Until it confirms (also if this call is cut off by the cleanup deadline).
            self._unsettled[name] = (worker, version)
        try:
            await worker.abort_update(version)
        except WorkerDiedError:
            pass  # gone: reads nothing
        except Exception as exc:
            logger.warning("worker %s did not confirm abort of %s: %s", name, version, exc)
            return
        self._stop_reading(name)  # confirmed: it reads no slot any more
