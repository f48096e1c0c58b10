"""The coordinator: lifecycle, membership, discovery, re-planning and settling.

State lives in two places: the :class:`~asyncrefit._core._topology.Topology` (sources,
plan, slots, routes: an immutable value, swapped in only once it is validated and
prepared) and the :class:`~asyncrefit._core._ledger.Ledger` (members, versions, slots and
their readers: a pure state machine). The coordinator asks them what to do, awaits
the I/O, and reports the outcome back.

A push is serialized by the coordinator's lock and run by a
:class:`~asyncrefit._core._push.Push` made for it (the per-bucket pipeline, the abort),
which records its times, events and report through a
:class:`~asyncrefit._core._recorder.PushRecorder`. The coordinator re-plans before the push
when the sources changed, settles old aborts, tells the sources the push ended, and
cancels a push in progress when it closes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from .._device import DeviceId
from .._exceptions import (
    AsyncRefitError,
    ClosedError,
    PlanError,
    one_error,
)
from .._protocols import DirectWorker, SourceInfo, TrainerSource, Worker, WritingSource
from .._wire._messages import LoadSizes
from ..events import EventHub
from ._adapters import adapt
from ._budget import BudgetStatistics, ByteBudget
from ._discovery import as_sources, as_workers, describe_sources, discover
from ._ledger import Ledger, Member
from ._plan import DEFAULT_ALIGNMENT, Plan
from ._push import (
    WRITE_BATCH_MIN_BYTES,
    Push,
    PushOptions,
    call_worker,
    confirm_abort,
    end_push,
    push_ending,
)
from ._recorder import EventSource, PushRecorder
from ._topology import Topology, plan_topology

if TYPE_CHECKING:
    import torch

    from ._report import RefitReport

logger = logging.getLogger(__name__)

#: How long a push waits for workers that never confirmed an abort before it starts.
_SETTLE_BEFORE_PUSH = 0.1


class RefitCoordinator(EventSource):
    """Pushes the trainer's weights to inference workers; an async context manager.

    ``trainer`` is a :class:`TrainerSource` (or several: one per trainer shard), or a
    ``torch.nn.Module`` / mapping of tensors of this process, which is wrapped in a
    :class:`LocalTrainer` over shared memory. ``workers`` are :class:`Worker` objects
    with distinct names. Objects an adapter takes (see :mod:`asyncrefit._core._adapters`:
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

    ``direct_write=True`` (the default) has a source that can (a
    :class:`~asyncrefit.abc.WritingSource`, such as :class:`LocalTrainer`) write the
    workers that export their parameters (:class:`~asyncrefit.abc.DirectWorker`, such
    as local workers started with ``shared_parameters=True``) directly: one copy per
    byte into the worker's memory, no staging slot, and a begin and a commit per
    worker per push instead of a request per bucket; a source is handed consecutive
    buckets of up to ``budget_bytes`` of payload at a time (the budget then bounds
    what it may materialise to write them). Other workers of the same push
    are sent staged buckets as usual. ``verify=True`` and ``broadcast_all_handles``
    use the staged path for every worker.

    Entering the context discovers every worker's device (awaiting its
    ``report_device_id_async``, which runs on that worker's own loop), plans the
    buckets, validates every worker's parameters against the trainer's, and allocates
    the staging slots: no byte moves before all of that succeeded.

    Resource handling: slots are allocated on entry and freed on exit, also when entry
    or the body fails. A slot is reused only after every worker that was sent its
    handle acknowledged it, or acknowledged an abort, or is known to be dead. Closing
    cancels a push in progress (it aborts as a failed push does) and waits for it at
    most ``cleanup_timeout`` seconds more than its abort takes.

    Events: :meth:`subscribe` and :meth:`events` (from
    :class:`~asyncrefit._core._recorder.EventSource`).

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
        direct_write: bool = True,
    ) -> None:
        if budget_bytes <= 0:
            raise PlanError(f"budget_bytes must be positive, got {budget_bytes}")
        self._sources = as_sources(trainer)
        self._ending = push_ending(self._sources)  # asked once: a protocol check is slow
        self._ledger = Ledger()
        # Given at construction, discovered on entry.
        self._joining: list[Worker] = as_workers(workers)
        self._budget_bytes = budget_bytes
        # A bucket larger than the budget could never be staged: clamp it.
        self._bucket_bytes = min(
            budget_bytes, bucket_bytes if bucket_bytes is not None else max(1, budget_bytes // 2)
        )
        self._alignment = alignment
        self._timeout = timeout
        self._cleanup_timeout = cleanup_timeout
        self._options = PushOptions(
            timeout=timeout,
            cleanup_timeout=cleanup_timeout,
            broadcast_all=broadcast_all_handles,
            verify=verify,
            write_batch_bytes=max(budget_bytes, WRITE_BATCH_MIN_BYTES),
        )
        self._load_sizes = LoadSizes()  # handle bytes of the load requests, per push
        self._direct_write = direct_write and not verify and not broadcast_all_handles

        # The last topology that was validated and prepared; ``_stale`` once a
        # prepare began that did not finish (the sources' buffers may not match it).
        self._topology: Topology | None = None
        self._stale = False
        # Whether a push over a topology that begins ahead does (see Push.run): not
        # after the tensors last read ahead no longer matched, until a push finds
        # them unchanged again (a trainer whose parameters change at every push would
        # otherwise begin and take back every time).
        self._ahead = True
        self._budget: ByteBudget | None = None
        self._lock = anyio.Lock(fast_acquire=True)  # a free lock: no yield before a push
        self._push_scope: anyio.CancelScope | None = None
        self._state = "new"
        self._events = EventHub()

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

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> RefitCoordinator:
        if self._state != "new":
            raise ClosedError("a RefitCoordinator can be entered once")
        self._state = "open"
        try:
            infos = await describe_sources(self._sources)
            members = await discover(self._joining, self._timeout)
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

    # --- slots ----------------------------------------------------------------------------

    def _settled(self, member: Member) -> None:
        """``member`` reads no slot any more: give the slots it freed back."""
        if freed := self._ledger.settled(member):
            assert self._budget is not None and self._topology is not None
            self._budget.release_slots(freed, self._topology.slot_bytes)

    # --- discovery and planning -------------------------------------------------------

    async def _replan(self, infos: Sequence[SourceInfo], members: Iterable[Member]) -> None:
        """Plan, validate and prepare a new topology; swap it in only if all succeeded."""
        topology = plan_topology(
            infos,
            members,
            budget_bytes=self._budget_bytes,
            bucket_bytes=self._bucket_bytes,
            alignment=self._alignment,
        )
        self._ledger.check_replan()
        # From here on the sources' buffers may no longer match the old topology.
        self._stale = True
        topology = await self._attach_direct(topology, topology.routes)
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
        # A source that only writes directly stages nothing: no slot.
        slots = topology.slots if i in topology.exporting_sources else 0
        if self._options.verify:
            await source.prepare(topology.plan, slots, topology.slot_bytes, checksum=True)
        else:
            await source.prepare(topology.plan, slots, topology.slot_bytes)

    async def _attach_direct(self, topology: Topology, members: Iterable[Member]) -> Topology:
        """Have each of ``members`` written directly where its worker exports its
        parameters and its source can write there; the others stay staged."""
        if not self._direct_write:
            return topology
        direct = set(topology.direct)

        async def one(member: Member) -> None:
            source = self._sources[topology.routes[member]]
            worker = member.worker
            if not isinstance(worker, DirectWorker) or not isinstance(source, WritingSource):
                return
            found = await call_worker(
                member,
                "destinations",
                worker.destinations,
                within=self._timeout,
                died=self._settled,
            )
            if found is None:
                if member in direct:  # it exported before, and no longer does
                    direct.discard(member)
                    await source.detach(member.name)
            elif await source.attach(member.name, found, topology.plan):
                direct.add(member)
            else:
                direct.discard(member)

        with one_error():
            async with anyio.create_task_group() as tg:
                for member in members:
                    tg.start_soon(one, member)
        # Workers of one group (the ranks of one engine) take their steps together:
        # all of them are written directly, or none is.
        groups: dict[str, list[Member]] = {}
        for member in topology.routes:
            group = getattr(member.worker, "direct_group", None)
            if isinstance(group, str):
                groups.setdefault(group, []).append(member)
        for group, ranks in groups.items():
            if any(m in direct for m in ranks) and not all(m in direct for m in ranks):
                logger.info("workers of %r are not all written directly: all staged", group)
                for m in ranks:
                    source = self._sources[topology.routes[m]]
                    if m in direct and isinstance(source, WritingSource):
                        direct.discard(m)
                        await source.detach(m.name)
        return topology.with_direct(direct)

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
            (member,) = await discover([worker], self._timeout)
            topology = self._topology
            assert topology is not None
            joined = await self._attach_direct(topology.with_member(member), [member])
            if member not in joined.direct and not joined.slots:
                self._stale = True  # the first staged worker: the next push re-plans slots
            elif not self._stale and set(joined.exporting_sources) - set(
                topology.exporting_sources
            ):
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
                if removal.member in self._topology.direct:
                    source = self._sources[self._topology.routes[removal.member]]
                    assert isinstance(source, WritingSource)
                    with anyio.CancelScope(shield=True):
                        await source.detach(name)
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
        if (exc := await confirm_abort(member, version)) is not None:
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
            recorder = PushRecorder(self._events, version)
            with anyio.CancelScope() as scope:
                self._push_scope = scope
                try:
                    return await self._push(version, recorder)
                except BaseException as exc:
                    recorder.aborted(exc, closed=self._state == "closed")
                    raise
                finally:
                    self._push_scope = None
            raise ClosedError(f"the coordinator was closed before version {version} began")

    async def _push(self, version: int, recorder: PushRecorder) -> RefitReport:
        self._ledger.check_version(version)
        if not self._ledger.members:
            raise AsyncRefitError("no workers to push to")
        ok = False
        try:
            report = None
            if self._begins_ahead():
                # The workers begin while the trainer's tensors are read (that read
                # no longer comes first): if those changed, nothing was written.
                report = await self._new_push(version, recorder).run(current=self._plan_holds)
                self._ahead = report is not None
            if report is None:
                report = await (await self._prepare_push(version, recorder)).run()
                assert report is not None  # only a push begun ahead returns None
            ok = True
            return report
        finally:
            await end_push(self._ending, version, ok, self._cleanup_timeout)

    def _begins_ahead(self) -> bool:
        """Whether the next push begins its workers while it reads the trainer's tensors."""
        topology = self._topology
        return (
            self._ahead
            and topology is not None
            and not self._stale
            and topology.begins_ahead
            and not self._ledger.unsettled()
        )

    async def _plan_holds(self) -> bool:
        """Read the trainer's tensors: whether the current plan still holds for them."""
        infos = await describe_sources(self._sources)
        return (
            not self._stale and self._topology is not None and tuple(infos) == self._topology.infos
        )

    async def _prepare_push(self, version: int, recorder: PushRecorder) -> Push:
        """Re-plan if the sources changed, settle old aborts, check a slot is free."""
        infos = await describe_sources(self._sources)
        if self._stale or self._topology is None or tuple(infos) != self._topology.infos:
            await self._replan(infos, self._ledger.members.values())
        else:
            self._ahead = True  # unchanged: the next push may begin ahead again
        if self._ledger.unsettled():
            await self._settle(_SETTLE_BEFORE_PUSH)
        if self._topology is not None and self._topology.slots and not self._ledger.has_free_slot():
            raise AsyncRefitError(
                "no staging slot is free: workers that never confirmed an abort may "
                f"still read them ({self._ledger.quarantined()}); kill those workers "
                "(or wait for them) and try again"
            )
        return self._new_push(version, recorder)

    def _new_push(self, version: int, recorder: PushRecorder) -> Push:
        assert self._topology is not None and self._budget is not None
        return Push(
            version=version,
            topology=self._topology,
            sources=self._sources,
            ledger=self._ledger,
            budget=self._budget,
            options=self._options,
            load_sizes=self._load_sizes,
            recorder=recorder,
            closed=lambda: self._state == "closed",
        )
