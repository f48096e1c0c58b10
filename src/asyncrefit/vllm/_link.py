"""The coordinator's side of a vLLM engine: one :class:`VLLMWorker` per vLLM worker.

A vLLM engine of tensor-parallel size N has N workers (ranks), and its RPCs are
collective: ``collective_rpc`` and ``update_weights`` run on every rank with the same
arguments. The coordinator, though, addresses each worker on its own (filtered handles,
per-worker acks). :class:`_EngineLink` bridges the two: when every rank's
:class:`VLLMWorker` has asked for the same step (a bucket, a commit, ...), it writes
each rank's request on that rank's own channel and sends the engine one trigger RPC
carrying only a request id; each rank answers on its channel. With N = 1 a step runs
as soon as it is asked for.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
)
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import anyio

from .._device import DeviceId
from .._exceptions import (
    AsyncRefitError,
    PeerWorkerError,
    WorkerDiedError,
    WorkerError,
    WorkerRemoteError,
    WorkerTimeoutError,
    primary_error,
    remote_error,
)
from .._messages import (
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    DeviceReply,
    Done,
    ErrorReply,
    GetSpecs,
    GetVersion,
    LoadBucket,
    ReleaseHandles,
    ReportDevice,
    Request,
    SpecsReply,
    VersionReply,
)
from .._plan import ParamSpec
from ..transport._base import Handle
from ._barrier import RankBarrier
from ._channels import Answer, ChannelStatistics, RankChannels
from ._ops import EngineLoopError as EngineLoopError
from ._ops import PauseMode as PauseMode
from ._ops import _AsyncLLMOps, _EngineOps, _LLMOps
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
from ._wire import BACKEND, EXTENSION, Aborted

logger = logging.getLogger(__name__)

R = TypeVar("R")


#: The default ``cleanup_timeout``: longer than a collective transport's receive (30 s)
#: and a frame's send (30 s), which an abort may wait behind in the engine, so that by
#: default an abort is answered rather than reported unconfirmed.
CLEANUP_TIMEOUT = 45.0


class EngineConfigError(AsyncRefitError):
    """The vLLM engine was not started with asyncrefit's engine arguments."""


# --- error translation -------------------------------------------------------------


def _translate(exc: BaseException, name: str, ranks: Collection[str] = ()) -> WorkerError:
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
    if isinstance(exc, TimeoutError):
        return WorkerTimeoutError(name, f"the vLLM engine timed out: {exc}")
    if type(exc).__name__ == "EngineDeadError":
        return WorkerDiedError(name, f"the vLLM engine died: {exc}")
    if isinstance(exc, Exception):
        return WorkerRemoteError(name, type(exc).__name__, str(exc))
    return WorkerRemoteError(name, "Interrupted", "the engine-wide step was interrupted")


def _reply_of(reply: Answer, name: str, kind: type[R]) -> R:
    if isinstance(reply, ErrorReply):
        raise remote_error(name, reply.type, reply.message)
    if not isinstance(reply, kind):
        raise WorkerRemoteError(
            name, "ProtocolError", f"expected {kind.__name__}, got {type(reply).__name__}"
        )
    return reply


# --- the link ----------------------------------------------------------------------


class _EngineLink:
    """Channels to every worker of one engine, and the engine-wide steps over them."""

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
        self._barrier: RankBarrier[Request, Answer] = RankBarrier(
            self.world, self.worker_name, self.translate
        )
        # What the engine owes between calls (paused, an open update, a stale prefix
        # cache, an unconfirmed abort): the link carries out the steps it returns.
        self._session = Session()
        self.workers = [VLLMWorker(self, rank) for rank in range(self.world)]

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

    def translate(self, exc: BaseException, rank: int) -> WorkerError:
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
                    await self._abort_locked()  # resumes generation, even if dead
                except Exception as exc:
                    logger.warning("engine %s: the abort was not confirmed: %s", self.name, exc)
                finally:
                    self._session_lock.release()
            else:
                logger.error("engine %s: a push still holds the session; not aborted", self.name)
            if self._channels.connected:
                await self._bounded("closing the workers' channels", self._ops.shutdown)
            await self._channels.aclose()

    async def _exchange(
        self, requests: Mapping[int, Request], via: Literal["serve", "update"]
    ) -> dict[int, Answer]:
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

    async def serve(self, rank: int, request: Request) -> Answer:
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

    async def begin(self, rank: int, version: int) -> Answer:
        async def run(requests: dict[int, Request]) -> dict[int, Answer]:
            async with self._session_lock:
                if self._session.must_abort:
                    await self._abort_locked()  # an earlier push was never ended
                self._barrier.drop()
                # Each asked for before its call: if the call fails or is cancelled, the
                # abort that follows ends whatever was started, then resumes generation.
                for step in self._session.begin(version):
                    self._session.asking(step)
                    await self._call(step)
                    self._session.done(step)
                return await self._exchange(requests, "update")

        request = BeginUpdate(version=version)
        return await self._barrier.gather(("begin", version), rank, request, run)

    async def load(self, rank: int, request: LoadBucket) -> Answer:
        async def run(requests: dict[int, Request]) -> dict[int, Answer]:
            return await self._exchange(requests, "update")

        key = ("load", request.version, request.bucket)
        return await self._barrier.gather(key, rank, request, run)

    async def commit(self, rank: int, version: int, buckets: int) -> Answer:
        async def run(requests: dict[int, Request]) -> dict[int, Answer]:
            async with self._session_lock:
                if not self._session.receiving(version):
                    raise AsyncRefitError(f"version {version} is not being received")
                replies = await self._exchange(requests, "update")
                failed = {r: e for r, e in replies.items() if isinstance(e, ErrorReply)}
                if failed:
                    # All or nothing: no rank may count as committed while the session
                    # stays open (the coordinator aborts it).
                    bad, error = min(failed.items())
                    peer = ErrorReply(
                        type="PeerCommitError",
                        message=f"rank {bad} could not commit: {error.type}: {error.message}",
                    )
                    return {r: failed.get(r, peer) for r in replies}
                # Finish (the label), then reset the cache: the label and the cache move
                # together, no block computed with older weights is reused once
                # generation resumes. A step that fails leaves it asked for: still
                # paused, the push fails, and the abort that follows ends it.
                for step in self._session.commit(version):
                    self._session.asking(step)
                    try:
                        await self._call(step)
                    except Exception as exc:
                        if isinstance(step, Finish):
                            raise
                        raise WorkerRemoteError(
                            self.name,
                            type(exc).__name__,
                            f"version {version} is in, but {step.what} failed: {exc}",
                        ) from exc
                    self._session.done(step)
                return replies

        request = CommitUpdate(version=version, buckets=buckets)
        return await self._barrier.gather(("commit", version), rank, request, run)

    async def abort(self, rank: int, version: int) -> None:
        """End the engine's session, whichever rank asks first; never waits for others.

        Returns once no rank reads a trainer buffer any more, or raises if that could
        not be confirmed (the next abort asks again). Generation is resumed whatever
        else fails: see :meth:`_abort_locked`.
        """
        async with self._session_lock:
            await self._abort_locked()

    async def _abort_locked(self) -> None:
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
        self._barrier.drop()
        unconfirmed: Exception | None = None
        with anyio.CancelScope(shield=True):
            try:
                for ask in self._session.abort():
                    unconfirmed = await self._end_update(ask)
            finally:
                await self._clean_up(self._session.resume())
        if unconfirmed is not None:
            raise unconfirmed

    async def _end_update(self, ask: AbortWorkers) -> Exception | None:
        """The abort exchange, then (if an update is open) vLLM's finish and the label;
        returns why the abort is unconfirmed, or ``None``."""
        version = ask.version
        self._session.asking(ask)
        unconfirmed: Exception | None = None
        written = False
        try:
            with anyio.fail_after(self._cleanup):
                replies = await self._exchange(
                    {r: AbortUpdate(version=version) for r in range(self.world)}, "serve"
                )
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


class VLLMWorker:
    """One vLLM worker (one rank of one engine), as the coordinator sees it.

    Implements :class:`asyncrefit.Worker`. Made by :func:`connect_async_llm` or
    :func:`connect_llm`, one per rank. Each rank is sent only its own device's handle,
    on its own channel; the engine-wide RPC that tells the workers to read their
    channels carries only a request id. Steps that vLLM runs on every rank at once
    (begin, each bucket, commit) run when every rank's worker has asked for them, so
    the workers of one engine must be pushed to together (the coordinator does).

    A push pauses generation at begin (``AsyncLLM``, in the mode given), starts vLLM's
    weight update, loads every bucket through ``update_weights``, finishes the update
    with the version as the engine's weight version, and resumes generation.

    Error handling: a failure inside the worker raises :class:`WorkerRemoteError`
    naming this worker; a dead engine or broken channel :class:`WorkerDiedError`; a
    step that failed at another rank of the engine :class:`~asyncrefit.PeerWorkerError`
    naming that rank. A commit is refused with
    :class:`~asyncrefit.WorkerStaleWeightsError` when part of the model could not follow
    the pushed weights. An abort (which the coordinator sends after any failure) ends
    vLLM's update session and always resumes generation (see
    :func:`connect_async_llm`); if bytes of the new version were written, or finishing
    the update failed, the engine's weight version becomes ``"incomplete-<version>"``.
    """

    def __init__(self, link: _EngineLink, rank: int) -> None:
        self._link = link
        self._rank = rank
        self._name = link.worker_name(rank)

    def __repr__(self) -> str:
        return f"<VLLMWorker {self._name!r} rank={self._rank}>"

    @property
    def name(self) -> str:
        return self._name

    @property
    def rank(self) -> int:
        return self._rank

    def statistics(self) -> ChannelStatistics:
        """Bytes this worker's channel carried so far (handles included)."""
        return self._link.statistics(self._rank)

    async def report_device_id_async(self) -> DeviceId:
        """Asks the vLLM worker, through ``collective_rpc`` awaited on the engine's loop."""
        reply = await self._link.serve(self._rank, ReportDevice())
        return _reply_of(reply, self._name, DeviceReply).device

    async def parameter_specs(self) -> tuple[ParamSpec, ...]:
        """The checkpoint names, shapes and the engine's dtype the model loads."""
        reply = await self._link.serve(self._rank, GetSpecs())
        return _reply_of(reply, self._name, SpecsReply).specs

    async def begin_update(self, version: int) -> None:
        reply = await self._link.begin(self._rank, version)
        _reply_of(reply, self._name, Done)

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        request = LoadBucket(version=version, bucket=bucket, handles=handles)
        return _reply_of(await self._link.load(self._rank, request), self._name, BucketAck)

    async def commit_update(self, version: int, buckets: int) -> None:
        reply = await self._link.commit(self._rank, version, buckets)
        _reply_of(reply, self._name, Done)

    async def abort_update(self, version: int) -> None:
        try:
            await self._link.abort(self._rank, version)
        except Exception as exc:
            raise self._link.translate(exc, self._rank) from exc

    async def weight_version(self) -> int | None:
        reply = await self._link.serve(self._rank, GetVersion())
        return _reply_of(reply, self._name, VersionReply).version

    async def release_handles(self) -> None:
        reply = await self._link.serve(self._rank, ReleaseHandles())
        _reply_of(reply, self._name, Done)


@asynccontextmanager
async def _connected(link: _EngineLink) -> AsyncIterator[list[VLLMWorker]]:
    try:
        await link.open()
        yield list(link.workers)
    finally:
        await link.aclose()


@asynccontextmanager
async def connect_async_llm(
    engine: Any,
    *,
    pause_mode: PauseMode = "keep",
    name: str = "vllm",
    rpc_timeout: float = 60.0,
    cleanup_timeout: float = CLEANUP_TIMEOUT,
) -> AsyncIterator[list[VLLMWorker]]:
    """Connect to a running ``vllm.AsyncLLM``; yields one :class:`VLLMWorker` per rank.

    Enter it on the event loop that owns ``engine`` (the loop it was created on):
    every engine call is awaited there, and a call from another loop or thread raises
    :class:`EngineLoopError`. The engine must have been started with
    :func:`engine_args` (else :class:`EngineConfigError`).

    Generation may go on during pushes: each push pauses it with
    ``pause_generation(mode=pause_mode)`` — ``"abort"`` ends requests in flight,
    ``"wait"`` lets them finish first (the coordinator's timeout then bounds how
    long), ``"keep"`` freezes them and continues them on the new weights — and
    resumes it when the push ends, also when it fails.

    No KV computed with older weights is used after a push: the pause clears the
    prefix cache, and once the new weights are in (or a failed push wrote some bytes)
    the prefix cache is reset again before generation resumes, together with the
    engine's weight version. Requests frozen by ``"keep"`` are preempted by that
    reset: they keep the tokens generated so far and recompute their KV on the new
    weights. (There is no way to keep the cache: it would serve tokens of the old
    weights.) If vLLM cannot reset its cache, the push fails and the engine's weight
    version becomes ``"stale-cache"``.

    Resource handling: entering opens one Unix socket that every rank connects to;
    exiting ends any open update session, resumes generation, asks the workers to
    close their channels and handle mappings (``shutdown_weight_transfer_engine``),
    and removes the socket, shielded from cancellation. It does not shut the engine
    down.

    Cleanup is bounded per engine call: an abort (which the coordinator sends after a
    failed or cancelled push) and exiting wait at most ``cleanup_timeout`` for each of
    the abort exchange, vLLM's ``finish_weight_update``, the relabelling and
    ``resume_generation``, and run to their end even when the coordinator's own
    ``cleanup_timeout`` (or a cancellation) cuts its wait short: generation is resumed
    on every path. The engine runs its calls in order, so a call that timed out still
    comes before those after it. A resume that fails is retried by the next abort and
    on exit; a commit whose resume fails fails the push (its weights are in).

    Error handling: :class:`EngineConfigError` and :class:`EngineLoopError` before
    anything is sent; :class:`~asyncrefit.WorkerTimeoutError` if the workers do not
    connect within ``rpc_timeout``; vLLM's own errors as
    :class:`~asyncrefit.WorkerRemoteError` (a dead engine:
    :class:`~asyncrefit.WorkerDiedError`). See :class:`VLLMWorker` for pushes.
    """
    link = _EngineLink(_AsyncLLMOps(engine, pause_mode), name, rpc_timeout, cleanup_timeout)
    async with _connected(link) as workers:
        yield workers


@asynccontextmanager
async def connect_llm(
    llm: Any,
    *,
    name: str = "vllm",
    rpc_timeout: float = 60.0,
    cleanup_timeout: float = CLEANUP_TIMEOUT,
) -> AsyncIterator[list[VLLMWorker]]:
    """Connect to a ``vllm.LLM``; yields one :class:`VLLMWorker` per rank.

    ``LLM`` is synchronous: each of its calls runs in a worker thread, one at a time,
    so the coordinator's loop keeps running; each is bounded by ``rpc_timeout``. Do not
    call ``llm.generate`` from another thread during a push: nothing pauses it. The
    engine must have been started with :func:`engine_args`. Once the new weights are
    in (or a failed push wrote some), the prefix cache is reset, so that the next
    ``generate`` computes no token from KV of older weights.

    Resource handling and error handling: as :func:`connect_async_llm`.
    """
    link = _EngineLink(_LLMOps(llm, rpc_timeout), name, rpc_timeout, cleanup_timeout)
    async with _connected(link) as workers:
        yield workers


def engine_args() -> dict[str, Any]:
    """The engine arguments asyncrefit needs, for ``vllm.LLM(...)`` or ``AsyncEngineArgs``.

    ``worker_extension_cls`` makes vLLM load :mod:`asyncrefit.vllm.worker` into every
    worker (which registers the weight-transfer backend), ``weight_transfer_config``
    selects that backend.
    """
    return {"worker_extension_cls": EXTENSION, "weight_transfer_config": {"backend": BACKEND}}
