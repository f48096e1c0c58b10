"""The coordinator: discovery, planning, and the per-bucket pipeline of a push.

State lives in two places: the :class:`~asyncrefit._topology.Topology` (sources,
plan, slots, routes: an immutable value, swapped in only once it is validated and
prepared) and the :class:`~asyncrefit._ledger.Ledger` (members, versions, slots and
their readers: a pure state machine). The coordinator asks them what to do, awaits
the I/O, and reports the outcome back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ._adapters import adapt
from ._budget import BudgetStatistics, ByteBudget
from ._device import DeviceId
from ._exceptions import (
    AsyncRefitError,
    ClosedError,
    DuplicateWorkerError,
    PeerWorkerError,
    PlanError,
    PushError,
    SourceDiedError,
    SourceTimeoutError,
    TransportError,
    WorkerDiedError,
    WorkerError,
    WorkerProtocolError,
    WorkerTimeoutError,
    one_error,
    primary_error,
    remote_error,
)
from ._ledger import Ledger, Member
from ._messages import LoadSizes
from ._plan import DEFAULT_ALIGNMENT, Plan, check_specs
from ._report import RefitReport, StageTimes
from ._topology import Topology, plan_topology
from ._worker import (
    OrderedSource,
    PushEndingSource,
    SourceInfo,
    TrainerSource,
    TransmittingSource,
    Worker,
)
from .events import (
    BucketAcked,
    BucketPacked,
    EventHub,
    EventStream,
    PushAborted,
    PushBegun,
    PushCommitted,
    PushEvent,
    WorkerFailed,
)
from .trainer._local import LocalTrainer
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
    touched: set[Member] = field(default_factory=set)
    committed: set[Member] = field(default_factory=set)
    # slot -> the tokens of the workers' acks for the bucket last in it (ordered handles)
    copied: dict[int, dict[Member, bytes]] = field(default_factory=dict)

    def incomplete(self) -> list[str]:
        return sorted(m.name for m in self.touched - self.committed)


class RefitCoordinator:
    """Pushes the trainer's weights to inference workers; an async context manager.

    ``trainer`` is a :class:`TrainerSource` (or several: one per trainer shard), or a
    ``torch.nn.Module`` / mapping of tensors of this process, which is wrapped in a
    :class:`LocalTrainer` over shared memory. ``workers`` are :class:`Worker` objects
    with distinct names. Objects an adapter takes (see :mod:`asyncrefit._adapters`:
    Ray actor handles of actors using the :mod:`asyncrefit.ray` mixins, once
    ``asyncrefit[ray]`` is installed) may be given for either and are wrapped as they
    come.

    ``verify=True`` has the trainer checksum every bucket (CRC-32) and every worker
    re-check its copy against it; a mismatch fails the push with
    :class:`WorkerIntegrityError` as its cause.

    ``budget_bytes`` bounds the staging memory of each trainer source: buckets in
    flight times the slot size never exceed it. ``bucket_bytes`` (default: half the
    budget, so two buckets alternate; never more than the budget) bounds a bucket; a
    tensor larger than that gets a bucket of its own, and the budget must still hold it.
    Zero-copy sources (:class:`SharedParameterTrainer`, ``CudaSharedParameterTrainer``)
    stage nothing: when every source is one, the budget bounds no memory and every
    bucket of a push is in flight at once (each is still freed for reuse only after
    every worker acknowledged it).

    Entering the context discovers every worker's device (awaiting its
    ``report_device_id_async``, which runs on that worker's own loop), plans the
    buckets, validates every worker's parameters against the trainer's, and allocates
    the staging slots: no byte moves before all of that succeeded.

    Resource handling: slots are allocated on entry and freed on exit, also when entry
    or the body fails. A slot is reused only after every worker that was sent its
    handle acknowledged it, or acknowledged an abort, or is known to be dead. Closing
    cancels a push in progress (it aborts as a failed push does) and waits for it at
    most ``cleanup_timeout`` seconds more than its abort takes.

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
        self._ledger = Ledger()
        # Given at construction, discovered on entry.
        self._joining: list[Worker] = []
        for worker in (adapt(w, "worker") for w in workers):
            if any(w.name == worker.name for w in self._joining):
                raise DuplicateWorkerError(worker.name)
            self._joining.append(worker)
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
        self._load_sizes = LoadSizes()  # handle bytes of the load requests, per push

        # The last topology that was validated and prepared; ``_stale`` once a
        # prepare began that did not finish (the sources' buffers may not match it).
        self._topology: Topology | None = None
        self._stale = False
        self._budget: ByteBudget | None = None
        self._lock = anyio.Lock()
        self._push_scope: anyio.CancelScope | None = None
        self._state = "new"
        self._events = EventHub()

    # --- construction helpers ----------------------------------------------------------

    @staticmethod
    def _as_sources(trainer: Any) -> list[TrainerSource]:
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

    def __repr__(self) -> str:
        topology = self._topology
        slots = f"{topology.slots}x{topology.slot_bytes}" if topology is not None else "none"
        workers = len(self._ledger.members) or len(self._joining)
        return (
            f"<RefitCoordinator {self._state} workers={workers} "
            f"version={self._ledger.last_version} slots={slots} budget={self._budget!r}>"
        )

    # --- public state ---------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The current bucket plan (``None`` before entry)."""
        return self._topology.plan if self._topology is not None else None

    @property
    def devices(self) -> dict[str, DeviceId]:
        """Each worker's device, as it reported it at discovery."""
        return {name: m.device for name, m in self._ledger.members.items()}

    @property
    def version(self) -> int | None:
        """The last version every worker received completely."""
        return self._ledger.last_version

    def versions(self) -> dict[str, int | None]:
        """The complete version each worker holds, as far as the coordinator knows."""
        return self._ledger.versions()

    def statistics(self) -> BudgetStatistics:
        """The staging budget's statistics (capacity is what the slots can use)."""
        if self._budget is None:
            return BudgetStatistics(capacity=0, in_use=0, waiters=0, peak=0)
        return self._budget.statistics()

    def quarantined_slots(self) -> dict[int, frozenset[str]]:
        """Slots held back because these workers may still read them."""
        return self._ledger.quarantined()

    # --- events -----------------------------------------------------------------------

    def subscribe(self, callback: Callable[[PushEvent], object]) -> Callable[[], None]:
        """Call ``callback(event)`` for every :mod:`asyncrefit.events` event from now on.

        Returns a function that unsubscribes. The callback runs inline on the event
        loop of the push and must be quick; one that raises is logged and dropped,
        never raised into the push.
        """
        return self._events.subscribe(callback)

    @asynccontextmanager
    async def events(self, maxlen: int = 1024) -> AsyncIterator[EventStream]:
        """An async iterator of the events from now until the block ends::

            async with refit.events() as events:
                async for event in events:
                    ...

        Resource handling: it buffers at most ``maxlen`` events; when the consumer
        falls behind, the oldest are dropped and counted (``events.dropped``): a push
        never waits for a consumer. Iteration ends when the coordinator closes.
        """
        async with self._events.stream(maxlen) as stream:
            yield stream

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> RefitCoordinator:
        if self._state != "new":
            raise ClosedError("a RefitCoordinator can be entered once")
        self._state = "open"
        try:
            infos = await self._describe_sources()
            members = await self._discover(self._joining)
            await self._replan(infos, members)
            for member in members:
                self._ledger.admit(member)
            self._joining = []
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
        """Cancel a push in progress, tell workers to drop their handles, free every slot.

        Idempotent. Runs shielded from cancellation; a push in progress is cancelled
        and waited for at most ``cleanup_timeout`` seconds after its own abort's bound;
        each worker's release and each source's close are bounded by
        ``cleanup_timeout``. Errors of workers that are gone are logged, not raised.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        with anyio.CancelScope(shield=True):
            if self._push_scope is not None:
                self._push_scope.cancel()
            locked = False
            with anyio.move_on_after(2 * self._cleanup_timeout):
                await self._lock.acquire()
                locked = True
            try:
                if not locked:
                    logger.error(
                        "closing while a push still runs after %s s; freeing buffers anyway",
                        2 * self._cleanup_timeout,
                    )
                if self._ledger.quarantined():
                    logger.warning(
                        "closing with slots still read by workers: %s", self._ledger.quarantined()
                    )
                with anyio.move_on_after(self._cleanup_timeout):
                    async with anyio.create_task_group() as tg:
                        for member in self._ledger.members.values():
                            tg.start_soon(self._release_handles, member)
                for source in self._sources:
                    with anyio.move_on_after(self._cleanup_timeout):
                        await source.aclose()
            finally:
                if locked:
                    self._lock.release()
                self._events.close()

    async def _release_handles(self, member: Member) -> None:
        try:
            await member.worker.release_handles()
        except Exception as exc:  # a dead worker has nothing to release
            logger.info("worker %s could not release handles: %s", member.name, exc)

    # --- worker calls ---------------------------------------------------------------------

    async def _call(
        self, member: Member, what: str, fn: Callable[[], Awaitable[T]], *, timed: bool = True
    ) -> T:
        """Await one worker call under the timeout, translating errors to typed ones.

        ``timed=False``: the caller bounds the call (one deadline for a bucket's loads).
        """
        try:
            if not timed:
                return await fn()
            with anyio.fail_after(self._timeout):
                return await fn()
        except TimeoutError:
            raise WorkerTimeoutError(
                member.name, f"{what} got no answer within {self._timeout} s"
            ) from None
        except WorkerDiedError:
            self._settled(member)  # a dead worker reads nothing any more
            raise
        except WorkerError:
            raise
        except Exception as exc:  # raised by an in-process worker: attribute it to it
            raise remote_error(member.name, type(exc).__name__, str(exc)) from exc

    def _deadline(self) -> float:
        """When a call starting now times out (``inf`` without a timeout)."""
        return math.inf if self._timeout is None else anyio.current_time() + self._timeout

    def _settled(self, member: Member) -> None:
        """``member`` reads no slot any more: give the slots it freed back."""
        self._release_slots(self._ledger.settled(member))

    def _release_slots(self, freed: Iterable[int]) -> None:
        for _ in freed:
            assert self._budget is not None and self._topology is not None
            self._budget.release(self._topology.slot_bytes)

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

    async def _discover(self, workers: Sequence[Worker]) -> list[Member]:
        """Ask every worker, concurrently, for its device and parameter specs."""
        found: dict[int, Member] = {}

        async def one(i: int, worker: Worker) -> None:
            name = worker.name
            probe = Member(name=name, worker=worker, device=DeviceId(node="", device=""), specs=())
            device = await self._call(
                probe, "report_device_id_async", worker.report_device_id_async
            )
            if not isinstance(device, DeviceId):
                raise WorkerProtocolError(
                    name, f"report_device_id_async returned {type(device).__name__}, not a DeviceId"
                )
            specs = await self._call(probe, "parameter_specs", worker.parameter_specs)
            found[i] = Member(
                name=name, worker=worker, device=device, specs=check_specs(name, specs)
            )

        with one_error():
            async with anyio.create_task_group() as tg:
                for i, worker in enumerate(workers):
                    tg.start_soon(one, i, worker)
        return [found[i] for i in range(len(workers))]

    async def _replan(self, infos: Sequence[SourceInfo], members: Iterable[Member]) -> None:
        """Plan, validate and prepare a new topology; swap it in only if all succeeded."""
        topology = plan_topology(
            infos,
            members,
            budget_bytes=self._budget_bytes,
            bucket_bytes=self._bucket_bytes,
            alignment=self._alignment,
        )
        if self._ledger.slots.quarantined():
            raise AsyncRefitError(
                "cannot re-plan while workers may still read slots: "
                f"{self._ledger.quarantined()}; remove those workers first"
            )
        # From here on the sources' buffers may no longer match the old topology.
        self._stale = True
        with one_error():
            async with anyio.create_task_group() as tg:
                for i in topology.used_sources:
                    tg.start_soon(self._prepare_source, i, topology)
        self._topology = topology
        self._ledger.reset_slots(topology.slots)
        self._budget = ByteBudget(topology.slots * topology.slot_bytes)
        self._stale = False

    async def _prepare_source(self, i: int, topology: Topology) -> None:
        source = self._sources[i]
        if self._verify:
            await source.prepare(topology.plan, topology.slots, topology.slot_bytes, checksum=True)
        else:
            await source.prepare(topology.plan, topology.slots, topology.slot_bytes)

    # --- membership -------------------------------------------------------------------

    async def add_worker(self, worker: Worker) -> None:
        """Discover and validate ``worker``, then include it in later pushes.

        It holds no version until the next push. Raises like entry does; on error the
        worker is not added.
        """
        async with self._lock:
            self._check_open()
            worker = adapt(worker, "worker")
            self._ledger.check_name(worker.name)
            (member,) = await self._discover([worker])
            topology = self._topology
            assert topology is not None
            joined = topology.with_member(member)
            if not self._stale and set(joined.used_sources) - set(topology.used_sources):
                await self._prepare_source(joined.routes[member], joined)
            self._topology = joined
            self._ledger.admit(member)

    async def remove_worker(self, name: str) -> None:
        """Stop pushing to worker ``name`` (for instance after it died or hung).

        A worker that is still there is told to release its handles (bounded by
        ``cleanup_timeout``; a dead one has none). Slots the worker may still be
        reading (it timed out and never confirmed an abort) are not released by
        removing it: they stay quarantined until the worker confirms an abort or is
        known dead. That is tried now, bounded by ``cleanup_timeout``, and again,
        briefly, before every later push; killing a hung worker's process settles it at
        the next try.

        Raises :class:`UnknownWorkerError` (a ``KeyError``) if no worker has that name.
        """
        async with self._lock:
            self._check_open()
            removal = self._ledger.remove(name)
            if self._topology is not None:
                self._topology = self._topology.without(removal.member)
            if removal.unsettled:
                await self._settle(self._cleanup_timeout)
            else:
                with anyio.CancelScope(shield=True), anyio.move_on_after(self._cleanup_timeout):
                    await self._release_handles(removal.member)

    async def _settle(self, within: float) -> None:
        """Retry the aborts that were never confirmed; release what gets confirmed."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + within
            async with anyio.create_task_group() as tg:
                for member, version in self._ledger.unsettled():
                    tg.start_soon(self._settle_one, member, version)

    async def _settle_one(self, member: Member, version: int) -> None:
        try:
            await member.worker.abort_update(version)
        except WorkerDiedError:
            pass  # gone: reads nothing
        except Exception as exc:
            logger.info(
                "worker %s still does not confirm abort of %s: %s", member.name, version, exc
            )
            return
        self._settled(member)
        if not self._ledger.is_member(member):
            await self._release_handles(member)  # removed meanwhile: it keeps nothing

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

        Error handling: :class:`VersionError` if ``version`` is not newer than every
        version begun so far (a push that failed may have left workers holding its
        version, so its number is used up); :class:`PlanError` if the trainer's
        parameter set changed so that a worker no longer matches (nothing is sent, and
        the next push checks again); :class:`PushError` for a failure during the
        transfer, naming the failing worker and every worker left without a complete
        version, with the typed cause (:class:`WorkerDiedError`,
        :class:`WorkerTimeoutError`, ...) chained; its cause is :class:`ClosedError`
        when the coordinator was closed during the push. A cancelled push aborts the
        same way and then lets the cancellation propagate.
        """
        async with self._lock:
            self._check_open()
            start = time.perf_counter()
            with anyio.CancelScope() as scope:
                self._push_scope = scope
                try:
                    return await self._push(version, start)
                except BaseException as exc:
                    if self._events:
                        self._emit_aborted(version, start, exc)
                    raise
                finally:
                    self._push_scope = None
            raise ClosedError(f"the coordinator was closed before version {version} began")

    def _emit_aborted(self, version: int, start: float, exc: BaseException) -> None:
        incomplete: tuple[str, ...] = ()
        if isinstance(exc, PushError):
            incomplete = exc.incomplete
            cause = "closed" if isinstance(exc.cause, ClosedError) else type(exc.cause).__name__
        elif isinstance(exc, Exception):
            cause = type(exc).__name__
        else:  # cancelled: by the caller, or by closing the coordinator
            cause = "closed" if self._state == "closed" else "cancelled"
        now = time.perf_counter()
        self._events.emit(
            PushAborted(
                time=now, version=version, seconds=now - start, cause=cause, incomplete=incomplete
            )
        )

    async def _push(self, version: int, start: float) -> RefitReport:
        self._ledger.check_version(version)
        if not self._ledger.members:
            raise AsyncRefitError("no workers to push to")
        ok = False
        try:
            report = await self._push_described(version, start)
            ok = True
            return report
        finally:
            await self._end_push(version, ok)

    async def _end_push(self, version: int, ok: bool) -> None:
        """Tell the sources that want to know that the push is over (shielded, bounded)."""
        ending = [s for s in self._sources if isinstance(s, PushEndingSource)]
        if not ending:
            return

        async def one(source: PushEndingSource) -> None:
            try:
                await source.end_push(version, ok)
            except Exception as exc:
                logger.warning(
                    "trainer source %r missed the end of push %s: %s", source, version, exc
                )

        with anyio.CancelScope(shield=True), anyio.move_on_after(self._cleanup_timeout):
            async with anyio.create_task_group() as tg:
                for source in ending:
                    tg.start_soon(one, source)

    async def _push_described(self, version: int, start: float) -> RefitReport:
        infos = await self._describe_sources()
        if self._stale or self._topology is None or tuple(infos) != self._topology.infos:
            await self._replan(infos, self._ledger.members.values())
        if self._ledger.unsettled():
            await self._settle(_SETTLE_BEFORE_PUSH)
        if not self._ledger.slots.free():
            raise AsyncRefitError(
                "no staging slot is free: workers that never confirmed an abort may "
                f"still read them ({self._ledger.quarantined()}); kill those workers "
                "(or wait for them) and try again"
            )
        topology = self._topology
        assert topology is not None
        plan_seconds = time.perf_counter() - start
        members = self._ledger.begin(version)
        self._load_sizes.next_push()
        account = _PushAccount(handle_bytes=dict.fromkeys((m.name for m in members), 0))
        try:
            await self._transfer(version, topology, members, account, start)
        except BaseException as exc:
            primary = primary_error(exc)
            if self._events and isinstance(primary, WorkerError):
                self._events.emit(
                    WorkerFailed(
                        time=time.perf_counter(),
                        version=version,
                        worker=primary.worker,
                        error=type(primary).__name__,
                        message=str(primary),
                    )
                )
            await self._abort(version, account)
            if primary is None or not isinstance(primary, Exception):
                if self._state == "closed":
                    closed = ClosedError(f"the coordinator was closed during the push of {version}")
                    raise PushError(version, closed, account.incomplete(), None) from None
                raise  # cancelled (or interrupted): clean, then let it propagate
            failed = primary.worker if isinstance(primary, WorkerError) else None
            if isinstance(primary, PeerWorkerError):
                failed = primary.peer  # only a peer's report of the failure got here
            raise PushError(version, primary, account.incomplete(), failed) from primary
        self._ledger.complete(version)
        seconds = time.perf_counter() - start
        workers = tuple(m.name for m in members)
        if self._events:
            self._events.emit(
                PushCommitted(
                    time=start + seconds,
                    version=version,
                    seconds=seconds,
                    bytes=topology.plan.payload_bytes,
                    buckets=len(topology.plan.buckets),
                    workers=workers,
                )
            )
        return RefitReport(
            version=version,
            buckets=len(topology.plan.buckets),
            bytes=topology.plan.payload_bytes,
            seconds=seconds,
            stages=StageTimes(
                plan=plan_seconds,
                begin=account.begin,
                wait_budget=account.wait_budget,
                pack=account.pack,
                load=account.load,
                commit=account.commit,
            ),
            workers=workers,
            handle_bytes_per_worker=account.handle_bytes,
            bytes_per_transport=account.transport_bytes,
            slots=topology.slots,
            slot_bytes=topology.slot_bytes,
            peak_budget_bytes=self.statistics().peak,
        )

    async def _transfer(
        self,
        version: int,
        topology: Topology,
        members: list[Member],
        account: _PushAccount,
        start: float,
    ) -> None:
        budget = self._budget
        assert budget is not None

        # The begins overlap the first bucket's pack; no bucket is sent before every
        # worker began.
        begun = anyio.Event()

        async def begin_all() -> None:
            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for member in members:
                    account.touched.add(member)
                    tg.start_soon(
                        self._call,
                        member,
                        "begin_update",
                        lambda w=member.worker: w.begin_update(version),
                    )
            account.begin = time.perf_counter() - t
            if self._events:
                self._events.emit(
                    PushBegun(
                        time=time.perf_counter(),
                        version=version,
                        workers=tuple(m.name for m in members),
                        buckets=len(topology.plan.buckets),
                        bytes=topology.plan.payload_bytes,
                        started=start,
                    )
                )
            begun.set()

        # Exports go in plan order, bucket after bucket (the pack of k+1 overlaps the
        # loads of k): the ranks of a sharded trainer gather in the same order.
        exported = anyio.Event()
        exported.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(begin_all)
            for bucket in topology.plan.buckets:
                t = time.perf_counter()
                await budget.acquire(topology.slot_bytes)
                account.wait_budget += time.perf_counter() - t
                slot = self._ledger.slots.take()
                after, exported = exported, anyio.Event()
                tg.start_soon(
                    self._send_bucket,
                    version,
                    topology,
                    members,
                    bucket,
                    slot,
                    account,
                    after,
                    exported,
                    begun,
                )

        t = time.perf_counter()
        buckets = len(topology.plan.buckets)

        async def commit(member: Member) -> None:
            worker = member.worker
            await self._call(
                member, "commit_update", lambda: worker.commit_update(version, buckets)
            )
            account.committed.add(member)
            self._ledger.committed(member, version)

        async with anyio.create_task_group() as tg:
            for member in members:
                tg.start_soon(commit, member)
        account.commit = time.perf_counter() - t

    async def _send_bucket(
        self,
        version: int,
        topology: Topology,
        members: list[Member],
        bucket: Bucket,
        slot: int,
        account: _PushAccount,
        after: anyio.Event,
        exported: anyio.Event,
        begun: anyio.Event,
    ) -> None:
        try:
            await after.wait()
            t = time.perf_counter()
            handles: dict[DeviceId, Handle] = {}
            copied = account.copied.pop(slot, {})

            async def export(source: int) -> None:
                src = self._sources[source]
                if isinstance(src, OrderedSource):  # its pack waits for these copies
                    src.order_after(
                        slot, [t for m, t in copied.items() if topology.routes.get(m) == source]
                    )
                devices = topology.devices_to_export(source, every_device=self._broadcast_all)
                exported = await self._sources[source].export(bucket, slot, devices)
                if self._verify and any(h.checksum is None for h in exported):
                    raise TransportError(
                        f"trainer source {topology.infos[source].name!r} sent bucket "
                        f"{bucket.index} without a checksum, but verify=True"
                    )
                handles.update(zip(devices, exported, strict=True))

            await self._export_all(topology, bucket, export)
            # Only a bucket exported everywhere lets the next one begin: after a failure
            # the push is over (the group cancels the tasks waiting here), and no source
            # starts the next bucket (a rank would gather it for nothing).
            exported.set()
            packed = time.perf_counter()
            account.pack += packed - t
            if self._events:
                self._events.emit(
                    BucketPacked(
                        time=packed,
                        version=version,
                        bucket=bucket.index,
                        slot=slot,
                        bytes=bucket.payload_bytes,
                        started=t,
                    )
                )

            await begun.wait()
            t = time.perf_counter()
            every = tuple(handles[d] for d in sorted(handles))
            payload, index, sizes = bucket.payload_bytes, bucket.index, self._load_sizes
            reading = self._ledger.slots.reading
            async with anyio.create_task_group() as tg:
                for source in topology.used_sources:
                    src = self._sources[source]
                    if isinstance(src, TransmittingSource):
                        tg.start_soon(src.transmit, bucket, slot)
                # One deadline for the bucket's loads (they all start now): the same
                # bound as a timeout per call, without a cancel scope per worker.
                with anyio.CancelScope(deadline=self._deadline()) as loads:
                    async with anyio.create_task_group() as load_group:
                        for member in members:
                            handle = handles[member.device]
                            mine = every if self._broadcast_all else (handle,)
                            account.handle_bytes[member.name] += sizes.size(version, index, mine)
                            kind = handle.kind
                            account.transport_bytes[kind] = (
                                account.transport_bytes.get(kind, 0) + payload
                            )
                            reading(slot, member)
                            load_group.start_soon(
                                self._load_one, member, version, index, mine, slot, account, t
                            )
                if loads.cancelled_caught:
                    late = [m for m in members if self._ledger.slots.reads(slot, m)]
                    raise WorkerTimeoutError(
                        late[0].name if late else members[0].name,
                        f"load_bucket({bucket.index}) got no answer within {self._timeout} s",
                    )
            account.load += time.perf_counter() - t
        finally:
            if self._ledger.slots.finish(slot):
                self._release_slots([slot])

    async def _export_all(
        self, topology: Topology, bucket: Bucket, export: Callable[[int], Coroutine[Any, Any, None]]
    ) -> None:
        """Export ``bucket`` from every source the push drives, concurrently.

        With the ranks of a sharded trainer among them, a bucket whose exports began
        is seen through on every rank (shielded from cancellation, bounded by the
        timeout): a rank left out of a gather would leave the others waiting in it.
        One rank failing does not stop the others' exports either; once they all
        ended, a rank that died is the error raised (before the other ranks' failed
        gathers, which it caused), then one still exporting at the timeout, then the
        first other failure.
        """
        if not topology.gathers:
            async with anyio.create_task_group() as tg:
                for source in topology.used_sources:
                    tg.start_soon(export, source)
            return
        pending = set(topology.used_sources)
        failed: list[Exception] = []

        async def one(source: int) -> None:
            try:
                await export(source)
            except Exception as exc:
                failed.append(exc)
            pending.discard(source)

        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self._timeout if self._timeout is not None else math.inf):
                async with anyio.create_task_group() as tg:
                    for source in topology.used_sources:
                        tg.start_soon(one, source)
            died = [e for e in failed if isinstance(e, SourceDiedError)]
            if died:
                raise died[0]
            if pending:
                names = ", ".join(repr(topology.infos[i].name) for i in sorted(pending))
                raise SourceTimeoutError(
                    topology.infos[min(pending)].name,
                    f"bucket {bucket.index} was not exported within {self._timeout} s "
                    f"(still exporting: {names})",
                )
            if failed:
                raise failed[0]

    async def _load_one(
        self,
        member: Member,
        version: int,
        bucket: int,
        handles: tuple[Handle, ...],
        slot: int,
        account: _PushAccount,
        sent: float,
    ) -> None:
        worker = member.worker
        ack = await self._call(
            member,
            f"load_bucket({bucket})",
            lambda: worker.load_bucket(version, bucket, handles),
            timed=False,  # under the bucket's deadline
        )
        if ack.copied:  # its copies may still run: the next pack into the slot waits
            account.copied.setdefault(slot, {})[member] = ack.copied
        self._ledger.slots.acked(slot, member)
        if self._events:
            self._events.emit(
                BucketAcked(
                    time=time.perf_counter(),
                    version=version,
                    bucket=bucket,
                    slot=slot,
                    worker=member.name,
                    sent=sent,
                    seconds=ack.seconds,
                )
            )

    async def _abort(self, version: int, account: _PushAccount) -> None:
        """Tell every touched worker to abort; shielded and bounded."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self._cleanup_timeout
            async with anyio.create_task_group() as tg:
                for member in account.touched - account.committed:
                    tg.start_soon(self._abort_one, member, version)
        if self._ledger.quarantined():
            logger.warning(
                "push %s aborted; slots still held for unresponsive workers: %s",
                version,
                self._ledger.quarantined(),
            )

    async def _abort_one(self, member: Member, version: int) -> None:
        # Owed until it confirms (also if this call is cut off by the cleanup deadline).
        self._ledger.aborting(member, version)
        try:
            await member.worker.abort_update(version)
        except WorkerDiedError:
            pass  # gone: reads nothing
        except Exception as exc:
            logger.warning("worker %s did not confirm abort of %s: %s", member.name, version, exc)
            return
        self._settled(member)  # confirmed: it reads no slot any more
