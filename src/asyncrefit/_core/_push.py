"""One push: the per-bucket pipeline that moves a version into every worker.

A :class:`Push` is made by the coordinator once the push is planned (its topology is
current, its budget and slots ready) and lives for that push only. It holds the
push's state (version, topology, members, slots in flight, the acks' copy tokens, who
was touched and who committed) as attributes; what it measures and emits goes to its
:class:`~asyncrefit._core._recorder.PushRecorder`; every slot operation goes through the
:class:`~asyncrefit._core._ledger.Ledger`.

Resource handling: each bucket takes its slot's bytes from the budget, then a slot
from the ledger, and gives both back in its step's ``finally`` once no worker may
still read the slot (the ledger says when). Every task runs in a task group of the
push (structured concurrency); the exports of a sharded trainer's bucket, the abort
and the sources' end of push are shielded from cancellation and bounded in time.

Workers written directly (``topology.direct``) are told to begin, then their source
writes every bucket into them in plan order (no slot, no request per bucket), then
they commit: two calls per worker per push. A source with gated writes is handed every
bucket while the workers begin, and its thread waits at a :class:`WriteGate` the push
opens once they all began (and the plan holds), or shuts: nothing is written before.
On a GPU the commit goes as soon as the writes are issued: the source records the
worker's completion event after them, and the worker waits for it before it commits.
A failure aborts them like the others (once the source waited for every write it
issued); a worker that died meanwhile is found at its commit (or abort).

A push over a topology that begins ahead (every worker written directly and able to
take a begin back: :attr:`Topology.begins_ahead`) begins its workers while the
coordinator reads the trainer's tensors (``run(current=...)``): the begins' round trip
overlaps that read instead of following it. Should the tensors no longer match the
plan, the begins are taken back before any write (each worker holds its previous
version again, the version's number is free) and the coordinator plans again.

Error handling: worker calls are bounded by the timeout and their errors made typed
(:func:`call_worker`). A failure or cancellation of the transfer tells every touched,
uncommitted worker to abort (:meth:`Push.abort`), then raises :class:`PushError`
naming the failure and the workers left incomplete, or lets the cancellation go on.
Before the push issued any write, a directly written worker that can is told so with
its abort (``abort_unwritten``): it keeps its previous version, and is not incomplete.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio

from .._exceptions import (
    ClosedError,
    PeerWorkerError,
    PushError,
    SourceDiedError,
    SourceTimeoutError,
    TransportError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    primary_error,
)
from .._gate import WriteGate
from .._protocols import (
    GatedWritingSource,
    OrderedSource,
    PushEndingSource,
    RestoringWorker,
    TransmittingSource,
)
from .._wire._errors import WORKER, map_exceptions, raised_errors

if TYPE_CHECKING:
    from .._device import DeviceId
    from .._protocols import DirectWorker, TrainerSource, WritingSource
    from .._wire._messages import LoadSizes
    from ..transport._base import Handle
    from ._budget import ByteBudget
    from ._ledger import Ledger, Member
    from ._plan import Bucket
    from ._recorder import BucketRecorder, PushRecorder
    from ._report import RefitReport
    from ._topology import Topology

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class PushOptions:
    """The coordinator's settings a push runs under."""

    timeout: float | None
    cleanup_timeout: float
    broadcast_all: bool
    verify: bool
    #: At most this much payload is written into direct workers by one source call
    #: (of a source without gated writes: those get every bucket in one call).
    write_batch_bytes: int = 1 << 30


#: The least payload of a batch of direct writes (see :func:`write_batches`): a source
#: materialises one bucket at a time whatever the batch, so a batch only bounds how long
#: one source call runs (an abort waits for the call in flight: about 10 ms of writes on
#: a CPU) and sets how many calls a remote source gets per push. Measured on Ray, 32
#: actors x 8 buckets of 2 MiB: a call per two buckets (the budget) cost the driver
#: 4 more actor calls per push than one call for all, about 15% of its CPU per push.
#: A source with gated writes is not batched: it stops between buckets when told.
WRITE_BATCH_MIN_BYTES = 64 << 20


def write_batches(buckets: Sequence[Bucket], limit: int) -> list[tuple[Bucket, ...]]:
    """``buckets`` in order, grouped so that each group's payload is at most ``limit``
    bytes (a bucket larger than that is a group of its own)."""
    batches: list[tuple[Bucket, ...]] = []
    batch: list[Bucket] = []
    size = 0
    for bucket in buckets:
        if batch and size + bucket.payload_bytes > limit:
            batches.append(tuple(batch))
            batch, size = [], 0
        batch.append(bucket)
        size += bucket.payload_bytes
    if batch:
        batches.append(tuple(batch))
    return batches


async def _each(calls: Sequence[Callable[[], Coroutine[Any, Any, object]]]) -> None:
    """Await every one of ``calls`` concurrently, in a task group; a single one in this
    task (no task to start: the push's control path runs a call per worker, mostly one).

    A failure is raised as the task group raises it, or bare for a single call (the
    push takes the one error either stands for: see
    :func:`~asyncrefit._exceptions.primary_error`).
    """
    if len(calls) == 1:
        await calls[0]()
        return
    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(call)


async def _each_result(calls: Sequence[Callable[[], Coroutine[Any, Any, T]]]) -> list[T]:
    """:func:`_each`, keeping what each call returned (in the order of ``calls``)."""
    if len(calls) == 1:
        return [await calls[0]()]
    slots: dict[int, T] = {}

    async def one(k: int) -> None:
        slots[k] = await calls[k]()

    await _each([partial(one, k) for k in range(len(calls))])
    return [slots[k] for k in range(len(calls))]


async def call_worker(
    member: Member,
    what: str,
    fn: Callable[[], Awaitable[T]],
    *,
    within: float | None,
    died: Callable[[Member], None],
    timed: bool = True,
) -> T:
    """Await one worker call for at most ``within`` seconds, translating errors to typed ones.

    ``timed=False``: the caller bounds the call (one deadline for a bucket's loads).
    A worker found dead is passed to ``died`` (it reads no slot any more) first. What
    an in-process worker raised goes through the one error map
    (:func:`~asyncrefit._wire._errors.raised_errors`): typed errors pass, a timeout is
    the worker's, any other exception becomes its remote error of its kind.
    """
    try:
        with map_exceptions(raised_errors(WORKER, member.name, passing=(TimeoutError,))):
            if not timed:
                return await fn()
            with anyio.fail_after(within):
                return await fn()
    except TimeoutError:
        raise WorkerTimeoutError(member.name, f"{what} got no answer within {within} s") from None
    except WorkerDiedError:
        died(member)  # a dead worker reads nothing any more
        raise


async def confirm_abort(member: Member, version: int) -> Exception | None:
    """Tell ``member`` to abort ``version``: ``None`` once it no longer reads any slot.

    That is when it confirmed, or is found dead (it reads nothing); otherwise the
    error of a worker that did not confirm, which the caller logs.
    """
    try:
        await member.worker.abort_update(version)
    except WorkerDiedError:
        pass  # gone: reads nothing
    except Exception as exc:
        return exc
    return None


def push_ending(sources: Iterable[TrainerSource]) -> list[PushEndingSource]:
    """The sources that want to know when a push is over (see :func:`end_push`)."""
    return [s for s in sources if isinstance(s, PushEndingSource)]


async def end_push(
    ending: Sequence[PushEndingSource], version: int, ok: bool, cleanup_timeout: float
) -> None:
    """Tell ``ending`` (see :func:`push_ending`) that the push is over (shielded, bounded)."""
    if not ending:
        return

    async def one(source: PushEndingSource) -> None:
        try:
            await source.end_push(version, ok)
        except Exception as exc:
            logger.warning("trainer source %r missed the end of push %s: %s", source, version, exc)

    with anyio.CancelScope(shield=True), anyio.move_on_after(cleanup_timeout):
        async with anyio.create_task_group() as tg:
            for source in ending:
                tg.start_soon(one, source)


@functools.lru_cache(maxsize=64)
def _takes_gated_writes(kind: type) -> bool:
    """Whether sources of class ``kind`` are :class:`GatedWritingSource` (asked once per
    class: a protocol check per push costs tens of microseconds before the first write)."""
    return issubclass(kind, GatedWritingSource)


#: Scheduling rounds a push that begins ahead gives its begins before it reads the
#: trainer's tensors: a begin into a local worker sends its request in its first
#: round, one of several workers in the second; an engine's (its pause, then its
#: ranks' requests) in a few more. Each round costs one pass of the event loop.
_ROUNDS_BEFORE_READ = 4


class _NotCurrent(Exception):
    """The trainer's tensors read after an ahead begin no longer match the plan, or
    could not be read (``error``)."""

    def __init__(self, error: Exception | None) -> None:
        super().__init__("the plan no longer holds")
        self.error = error


class Push:
    """One push of ``version`` over ``topology``: :meth:`run` it once.

    ``closed`` tells whether the coordinator was closed (a cancellation then fails the
    push with :class:`ClosedError` as its cause instead of propagating).
    """

    def __init__(
        self,
        *,
        version: int,
        topology: Topology,
        sources: Sequence[TrainerSource],
        ledger: Ledger,
        budget: ByteBudget,
        options: PushOptions,
        load_sizes: LoadSizes,
        recorder: PushRecorder,
        closed: Callable[[], bool],
    ) -> None:
        self.version = version
        self.topology = topology
        self.members: list[Member] = []  # set when the push begins
        self._sources = sources
        self._ledger = ledger
        self._budget = budget
        self._options = options
        self._load_sizes = load_sizes
        self._recorder = recorder
        self._closed = closed
        self._staged: list[Member] = []  # the members sent staged buckets
        self._touched: set[Member] = set()  # told to begin: an abort must reach them
        self._committed: set[Member] = set()
        # slot -> the tokens of the workers' acks for the bucket last in it (ordered handles)
        self._copied: dict[int, dict[Member, bytes]] = {}
        self._begun = anyio.Event()  # every worker began: buckets may be sent
        self._held = True  # the plan holds for the trainer's tensors (see _read_ahead)
        self._read = anyio.Event()  # _held is known (set now unless the push reads ahead)
        # Opens the gate of gated writes (see _write_gated), called the moment the push
        # is ready to write (_ready): no task has to wake for it.
        self._opening: Callable[[], None] | None = None
        self._announced = False  # PushBegun was emitted
        self._written = False  # a direct write may be issued: no begin can be taken back
        self._restored: set[Member] = set()  # took the begin back: hold what they held
        self._abort_errors: dict[Member, Exception] = {}  # aborts not confirmed

    def incomplete(self) -> list[str]:
        """The workers told to begin that did not commit, and do not hold their
        previous version again (see :meth:`abort`)."""
        return sorted(m.name for m in self._touched - self._committed - self._restored)

    # --- the whole push ---------------------------------------------------------------

    async def run(
        self, *, current: Callable[[], Awaitable[bool]] | None = None
    ) -> RefitReport | None:
        """Begin, send every bucket, commit; on failure abort and raise :class:`PushError`.

        ``current`` (only over a topology that :attr:`~Topology.begins_ahead`): the
        workers begin while ``current()`` reads the trainer's tensors and says whether
        they still match the plan. If they do not, or reading them raised, every begin
        is taken back before any write (:meth:`take_back`), then ``None`` is returned
        (plan again) or the reading's error raised.
        """
        self.members = self._ledger.begin(self.version)
        self._staged = [m for m in self.members if m not in self.topology.direct]
        self._recorder.planned(m.name for m in self.members)
        self._load_sizes.next_push()
        try:
            await self._transfer(current)
        except _NotCurrent as stale:
            await self.take_back()
            if stale.error is not None:
                raise stale.error from None
            return None
        except BaseException as exc:
            primary = primary_error(exc)
            self._recorder.worker_failed(primary)
            await self.abort()
            if primary is None or not isinstance(primary, Exception):
                if self._closed():
                    closed = ClosedError(
                        f"the coordinator was closed during the push of {self.version}"
                    )
                    raise PushError(self.version, closed, self.incomplete(), None) from None
                raise  # cancelled (or interrupted): clean, then let it propagate
            failed = primary.worker if isinstance(primary, WorkerError) else None
            if isinstance(primary, PeerWorkerError):
                failed = primary.peer  # only a peer's report of the failure got here
            raise PushError(self.version, primary, self.incomplete(), failed) from primary
        self._ledger.complete(self.version)
        return self._recorder.committed(self.topology, self._budget.statistics().peak)

    async def _read_ahead(self, current: Callable[[], Awaitable[bool]]) -> _NotCurrent | None:
        """Run ``current()`` while the workers begin: ``None`` if the plan holds, else
        (it said no or raised) :class:`_NotCurrent`, once every worker began (a failed
        begin raises itself)."""
        # The read runs in this task, mostly without yielding: first let the begins go
        # out (a few scheduling rounds take each begin to its request, and the first
        # write to its source), so that the workers answer while the trainer is read.
        for _ in range(_ROUNDS_BEFORE_READ):
            await anyio.lowlevel.checkpoint()
        error: Exception | None = None
        try:
            self._held = await current()
        except Exception as exc:
            error = exc
        if error is not None:
            self._held = False
        self._read.set()
        if not self._held:
            await self._begun.wait()  # every begin answered: each can be taken back
            return _NotCurrent(error)
        self._announce()
        return None

    def _ready(self) -> bool:
        """Every worker began and the plan is known to hold: the push may write."""
        return self._begun.is_set() and self._read.is_set() and self._held

    def _announce(self) -> None:
        """Once the push is ready to write, emit :class:`PushBegun` (once), then open
        the gate of gated writes: its subscribers hear of it before any write."""
        if not self._ready():
            return
        if not self._announced:
            self._announced = True
            self._recorder.begun(self.topology)
        if self._opening is not None:
            opening, self._opening = self._opening, None
            opening()

    async def take_back(self) -> None:
        """Take back the begins of a push that wrote nothing: abort every worker it
        touched, telling it so; each then holds what it held before, and the version's
        number is free again. Raises :class:`PushError` naming the workers that did not
        confirm (they hold no complete version)."""
        await self.abort()
        if incomplete := self.incomplete():
            failed = min(self._abort_errors, key=lambda m: m.name, default=None)
            cause: Exception = (
                self._abort_errors[failed]
                if failed is not None
                else WorkerTimeoutError(
                    incomplete[0],
                    f"abort_unwritten got no answer within {self._options.cleanup_timeout} s",
                )
            )
            name = failed.name if failed is not None else incomplete[0]
            raise PushError(self.version, cause, incomplete, name) from cause
        self._ledger.take_back(self.version)

    async def _transfer(self, current: Callable[[], Awaitable[bool]] | None = None) -> None:
        if current is None:
            self._read.set()
        if not self.topology.exporting_sources:
            # Every worker is written directly: begin, write, commit. The writes wait
            # for every begin (the first one at a gate, handed to its source at once,
            # see _write_direct); with ``current`` the trainer is read meanwhile, and
            # nothing is written unless the plan holds.
            stale = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._begin_all)
                tg.start_soon(self._write_direct)
                if current is not None:
                    stale = await self._read_ahead(current)
            if stale is not None:
                raise stale
        else:
            await self._transfer_staged()
        with self._recorder.committing():
            await self._each_member(self.members, self._commit, lambda _: "commit_update")

    async def _transfer_staged(self) -> None:
        # The begins overlap the first bucket's pack; no bucket is sent before every
        # worker began. Exports go in plan order, bucket after bucket (the pack of k+1
        # overlaps the loads of k): the ranks of a sharded trainer gather in that order.
        exported = anyio.Event()
        exported.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._begin_all)
            tg.start_soon(self._write_direct)
            for bucket in self.topology.plan.buckets:
                with self._recorder.waiting_for_budget():
                    await self._budget.acquire(self.topology.slot_bytes)
                slot = self._ledger.take_slot()
                after, exported = exported, anyio.Event()
                tg.start_soon(self.send_bucket, bucket, slot, after, exported)

    async def _begin_all(self) -> None:
        self._touched.update(self.members)  # an abort must reach every one of them
        with self._recorder.beginning():
            await self._each_member(self.members, self._begin, self._begin_call)
        self._begun.set()
        self._announce()

    def _begin_call(self, member: Member) -> str:
        return "begin_direct" if member in self.topology.direct else "begin_update"

    async def _begin(self, member: Member) -> None:
        version, worker, what = self.version, member.worker, self._begin_call(member)
        if what == "begin_direct":
            # checked when it was attached (no protocol check per push)
            direct = cast("DirectWorker", worker)
            await self._call(member, what, lambda: direct.begin_direct(version))
        else:
            await self._call(member, what, lambda: worker.begin_update(version))

    async def _write_direct(self) -> None:
        """Have each source write every bucket into its direct members, in plan order,
        once every worker began and the plan is known to hold (nothing, if it does
        not); then end the writes issued on a device (a worker that exported a
        completion event waits for it itself, at its commit).

        Consecutive buckets go to a source together, up to ``write_batch_bytes`` of
        payload a call (at least one bucket): a remote source is called once per
        batch, not per bucket. A source materialises one bucket at a time (a cast, a
        conversion), so the budget bounds that whatever the batch. When every source
        takes gated writes (:class:`~asyncrefit.abc.GatedWritingSource`), every bucket
        goes to them at once, in one call, held at a gate the push opens then
        (:meth:`_write_gated`): the hand-off to a source's thread overlaps the begins
        and the read instead of following them, and none comes between buckets.
        """
        groups = self.topology.direct_groups()
        if not groups:
            return
        # Checked when their members were attached (no protocol check per bucket).
        sources = {i: cast("WritingSource", self._sources[i]) for i in groups}
        names = {i: [m.name for m in ms] for i, ms in groups.items()}
        count = sum(len(ms) for ms in groups.values())
        buckets = self.topology.plan.buckets
        batches: list[tuple[Bucket, ...]] = []
        if all(_takes_gated_writes(type(s)) for s in sources.values()):
            if not await self._write_gated(tuple(buckets), sources, names, count):
                return  # the plan no longer holds: nothing was written
        else:
            batches = write_batches(buckets, self._options.write_batch_bytes)
            await self._read.wait()
            await self._begun.wait()
            if not self._held:
                return
            self._written = True  # from here on the workers' memory may change
        for batch in batches:
            records = [self._recorder.bucket(b.index, -1, b.payload_bytes) for b in batch]
            with self._recorder.writing(records, "direct", count):
                await _each([partial(s.write, batch, names[i]) for i, s in sources.items()])
        # The writes issued on a device end: a worker that exported a completion event
        # gets it recorded and waits for it at its commit (which goes at once); the
        # devices of the others are waited for here.
        with self._recorder.writing((), "direct", count):
            await _each([partial(s.flush, wait=False) for s in sources.values()])

    async def _write_gated(
        self,
        buckets: tuple[Bucket, ...],
        sources: dict[int, WritingSource],
        names: dict[int, list[str]],
        count: int,
    ) -> bool:
        """Hand every bucket to every source before the workers began, behind one
        gate: opened once they all began and the plan holds; shut if it does not, or
        if the push fails or is cancelled first (the sources then write nothing and
        return); shut after it opened if the push fails or is cancelled meanwhile (the
        sources stop before their next bucket). Whether it was written."""
        gate = WriteGate()
        records = [self._recorder.bucket(b.index, -1, b.payload_bytes) for b in buckets]
        with self._recorder.writing(records, "direct", count) as timer:

            def open_gate() -> None:
                self._written = True  # from here on the workers' memory may change
                timer.restart()  # the writes' time starts at the gate
                gate.open()

            async def shut_unless_held() -> None:
                try:
                    await self._read.wait()
                    if self._held:
                        await anyio.sleep_forever()  # until the writes return
                finally:
                    self._opening = None
                    gate.shut()  # not held, or cancelled: no (further) bucket is written

            # Opened by _announce, from the task that answers the last begin or ends
            # the read, whichever comes second (or now, if both came already).
            self._opening = open_gate
            self._announce()
            async with anyio.create_task_group() as tg:
                tg.start_soon(shut_unless_held)
                written = await _each_result(
                    [
                        partial(cast("GatedWritingSource", s).write_gated, buckets, names[i], gate)
                        for i, s in sources.items()
                    ]
                )
                tg.cancel_scope.cancel()
            if not all(written):
                # A gate shut by a cancellation: the writes were not cancellable (each
                # ran in its source's thread), the cancellation is delivered here.
                await anyio.lowlevel.checkpoint()
                if not self._held:
                    timer.discard()  # nothing was written
                    return False
                # The gate stayed open: a source that breaks its contract.
                source = next(i for i, wrote in zip(sources, written, strict=True) if not wrote)
                raise TransportError(
                    f"trainer source {self.topology.infos[source].name!r} did not write "
                    "every bucket though every worker began"
                )
        return True

    async def _commit(self, member: Member) -> None:
        worker, version, buckets = member.worker, self.version, len(self.topology.plan.buckets)
        await self._call(member, "commit_update", lambda: worker.commit_update(version, buckets))
        self._committed.add(member)
        self._ledger.committed(member, version)

    # --- one bucket -------------------------------------------------------------------

    async def send_bucket(
        self, bucket: Bucket, slot: int, after: anyio.Event, exported: anyio.Event
    ) -> None:
        """The step of one bucket in ``slot``: export it once ``after`` is set (the
        previous bucket was exported everywhere), set ``exported``, send it to every
        worker once all began, await their acks; the slot is freed when none reads it.
        """
        record = self._recorder.bucket(bucket.index, slot, bucket.payload_bytes)
        try:
            await after.wait()
            with record.packing():
                handles = await self._export(bucket, slot)
                # Only a bucket exported everywhere lets the next one begin: after a
                # failure the push is over (the group cancels the tasks waiting here),
                # and no source starts the next bucket (a rank would gather it for
                # nothing).
                exported.set()
            await self._begun.wait()
            with record.loading():
                await self._load(bucket, handles, record)
        finally:
            if self._ledger.finish_slot(slot):
                self._budget.release(self.topology.slot_bytes)

    async def _export(self, bucket: Bucket, slot: int) -> dict[DeviceId, Handle]:
        """Pack and export ``bucket`` into ``slot`` on every source: the handles."""
        topology, verify = self.topology, self._options.verify
        handles: dict[DeviceId, Handle] = {}
        copied = self._copied.pop(slot, {})

        async def export(source: int) -> None:
            src = self._sources[source]
            if isinstance(src, OrderedSource):  # its pack waits for these copies
                src.order_after(
                    slot, [t for m, t in copied.items() if topology.routes.get(m) == source]
                )
            devices = topology.devices_to_export(source, every_device=self._options.broadcast_all)
            exported = await src.export(bucket, slot, devices)
            if verify and any(h.checksum is None for h in exported):
                raise TransportError(
                    f"trainer source {topology.infos[source].name!r} sent bucket "
                    f"{bucket.index} without a checksum, but verify=True"
                )
            handles.update(zip(devices, exported, strict=True))

        await self._export_all(bucket, export)
        return handles

    async def _export_all(
        self, bucket: Bucket, export: Callable[[int], Coroutine[Any, Any, None]]
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
        topology, timeout = self.topology, self._options.timeout
        if not topology.gathers:
            async with anyio.create_task_group() as tg:
                for source in topology.exporting_sources:
                    tg.start_soon(export, source)
            return
        pending = set(topology.exporting_sources)
        failed: list[Exception] = []

        async def one(source: int) -> None:
            try:
                await export(source)
            except Exception as exc:
                failed.append(exc)
            pending.discard(source)

        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(timeout if timeout is not None else math.inf):
                async with anyio.create_task_group() as tg:
                    for source in topology.exporting_sources:
                        tg.start_soon(one, source)
            died = [e for e in failed if isinstance(e, SourceDiedError)]
            if died:
                raise died[0]
            if pending:
                names = ", ".join(repr(topology.infos[i].name) for i in sorted(pending))
                raise SourceTimeoutError(
                    topology.infos[min(pending)].name,
                    f"bucket {bucket.index} was not exported within {timeout} s "
                    f"(still exporting: {names})",
                )
            if failed:
                raise failed[0]

    async def _load(
        self, bucket: Bucket, handles: dict[DeviceId, Handle], record: BucketRecorder
    ) -> None:
        """Send every worker its handles of ``bucket`` and await every ack."""
        every = tuple(handles[d] for d in sorted(handles))
        broadcast_all, timeout = self._options.broadcast_all, self._options.timeout
        async with anyio.create_task_group() as tg:
            for source in self.topology.exporting_sources:
                src = self._sources[source]
                if isinstance(src, TransmittingSource):
                    tg.start_soon(src.transmit, bucket, record.slot)
            # One deadline for the bucket's loads (they all start now): the same
            # bound as a timeout per call, without a cancel scope per worker.
            deadline = math.inf if timeout is None else anyio.current_time() + timeout
            with anyio.CancelScope(deadline=deadline) as loads:
                async with anyio.create_task_group() as load_group:
                    for member in self._staged:
                        handle = handles[member.device]
                        mine = every if broadcast_all else (handle,)
                        size = self._load_sizes.size(self.version, bucket.index, mine)
                        record.bucket_sent(member.name, handle.kind, size)
                        self._ledger.reading(record.slot, member)
                        load_group.start_soon(self._load_one, member, mine, record)
            if loads.cancelled_caught:
                late = [m for m in self._staged if self._ledger.reads(record.slot, m)]
                raise WorkerTimeoutError(
                    late[0].name if late else self._staged[0].name,
                    f"load_bucket({bucket.index}) got no answer within {timeout} s",
                )

    async def _load_one(
        self, member: Member, handles: tuple[Handle, ...], record: BucketRecorder
    ) -> None:
        worker, version, index = member.worker, self.version, record.index
        ack = await self._call(
            member,
            f"load_bucket({index})",
            lambda: worker.load_bucket(version, index, handles),
        )  # under the bucket's deadline
        if ack.copied:  # its copies may still run: the next pack into the slot waits
            self._copied.setdefault(record.slot, {})[member] = ack.copied
        self._ledger.acked(record.slot, member)
        record.acked(member.name, ack.seconds)

    # --- failure ----------------------------------------------------------------------

    async def abort(self) -> None:
        """Tell every touched, uncommitted worker to abort; shielded and bounded.

        Direct writes a source issued on a device are waited for first: a worker is
        told to abort only once nothing writes its memory any more. Before the push
        issued any write, a worker written directly that can take its begin back
        (:class:`~asyncrefit.abc.RestoringWorker`) is told that nothing was written:
        once it confirms, it holds its previous version again (so does the ledger).
        """
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self._options.cleanup_timeout
            await self._flush_direct()
            async with anyio.create_task_group() as tg:
                for member in self._touched - self._committed - self._restored:
                    tg.start_soon(self._abort_one, member)
        if self._ledger.quarantined():
            logger.warning(
                "push %s aborted; slots still held for unresponsive workers: %s",
                self.version,
                self._ledger.quarantined(),
            )

    async def _flush_direct(self) -> None:
        """Wait for the direct writes still running on a device (errors are logged)."""

        async def one(source: WritingSource) -> None:
            try:
                await source.flush(wait=True)
            except Exception as exc:
                logger.warning("trainer source %r could not finish its writes: %s", source, exc)

        async with anyio.create_task_group() as tg:
            for i in self.topology.direct_groups():
                tg.start_soon(one, cast("WritingSource", self._sources[i]))

    async def _abort_one(self, member: Member) -> None:
        version = self.version
        # Owed until it confirms (also if this call is cut off by the cleanup deadline).
        self._ledger.aborting(member, version)
        if not self._written and member in self.topology.restoring:
            await self._restore_one(member)
            return
        if (exc := await confirm_abort(member, version)) is not None:
            logger.warning("worker %s did not confirm abort of %s: %s", member.name, version, exc)
            self._abort_errors[member] = exc
            return
        self._settled(member)  # confirmed: it reads no slot any more

    async def _restore_one(self, member: Member) -> None:
        """Abort ``member``, begun direct and not written: it holds what it held before."""
        worker = cast("RestoringWorker", member.worker)  # checked when it was attached
        try:
            await worker.abort_unwritten(self.version)
        except WorkerDiedError:
            self._settled(member)  # gone: reads nothing, and holds nothing
        except Exception as exc:
            logger.warning(
                "worker %s did not confirm abort of %s: %s", member.name, self.version, exc
            )
            self._abort_errors[member] = exc
        else:
            self._settled(member)
            self._restored.add(member)
            self._ledger.restored(member)

    # --- helpers ----------------------------------------------------------------------

    async def _each_member(
        self,
        members: Sequence[Member],
        step: Callable[[Member], Awaitable[None]],
        call: Callable[[Member], str],
    ) -> None:
        """Run ``step`` for every one of ``members`` at once, all under one deadline.

        The calls start together, so one deadline ``timeout`` seconds from now bounds
        each of them as a deadline of its own would, for one timer rather than one per
        worker (a begin and a commit per worker per push). A member still without its
        answer then is named by :class:`WorkerTimeoutError` (the first of them in
        ``members``; the others are cancelled, as a failure cancels them).
        """
        within = self._options.timeout
        answered: set[Member] = set()

        async def one(member: Member) -> None:
            await step(member)
            answered.add(member)

        with anyio.move_on_after(within) as scope:
            await _each([partial(one, member) for member in members])
        if scope.cancelled_caught:
            late = next(m for m in members if m not in answered)
            raise WorkerTimeoutError(late.name, f"{call(late)} got no answer within {within} s")

    async def _call(self, member: Member, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One worker call of the push, typed as :func:`call_worker` makes it; bounded by
        its caller (every call of a push runs under a deadline shared with others: its
        step's, see :meth:`_each_member`, or its bucket's)."""
        return await call_worker(
            member, what, fn, within=self._options.timeout, died=self._settled, timed=False
        )

    def _settled(self, member: Member) -> None:
        """``member`` reads no slot any more: give the slots it freed back."""
        self._budget.release_slots(self._ledger.settled(member), self.topology.slot_bytes)
