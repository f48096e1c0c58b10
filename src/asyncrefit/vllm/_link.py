"""The coordinator's side of one vLLM engine: :class:`_EngineLink`, shared by its ranks.

A vLLM engine of tensor-parallel size N has N workers (ranks), and its RPCs are
collective: ``collective_rpc`` and ``update_weights`` run on every rank with the same
arguments. The coordinator, though, addresses each worker on its own (filtered handles,
per-worker acks, one :class:`~asyncrefit.vllm.VLLMWorker` per rank). The link bridges
the two: when every rank has asked for the same step (a bucket, a commit, ...; the
:class:`~._barrier.RankBarrier`), it writes each rank's request on that rank's own
channel and sends the engine one trigger RPC carrying only a request id
(:class:`~._channels.RankChannels`); each rank answers on its channel. With N = 1 a step
runs as soon as it is asked for.

What the engine owes between calls (generation paused, vLLM's update open, a prefix
cache holding KV of older weights, an abort not confirmed) is the
:class:`~._session.Session`'s to say: the link asks it for the steps of a begin, a
commit or an abort, and carries them out with the engine's ops (:mod:`._ops`), one at a
time, in order, reporting each back. A version the trainer writes directly opens no
vLLM update: its begin (the session's start), commit (its finish) and abort go to each
rank's control channel (:meth:`~._channels.RankChannels.control`), served by a thread of
the worker with no engine RPC; pausing, the cache reset and resuming stay engine calls.

A push is for the engine's weights or for one LoRA adapter (its *target*; the steps of
an adapter's push travel as :class:`~._wire.ToAdapter`, all on the control channels,
and its commit builds at every rank, then installs at every rank). Pushes of different
targets share the one session, so the link runs them one at a time: a push holds the
session from its begin to its commit or abort, and a begin of another target waits for
it; an abort of a target that does not hold it is left alone.

Errors: every failure reaches a rank as a :class:`~asyncrefit.WorkerError` naming it
(:func:`_translate`; a failure at another rank is a :class:`~asyncrefit.PeerWorkerError`
naming that rank). Cancellation and resources: begin, commit and abort take the session
lock; an abort and closing are shielded from cancellation, each engine call of theirs
bounded by the cleanup timeout, failures logged, and generation resumed on every path
(see :meth:`_EngineLink._abort_locked`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Hashable,
    Mapping,
)
from typing import Any, Literal

import anyio

from .._exceptions import (
    AsyncRefitError,
    EngineConfigError,
    PeerWorkerError,
    WorkerError,
    WorkerRemoteError,
    WorkerTimeoutError,
    primary_error,
    remote_error,
)
from .._wire._errors import WORKER
from .._wire._messages import (
    Aborted,
    AbortUpdate,
    BeginUpdate,
    CommitUpdate,
    DestinationsReply,
    Done,
    ErrorReply,
    GetDestinations,
    LoadBucket,
    Reply,
)
from ..transport.destinations import Destinations
from ._barrier import RankBarrier
from ._channels import ChannelStatistics, RankChannels
from ._ops import _EngineOps
from ._session import (
    AbortWorkers,
    EngineStep,
    Finish,
    Pause,
    Relabel,
    ResetCache,
    Resume,
    Session,
    Start,
)
from ._wire import BACKEND, EXTENSION, InstallAdapter, RankRequest, RemoveAdapter, ToAdapter

logger = logging.getLogger(__name__)


#: The default ``cleanup_timeout``: longer than a collective transport's receive (30 s)
#: and a frame's send (30 s), which an abort may wait behind in the engine, so that by
#: default an abort is answered rather than reported unconfirmed.
CLEANUP_TIMEOUT = 45.0


# --- error translation -------------------------------------------------------------


def _all_or_nothing(replies: dict[int, Reply]) -> dict[int, Reply] | None:
    """``None`` if every rank committed; otherwise every rank's reply as an error (the
    refusing ones' own, a ``PeerCommitError`` naming the first of them for the rest):
    no rank may count as committed while the session stays open (the coordinator
    aborts it)."""
    failed = {r: e for r, e in replies.items() if isinstance(e, ErrorReply)}
    if not failed:
        return None
    bad, error = min(failed.items())
    peer = ErrorReply(
        type="PeerCommitError",
        message=f"rank {bad} could not commit: {error.type}: {error.message}",
    )
    return {r: failed.get(r, peer) for r in replies}


def _translate(exc: BaseException, name: str, ranks: Collection[str] = ()) -> Exception:
    """``exc`` (from vLLM, or from a step of every rank) as a typed error of ``name``.

    A step runs on every rank of the engine: when it failed at another rank (one of
    ``ranks``), ``name`` gets a :class:`PeerWorkerError` naming that rank, not that
    rank's error under its own name.
    """
    if isinstance(exc, PeerWorkerError):
        if exc.peer == name:
            return WorkerRemoteError(name, exc.peer_error, exc.peer_detail)
        return PeerWorkerError(name, exc.peer, exc.peer_error, exc.peer_detail)
    if isinstance(exc, WorkerError):
        if exc.worker != name and exc.worker in ranks:
            return PeerWorkerError(name, exc.worker, type(exc).__name__, exc.detail)
        if isinstance(exc, WorkerRemoteError):
            return remote_error(name, exc.remote_type, exc.remote_message)
        return type(exc)(name, exc.detail)
    # The engine's own failures: the WORKER side of the one error map.
    if isinstance(exc, TimeoutError):
        return WORKER.timeout(name, f"the vLLM engine timed out: {exc}")
    if type(exc).__name__ == "EngineDeadError":
        return WORKER.died(name, f"the vLLM engine died: {exc}")
    if isinstance(exc, Exception):
        return WORKER.from_exception(name, exc)
    return WorkerRemoteError(name, "Interrupted", "the engine-wide step was interrupted")


def _wrap(request: RankRequest, adapter: str | None) -> RankRequest:
    """``request`` for the LoRA adapter ``adapter`` (``None``: the engine's weights)."""
    return request if adapter is None else ToAdapter(adapter=adapter, request=request)


def _target(key: Hashable) -> object:
    """The target of a step's key in the barrier: ``(adapter or None, step, ...)``."""
    return key[0] if isinstance(key, tuple) else None


def _unwrap(request: object) -> object:
    return request.request if isinstance(request, ToAdapter) else request


# --- the link ----------------------------------------------------------------------


class _EngineLink:
    """One engine's ranks: their channels, the barrier that gathers their steps, and
    the update session whose steps the link carries out with the engine's ops.

    ``name`` names the engine (its ranks are ``name/rank-<i>``); ``rpc_timeout``
    bounds connecting; ``cleanup`` bounds each engine call of an abort or the close.
    """

    def __init__(self, ops: _EngineOps, name: str, rpc_timeout: float, cleanup: float) -> None:
        self._ops = ops
        self.name = name
        self._rpc_timeout = rpc_timeout
        self._cleanup = cleanup
        config = ops.vllm_config
        self._check_config(config)
        self.world = int(config.parallel_config.world_size)
        self._channels = RankChannels(name, self.world, self.worker_name)
        self._session_lock = anyio.Lock()  # begin, commit and abort
        self._barrier: RankBarrier[RankRequest, Reply] = RankBarrier(
            self.world, self.worker_name, self.translate
        )
        # What the engine owes between calls (paused, an open update, a stale prefix
        # cache, an unconfirmed abort): the link carries out the steps it returns.
        self._session = Session()
        # Whether the open update is written directly by the trainer (begun so), and
        # the LoRA adapter it is for (None: the engine's weights).
        self._direct = False
        self._adapter: str | None = None
        # Pushes of the engine's weights and of each adapter run one at a time: the
        # target whose push holds the session (from its begin to its commit or abort).
        self._owner: tuple[str | None] | None = None
        self._owner_free = anyio.Event()

    def __repr__(self) -> str:
        dead = self._channels.dead
        state = f"dead ({dead})" if dead else "alive"
        return f"<vLLM engine link {self.name!r} ranks={self.world} {self._session!r} {state}>"

    @staticmethod
    def _check_config(config: Any) -> None:
        transfer = config.weight_transfer_config
        parallel = config.parallel_config
        if transfer is None or transfer.backend != BACKEND:
            raise EngineConfigError(
                f"the vLLM engine's weight_transfer_config backend is "
                f"{None if transfer is None else transfer.backend!r}, not {BACKEND!r}: "
                "start it with **asyncrefit.vllm.engine_args()"
            )
        if not parallel.worker_extension_cls:
            raise EngineConfigError(
                f"the vLLM engine has no worker_extension_cls ({EXTENSION!r} or a subclass): "
                "start it with **asyncrefit.vllm.engine_args()"
            )
        if int(getattr(parallel, "data_parallel_size", 1)) != 1:
            raise EngineConfigError("data parallel vLLM engines are not supported yet")

    def worker_name(self, rank: int) -> str:
        return f"{self.name}/rank-{rank}"

    async def _claim(self, target: str | None) -> None:
        """Wait until no push of another target holds the session, then hold it."""
        while self._owner is not None and self._owner != (target,):
            await self._owner_free.wait()
        self._owner = (target,)

    def _release(self, target: str | None) -> None:
        if self._owner == (target,):
            self._owner = None
            self._owner_free.set()
            self._owner_free = anyio.Event()

    def _holds(self, target: str | None) -> bool:
        return self._owner == (target,)

    def translate(self, exc: BaseException, rank: int) -> Exception:
        """``exc`` as the error of ``rank``; a failure of another rank names that rank."""
        names = [self.worker_name(r) for r in range(self.world)]
        return _translate(exc, self.worker_name(rank), names)

    def statistics(self, rank: int) -> ChannelStatistics:
        return self._channels.statistics(rank)

    # --- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        """Listen on a fresh socket, have every rank connect to it, match ranks."""
        try:
            with anyio.fail_after(self._rpc_timeout):
                await self._channels.open(functools.partial(self._init, self._rpc_timeout))
        except TimeoutError:
            raise WorkerTimeoutError(
                self.name, f"the engine's workers did not connect within {self._rpc_timeout} s"
            ) from None
        except BaseExceptionGroup as group:
            primary = primary_error(group)
            if primary is None:
                raise
            raise _translate(primary, self.name) from primary

    async def _init(self, read_timeout: float, path: str) -> None:
        await self._ops.init(path, read_timeout)

    async def aclose(self) -> None:
        """End an open session (resuming generation), release the workers' channels.

        Shielded from cancellation; waiting for a push to let go of the session, and
        every engine call, bounded by the cleanup timeout; errors of an engine that is
        gone are logged.
        """
        with anyio.CancelScope(shield=True):
            acquired = False
            with anyio.move_on_after(self._cleanup):  # a push that is still ending
                await self._session_lock.acquire()
                acquired = True
            if acquired:
                try:
                    await self._abort_locked(every_target=True)  # resumes generation
                except Exception as exc:
                    logger.warning("engine %s: the abort was not confirmed: %s", self.name, exc)
                finally:
                    if self._owner is not None:
                        self._release(self._owner[0])
                    self._session_lock.release()
            else:
                logger.error("engine %s: a push still holds the session; not aborted", self.name)
            if self._channels.connected:
                await self._bounded("closing the workers' channels", self._ops.shutdown)
            await self._channels.aclose()

    async def _exchange(
        self,
        requests: Mapping[int, RankRequest],
        via: Literal["serve", "update"],
    ) -> dict[int, Reply]:
        """Each rank's request on its channel, triggered by one engine-wide RPC.

        ``via`` is the trigger: ``"update"`` is vLLM's ``update_weights`` (inside a
        weight-update session), ``"serve"`` the extension's ``collective_rpc`` method.
        What vLLM carries to every worker: the ``update_info`` dict, or the args.
        """
        if via == "update":
            return await self._channels.exchange(
                requests, self._ops.update, lambda request_id: {"request_id": request_id}
            )
        return await self._channels.exchange(
            requests, self._ops.serve, lambda request_id: (request_id,)
        )

    # --- engine-wide steps, gathered from every rank ---------------------------------

    async def serve(self, rank: int, request: RankRequest) -> Reply:
        """A request outside weight updates (device, specs, version, release).

        These carry no handles and change no weights, so the same request goes to
        every rank (the trigger reaches every rank anyway) and no rank waits for the
        others to ask: any worker may be asked on its own.
        """
        try:
            replies = await self._exchange(dict.fromkeys(range(self.world), request), "serve")
        except Exception as exc:
            raise self.translate(exc, rank) from exc
        return replies[rank]

    async def destinations(self, rank: int) -> Destinations | None:
        """Every rank's exported parameters (each rank learns its copy plan the first
        time): ``rank``'s, or ``None`` unless every rank exported (an engine's ranks
        take the same steps, so they are all written directly or none is)."""
        try:
            replies = await self._exchange(
                dict.fromkeys(range(self.world), GetDestinations()), "serve"
            )
        except Exception as exc:
            raise self.translate(exc, rank) from exc
        found: dict[int, Destinations | None] = {}
        for r, reply in replies.items():
            if isinstance(reply, ErrorReply):
                raise self.translate(WORKER.from_reply(self.worker_name(r), reply), rank)
            if not isinstance(reply, DestinationsReply):
                raise WorkerRemoteError(
                    self.worker_name(r), "ProtocolError", f"got {type(reply).__name__}"
                )
            found[r] = reply.destinations
        if any(d is None for d in found.values()):
            return None
        return found[rank]

    async def begin(
        self, rank: int, version: int, *, direct: bool = False, adapter: str | None = None
    ) -> Reply:
        """Begin ``version`` of the engine's weights (``adapter`` ``None``) or of a LoRA
        adapter, once every rank asked; waits while a push of another target holds the
        session (it is held until this push's commit or abort)."""

        async def run(requests: dict[int, RankRequest]) -> dict[int, Reply]:
            modes = {r: _unwrap(q) for r, q in requests.items()}
            if len({isinstance(q, BeginUpdate) and q.direct for q in modes.values()}) > 1:
                staged = sorted(r for r, q in modes.items() if not getattr(q, "direct", False))
                raise AsyncRefitError(
                    f"engine {self.name}: ranks {staged} were planned staged and the others "
                    "direct; an engine's ranks are written one way"
                )
            await self._claim(adapter)
            async with self._session_lock:
                if self._session.must_abort:
                    await self._abort_locked()  # an earlier push was never ended
                self._barrier.drop(lambda key: _target(key) == adapter)
                self._direct = direct
                self._adapter = adapter
                # Each asked for before its call: if the call fails or is cancelled, the
                # abort that follows ends whatever was started, then resumes generation.
                replies: dict[int, Reply] | None = None
                for step in self._session.begin(version):
                    self._session.asking(step)
                    if self._by_control and isinstance(step, Start):
                        # No engine RPC: each rank's control thread begins (vLLM's own
                        # weight update stays closed; an adapter's push never opens it).
                        replies = await self._channels.control(requests)
                    else:
                        await self._call(step)
                    self._session.done(step)
                if replies is None:
                    replies = await self._exchange(requests, "update")
                return replies

        request = _wrap(BeginUpdate(version=version, direct=direct), adapter)
        return await self._barrier.gather((adapter, "begin", version), rank, request, run)

    @property
    def _by_control(self) -> bool:
        """Whether the open session's steps go to the ranks' control channels (a direct
        version, an adapter's push) rather than through vLLM's weight update."""
        return self._direct or self._adapter is not None

    async def load(self, rank: int, request: LoadBucket, *, adapter: str | None = None) -> Reply:
        async def run(requests: dict[int, RankRequest]) -> dict[int, Reply]:
            if adapter is not None:
                if not self._holds(adapter):
                    raise AsyncRefitError(f"LoRA adapter {adapter!r} has no push open")
                return await self._channels.control(requests)
            return await self._exchange(requests, "update")

        key = (adapter, "load", request.version, request.bucket)
        return await self._barrier.gather(key, rank, _wrap(request, adapter), run)

    async def commit(
        self, rank: int, version: int, buckets: int, *, adapter: str | None = None
    ) -> Reply:
        async def run(requests: dict[int, RankRequest]) -> dict[int, Reply]:
            async with self._session_lock:
                if not (self._holds(adapter) and self._session.receiving(version)):
                    raise AsyncRefitError(f"version {version} is not being received")
                if adapter is not None:
                    replies = await self._commit_adapter(requests, version, adapter)
                elif self._direct:
                    replies = await self._commit_direct(requests, version)
                else:
                    replies = await self._commit_staged(requests, version)
                if not any(isinstance(r, ErrorReply) for r in replies.values()):
                    self._release(adapter)  # committed: the next push may begin
                return replies

        request = _wrap(CommitUpdate(version=version, buckets=buckets), adapter)
        return await self._barrier.gather((adapter, "commit", version), rank, request, run)

    async def _commit_staged(
        self, requests: dict[int, RankRequest], version: int
    ) -> dict[int, Reply]:
        steps = self._session.commit(version)
        replies = await self._exchange(requests, "update")
        if (refused := _all_or_nothing(replies)) is not None:
            return refused
        # Finish (the label), then reset the cache: the label and the cache move
        # together, no block computed with older weights is reused once generation
        # resumes. A step that fails leaves it asked for: still paused, the push
        # fails, and the abort that follows ends it.
        for step in steps:
            self._session.asking(step)
            try:
                await self._call(step)
            except Exception as exc:
                if isinstance(step, Finish):
                    raise
                raise self._failed_after_commit(version, step.what, exc) from exc
            self._session.done(step)
        return replies

    async def _commit_adapter(
        self, requests: dict[int, RankRequest], version: int, adapter: str
    ) -> dict[int, Reply]:
        """Commit a version of a LoRA adapter: every rank builds it (nothing served
        changes), then, only if every rank could, every rank installs it; the prefix
        cache is reset and generation resumed (the engine's label is the weights', and
        stays). An install that fails at a rank takes the adapter out at every rank:
        none serves it, rather than ranks serving different versions. The installs and
        that removal are shielded from cancellation, each bounded by the cleanup
        timeout. From the installs on, a failure leaves the cache stale (reset before
        generation resumes)."""
        finish, reset, resume = self._session.commit(version)
        replies = await self._channels.control(requests)  # each rank builds it
        if (refused := _all_or_nothing(replies)) is not None:
            return refused
        self._session.asking(finish)  # from here on the served adapter may change
        installs: dict[int, RankRequest] = {
            r: ToAdapter(adapter=adapter, request=InstallAdapter(version=version)) for r in requests
        }
        with anyio.CancelScope(shield=True):
            installed: dict[int, Reply] | None = None
            with anyio.move_on_after(self._cleanup):
                installed = await self._channels.control(installs)
            refused = None if installed is None else _all_or_nothing(installed)
            if installed is None or refused is not None:
                await self._remove_adapter(adapter, list(requests))
            if installed is None:
                raise WorkerTimeoutError(
                    self.name,
                    f"the install of version {version} of LoRA adapter {adapter!r} got no "
                    f"answer within {self._cleanup} s",
                )
            if refused is not None:
                return refused
        assert installed is not None  # (the shield swallows no error)
        self._session.done(finish)
        for step in (reset, resume):
            self._session.asking(step)
            try:
                await self._call(step)
            except Exception as exc:
                raise self._failed_after_commit(version, step.what, exc) from exc
            self._session.done(step)
        return installed

    async def _remove_adapter(self, adapter: str, ranks: list[int]) -> None:
        """Take ``adapter`` out at every rank (an install failed at one): none serves
        it, rather than ranks serving different versions. Bounded by the cleanup
        timeout; a failure is logged (the abort that follows fails the push anyway)."""
        removals: dict[int, RankRequest] = {
            r: ToAdapter(adapter=adapter, request=RemoveAdapter()) for r in ranks
        }
        removed: dict[int, Reply] | None = None
        with anyio.move_on_after(self._cleanup):
            removed = await self._channels.control(removals)
        if removed is None or any(not isinstance(r, Done) for r in removed.values()):
            logger.error(
                "engine %s: LoRA adapter %r could not be taken out of every rank after a "
                "failed install: %s",
                self.name,
                adapter,
                removed if removed is not None else f"no answer within {self._cleanup} s",
            )

    async def _commit_direct(
        self, requests: dict[int, RankRequest], version: int
    ) -> dict[int, Reply]:
        """Commit a direct version: each rank's control thread waits for the trainer's
        writes, commits and ends its update (a rank ends it only if it committed), with
        no engine RPC; the engine's cache reset and its label run meanwhile; then the
        resume.

        The commit is asked as the session's finish, so a failure from here on labels
        the engine incomplete. The reset and the label may run with the ranks:
        generation is paused and every write was issued before the commit, so no block
        is computed and no output labelled until generation resumes, and a reset now
        leaves none made with older weights. If a rank refuses, or the label or the
        reset fails, the push fails and its abort labels the engine
        ``incomplete-<version>`` and resets again before resuming: while paused, the
        label may read ``version`` a moment before that. A step that fails leaves it
        asked for, as in :meth:`commit`.
        """
        finish, reset, resume = self._session.commit(version)
        self._session.asking(finish)
        failed: dict[str, Exception] = {}

        async def engine_step(what: str, call: Callable[[], Awaitable[None]]) -> None:
            try:
                await call()
            except Exception as exc:
                failed[what] = exc

        label = functools.partial(self._ops.set_label, str(version))
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine_step, reset.what, functools.partial(self._call, reset))
            tg.start_soon(engine_step, "labelling it", label)
            replies = await self._channels.control(requests)
        if (refused := _all_or_nothing(replies)) is not None:
            return refused
        if (unlabelled := failed.get("labelling it")) is not None:
            raise self._failed_after_commit(version, "labelling it", unlabelled) from unlabelled
        self._session.done(finish)
        self._session.asking(reset)  # it ran while the ranks committed
        if (unreset := failed.get(reset.what)) is not None:
            raise self._failed_after_commit(version, reset.what, unreset) from unreset
        self._session.done(reset)
        self._session.asking(resume)
        try:
            await self._call(resume)
        except Exception as exc:
            raise self._failed_after_commit(version, resume.what, exc) from exc
        self._session.done(resume)
        return replies

    def _failed_after_commit(self, version: int, what: str, exc: Exception) -> WorkerRemoteError:
        return WorkerRemoteError(
            self.name, type(exc).__name__, f"version {version} is in, but {what} failed: {exc}"
        )

    async def abort(
        self, rank: int, version: int, *, adapter: str | None = None, unwritten: bool = False
    ) -> None:
        """End the engine's session, whichever rank asks first; never waits for others.

        ``unwritten``: the coordinator says the trainer wrote no byte of the direct
        ``version`` (see :meth:`VLLMWorker.abort_unwritten`): the ranks hold the version
        they held before its begin again, so the engine keeps its label and cache.

        Returns once no rank reads a trainer buffer any more, or raises if that could
        not be confirmed (the next abort asks again). Generation is resumed whatever
        else fails: see :meth:`_abort_locked`. A push of another target (the weights, or
        another adapter) holding the session is left alone: nothing of ``adapter``'s
        is open then.
        """
        async with self._session_lock:
            if not self._holds(adapter):
                if self._owner is None and self._adapter == adapter:
                    await self._abort_locked()  # confirm an earlier abort, resume
                return
            try:
                await self._abort_locked(unwritten=unwritten)
            finally:
                self._release(adapter)

    async def _abort_locked(self, *, every_target: bool = False, unwritten: bool = False) -> None:
        """Abort the open session (or confirm an earlier abort), end vLLM's weight
        update, label the engine incomplete if bytes were written, resume generation.

        Shielded from cancellation: once begun, every step is taken, each engine call
        bounded by the cleanup timeout. The engine runs its calls in order, so a call
        that timed out here still comes before the ones after it (the abort before the
        finish, the finish before the resume). The session forgets what is owed only
        once the step that settles it is done: the open update once vLLM's update was
        ended, the pause once a resume succeeded (a failed one is retried by the next
        abort or close).
        """
        target = self._adapter
        self._barrier.drop(None if every_target else lambda key: _target(key) == target)
        unconfirmed: Exception | None = None
        with anyio.CancelScope(shield=True):
            try:
                for ask in self._session.abort():
                    # Only the open direct version can be unwritten (not an earlier
                    # abort being confirmed).
                    unwritten_ask = (
                        unwritten and self._direct and ask.version == self._session.version
                    )
                    unconfirmed = await self._end_update(ask, unwritten=unwritten_ask)
            finally:
                await self._clean_up(self._session.resume())
        if unconfirmed is not None:
            raise unconfirmed

    async def _end_update(self, ask: AbortWorkers, *, unwritten: bool = False) -> Exception | None:
        """The abort exchange, then (if an update is open) vLLM's finish and the label;
        returns why the abort is unconfirmed, or ``None``."""
        version = ask.version
        self._session.asking(ask)
        unconfirmed: Exception | None = None
        written = False
        requests: dict[int, RankRequest] = {
            r: _wrap(AbortUpdate(version=version, unwritten=unwritten), self._adapter)
            for r in range(self.world)
        }
        try:
            with anyio.fail_after(self._cleanup):
                if self._by_control:  # the control threads abort (and end their update)
                    replies = await self._channels.control(requests)
                else:
                    replies = await self._exchange(requests, "serve")
        except Exception as exc:
            unconfirmed = exc  # and written, unless every rank says otherwise
            if isinstance(exc, TimeoutError):
                unconfirmed = WorkerTimeoutError(
                    self.name,
                    f"the abort of version {version} got no answer within "
                    f"{self._cleanup} s (it stays queued in the engine)",
                )
        else:
            # Any reply, an error included, comes after every earlier request of that
            # rank was handled: no rank reads a trainer buffer any more.
            written = not all(
                isinstance(reply, Aborted) and not reply.written for reply in replies.values()
            )
        steps = self._session.aborted(confirmed=unconfirmed is None, written=written)
        if self._adapter is not None:  # the engine's label is its weights': it stays
            steps = tuple(step for step in steps if not isinstance(step, Relabel))
        await self._clean_up(steps)
        return unconfirmed

    async def _clean_up(self, steps: tuple[EngineStep, ...]) -> None:
        """Carry out cleanup steps, each bounded by the cleanup timeout, failures logged
        (the session says what a failure takes next)."""
        pending = list(steps)
        while pending:
            step = pending.pop(0)
            self._session.asking(step)
            if await self._bounded(step.what, functools.partial(self._call, step)):
                self._session.done(step)
            else:
                pending[:0] = self._session.failed(step)

    async def _call(self, step: EngineStep) -> None:
        """The engine call that carries out ``step``."""
        ops = self._ops
        match step:
            case Pause():
                await ops.pause()
            case Start():
                await ops.start()
            case Finish(label=None) if self._by_control:
                pass  # each rank's control thread ended its update with the abort
            case Finish(label=label):
                await ops.finish(label)
            case ResetCache():
                await ops.reset_cache()
            case Resume():
                await ops.resume()
            case Relabel(label=label):
                await ops.set_label(label)

    async def _bounded(self, what: str, call: Callable[[], Awaitable[None]]) -> bool:
        """One engine call of a cleanup, at most the cleanup timeout; failures logged."""
        try:
            with anyio.fail_after(self._cleanup):
                await call()
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                exc = TimeoutError(f"no answer within {self._cleanup} s")
            logger.error("engine %s: %s failed: %s", self.name, what, exc)
            return False
        return True
