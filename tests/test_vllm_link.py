"""The coordinator's side of a vLLM engine, against a fake engine (no vLLM needed).

:class:`FakeEngine` stands in for an ``AsyncLLM``: its calls (pause, start, the
triggers, finish, resume, ...) run one at a time, in the order they were made, on the
engine's own task, and a caller that stops waiting does not stop a call (as vLLM's
engine core runs utility calls). Each rank is a fake worker on the link's channel that
answers the requests written for it, and serves its control channel (direct versions)
as requests arrive, with no engine call. The tests break the engine at chosen points and
check that generation is resumed on every path, that vLLM's weight update is ended
before it is, and that errors name the rank that failed.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch
from anyio.abc import SocketStream

from asyncrefit import (
    DeviceId,
    LocalTrainer,
    PeerWorkerError,
    PushError,
    RefitCoordinator,
    WorkerDiedError,
    WorkerIntegrityError,
    WorkerRemoteError,
    WorkerTimeoutError,
    local_node_id,
)
from asyncrefit._core._plan import ParamSpec
from asyncrefit._exceptions import primary_error
from asyncrefit._wire._framing import FrameReader
from asyncrefit._wire._messages import (
    Aborted,
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    DestinationsReply,
    DeviceReply,
    Done,
    ErrorReply,
    GetDestinations,
    GetSpecs,
    GetVersion,
    LoadBucket,
    ReleaseHandles,
    ReportDevice,
    SpecsReply,
    VersionReply,
)
from asyncrefit._wire._refs import RefDecoder
from asyncrefit.transport._base import dtype_name
from asyncrefit.vllm import VLLMAdapterWorker, VLLMWorker
from asyncrefit.vllm._connect import _connected
from asyncrefit.vllm._link import _EngineLink, _translate
from asyncrefit.vllm._lora import LoRAAdapter
from asyncrefit.vllm._wire import (
    BACKEND,
    EXTENSION,
    ControlHello,
    DeclareAdapter,
    InstallAdapter,
    RemoveAdapter,
    ToAdapter,
    pack,
)
from asyncrefit.vllm._wire import RankHello as Hello

pytestmark = pytest.mark.timeout(30)

Hook = Callable[[], Awaitable[None]]


class FakeWorker:
    """One rank: answers the requests of its channel; ``before`` runs a hook first."""

    def __init__(self, rank: int, specs: tuple[ParamSpec, ...]) -> None:
        self.rank = rank
        self.specs = specs
        self.stream: SocketStream | None = None
        self.reader: FrameReader | None = None
        self.seen: list[str] = []
        self.before: dict[str, Hook] = {}
        self.version: int | None = None
        self.pending: int | None = None
        self.refs = RefDecoder()  # loads come by reference, as to a real worker
        self.control: SocketStream | None = None
        # What the control channel carried; a kind in ``fail`` is answered with an
        # error, once.
        self.controlled: list[str] = []
        self.fail: set[str] = set()
        # Called when a direct version begins (the trainer may write from then on),
        # and when an adapter is installed or taken out.
        self.direct_begun: Callable[[], None] = lambda: None
        # Each LoRA adapter's (served version, pending version, built).
        self.adapters: dict[str, tuple[int | None, int | None, bool]] = {}

    async def connect(self, path: str) -> None:
        self.stream = await anyio.connect_unix(path)
        self.reader = FrameReader(self.stream)
        await self.stream.send(pack(0, Hello(rank=self.rank, pid=os.getpid())))
        self.control = await anyio.connect_unix(path)
        await self.control.send(pack(0, ControlHello(rank=self.rank, pid=os.getpid())))

    async def serve_control(self) -> None:
        """The worker's control thread: every request answered as it arrives."""
        assert self.control is not None
        reader, stream = FrameReader(self.control), self.control
        try:
            while True:
                request_id, request = RefDecoder().decode(await reader.receive())
                kind = type(request).__name__
                if isinstance(request, ToAdapter):
                    kind = f"{request.adapter}:{type(request.request).__name__}"
                self.controlled.append(kind)
                if isinstance(request, BeginUpdate) and request.direct:
                    self.direct_begun()
                hook = self.before.pop(kind, None)
                if hook is not None:
                    await hook()
                reply: object = ErrorReply(type="RuntimeError", message=f"{kind} failed (injected)")
                if kind in self.fail:
                    self.fail.discard(kind)  # once
                else:
                    reply = self.reply(request)
                await stream.send(pack(request_id, reply))
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def close(self) -> None:
        for stream in (self.stream, self.control):
            if stream is not None:
                await stream.aclose()
        self.stream = self.control = None

    async def handle(self, request_id: int) -> None:
        if self.stream is None or self.reader is None:
            return  # no channel: a real worker logs it and returns
        while True:
            got, request = self.refs.decode(await self.reader.receive())
            if got == request_id:
                break
        kind = type(request).__name__
        self.seen.append(kind)
        hook = self.before.pop(kind, None)
        if hook is not None:
            await hook()
        if self.stream is None:
            return
        await self.stream.send(pack(request_id, self.reply(request)))

    def reply(self, request: object) -> object:
        if isinstance(request, ToAdapter):
            return self.adapter_reply(request.adapter, request.request)
        if isinstance(request, DeclareAdapter):
            tensors = request.adapter.tensors.items()
            specs = (ParamSpec(name=n, shape=s, dtype="float32") for n, s in tensors)
            return SpecsReply(specs=tuple(specs))
        match request:
            case ReportDevice():
                return DeviceReply(device=DeviceId(node=local_node_id(), device=f"cpu:{self.rank}"))
            case GetSpecs():
                return SpecsReply(specs=self.specs)
            case BeginUpdate(version=v):
                self.pending = v
                return Done()
            case LoadBucket(bucket=b, handles=handles):
                self.version = None
                nbytes = sum(e.nbytes for e in handles[0].entries) if handles else 0
                return BucketAck(bucket=b, nbytes=nbytes, seconds=0.0)
            case CommitUpdate(version=v):
                self.version, self.pending = v, None
                return Done()
            case AbortUpdate():
                written = self.pending is not None and self.version is None
                self.pending = None
                return Aborted(version=self.version, written=written)
            case GetVersion():
                return VersionReply(version=self.version)
            case ReleaseHandles():
                return Done()
            case GetDestinations():
                return DestinationsReply(destinations=None)  # staged, as the CPU build
        raise AssertionError(f"unexpected request {request!r}")

    def adapter_reply(self, name: str, request: object) -> object:
        version, pending, built = self.adapters.get(name, (None, None, False))
        reply: object = Done()
        match request:
            case BeginUpdate(version=v):
                pending, built = v, False
            case LoadBucket(bucket=b, handles=handles):
                nbytes = sum(e.nbytes for e in handles[0].entries) if handles else 0
                reply = BucketAck(bucket=b, nbytes=nbytes, seconds=0.0)
            case CommitUpdate(version=v):
                assert pending == v
                built = True
            case InstallAdapter(version=v):
                assert built and pending == v
                version, pending, built = v, None, False
                self.direct_begun()  # what the engine serves changed
            case RemoveAdapter():
                version = pending = None
                self.direct_begun()
            case AbortUpdate():
                pending, built = None, False
                reply = Aborted(version=version, written=False)
            case GetVersion():
                reply = VersionReply(version=version)
            case _:
                raise AssertionError(f"unexpected adapter request {request!r}")
        self.adapters[name] = (version, pending, built)
        return reply


@dataclass
class _Job:
    name: str
    run: Hook
    done: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None


class FakeEngine:
    """An ``_EngineOps`` whose calls the engine's task runs in order, to their end."""

    def __init__(self, world: int, specs: tuple[ParamSpec, ...] = ()) -> None:
        parallel = SimpleNamespace(
            worker_extension_cls=EXTENSION, world_size=world, data_parallel_size=1
        )
        self.vllm_config = SimpleNamespace(
            weight_transfer_config=SimpleNamespace(backend=BACKEND), parallel_config=parallel
        )
        self.workers = [FakeWorker(r, specs) for r in range(world)]
        for w in self.workers:
            w.direct_begun = self._weights_change
        self.calls: list[str] = []
        self.paused = False
        self.session = False
        self.label: str | None = None
        # Weights written since the prefix cache was last reset, and how often
        # generation resumed with such a cache (always 0: nothing stale is served).
        self.cache_stale = False
        self.stale_resumes = 0
        self.fail: dict[str, int] = {}  # call name -> how many times it fails
        self.before: dict[str, Hook] = {}  # call name -> run first (once)
        self._send, self._receive = anyio.create_memory_object_stream[_Job](100)
        self.tg: anyio.abc.TaskGroup | None = None  # where the control threads run

    async def run(self) -> None:
        async with self._receive:
            async for job in self._receive:
                try:
                    hook = self.before.pop(job.name, None)
                    if hook is not None:
                        await hook()
                    if self.fail.get(job.name, 0) > 0:
                        self.fail[job.name] -= 1
                        raise RuntimeError(f"{job.name} failed (injected)")
                    await job.run()
                except Exception as exc:
                    job.error = exc
                finally:
                    job.done.set()

    async def _call(self, name: str, run: Hook) -> None:
        self.calls.append(name)
        job = _Job(name, run)
        await self._send.send(job)
        await job.done.wait()  # cancelling this wait does not stop the job
        if job.error is not None:
            raise job.error

    async def drain(self) -> None:
        """Wait until the engine has run every call made so far."""
        job = _Job("drain", anyio.lowlevel.checkpoint)
        await self._send.send(job)
        await job.done.wait()

    async def _all(self, request_id: int) -> None:
        async with anyio.create_task_group() as tg:
            for w in self.workers:
                tg.start_soon(w.handle, request_id)

    async def serve(self, request_id: int) -> None:
        await self._call("serve", lambda: self._all(request_id))

    async def update(self, request_id: int) -> None:
        async def run() -> None:
            assert self.session, "update_weights outside a weight update"
            await self._all(request_id)
            if any(w.seen[-1:] == ["LoadBucket"] for w in self.workers):
                self.cache_stale = True  # the model's weights changed

        await self._call("update", run)

    async def start(self) -> None:
        async def run() -> None:
            assert not self.session, "a weight update is already active"
            self.session = True

        await self._call("start", run)

    async def finish(self, label: str | None) -> None:
        async def run() -> None:
            if not self.session:
                raise RuntimeError("finish_weight_update without start_weight_update")
            self.session = False
            if label is not None:
                self.label = label

        await self._call(f"finish:{label}", run)

    async def set_label(self, label: str) -> None:
        async def run() -> None:
            self.label = label

        await self._call(f"label:{label}", run)

    async def init(self, channel: str, read_timeout: float) -> None:
        assert self.tg is not None
        for w in self.workers:
            await w.connect(channel)
            self.tg.start_soon(w.serve_control)

    async def shutdown(self) -> None:
        async def run() -> None:
            for w in self.workers:
                await w.close()

        await self._call("shutdown", run)

    def _weights_change(self) -> None:
        self.cache_stale = True  # a trainer writes the model's weights from now on

    async def pause(self) -> None:
        async def run() -> None:
            self.paused = True

        await self._call("pause", run)

    async def reset_cache(self) -> None:
        async def run() -> None:
            self.cache_stale = False

        await self._call("reset", run)

    async def resume(self) -> None:
        async def run() -> None:
            assert not self.session, "generation resumed inside a weight update"
            self.stale_resumes += self.cache_stale
            self.paused = False

        await self._call("resume", run)


@asynccontextmanager
async def engine_link(
    world: int = 1, cleanup: float = 5.0, specs: tuple[ParamSpec, ...] = ()
) -> AsyncIterator[tuple[FakeEngine, list[VLLMWorker]]]:
    engine = FakeEngine(world, specs)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            engine.tg = tg
            try:
                link = _EngineLink(engine, "vllm", rpc_timeout=5.0, cleanup=cleanup)
                async with _connected(link) as workers:
                    yield engine, workers
            finally:
                engine._send.close()  # the engine's task ends once its queue is empty
                for w in engine.workers:
                    await w.close()  # the control loops end
    finally:
        engine._receive.close()
        for w in engine.workers:
            await w.close()


async def each(
    workers: list[VLLMWorker] | list[VLLMAdapterWorker],
    step: Callable[[Any], Coroutine[Any, Any, Any]],
) -> None:
    """Run one step on every rank at once, as the coordinator does."""
    async with anyio.create_task_group() as tg:
        for w in workers:
            tg.start_soon(step, w)


async def begin_and_load(workers: list[VLLMWorker], version: int) -> None:
    await each(workers, lambda w: w.begin_update(version))
    await each(workers, lambda w: w.load_bucket(version, 0, ()))


def after(calls: list[str], first: str) -> list[str]:
    return calls[len(calls) - calls[::-1].index(first) - 1 :]


# --- generation is resumed on every path, after vLLM's update has ended ------------


async def test_an_abort_cut_short_by_its_caller_still_ends_the_update_and_resumes() -> None:
    async with engine_link() as (engine, workers):
        await begin_and_load(workers, 1)
        engine.workers[0].before["AbortUpdate"] = lambda: anyio.sleep(0.5)
        with anyio.move_on_after(0.05):  # the coordinator's cleanup deadline
            await workers[0].abort_update(1)
        assert after(engine.calls, "serve") == [
            "serve",
            "finish:None",
            "label:incomplete-1",
            "reset",
            "resume",
        ]
        assert not engine.paused and not engine.session and not engine.stale_resumes
        assert engine.label == "incomplete-1"


async def test_an_unanswered_abort_is_bounded_and_asked_again() -> None:
    async with engine_link(cleanup=0.3) as (engine, workers):
        await begin_and_load(workers, 1)
        engine.workers[0].before["AbortUpdate"] = lambda: anyio.sleep(1.0)
        start = anyio.current_time()
        with pytest.raises(WorkerTimeoutError, match=r"no answer within 0\.3 s"):
            await workers[0].abort_update(1)
        # finish and resume were queued behind the abort, each waited for at most 0.3 s
        assert anyio.current_time() - start < 1.5
        assert after(engine.calls, "serve")[:2] == ["serve", "finish:None"]
        await engine.drain()  # the engine got to them, in order
        assert not engine.paused and not engine.session
        await workers[0].abort_update(1)  # asks again, and is answered now
        assert engine.workers[0].seen.count("AbortUpdate") == 2
        await each(workers, lambda w: w.begin_update(2))  # the next push may begin


async def test_a_resume_that_fails_at_commit_fails_it_and_the_abort_resumes() -> None:
    async with engine_link() as (engine, workers):
        await begin_and_load(workers, 1)
        engine.fail["resume"] = 1
        with pytest.raises(WorkerRemoteError, match="version 1 is in, but resuming generation"):
            await workers[0].commit_update(1, 1)
        assert engine.paused and engine.label == "1"
        await workers[0].abort_update(1)  # as the coordinator does after a failed commit
        assert not engine.paused
        assert engine.label == "1"  # the weights were committed: not relabelled


async def test_a_resume_that_fails_at_abort_is_retried_on_close() -> None:
    async with engine_link() as (engine, workers):
        await begin_and_load(workers, 1)
        engine.fail["resume"] = 2
        await workers[0].abort_update(1)  # logged, still paused
        assert engine.paused
        await workers[0].abort_update(1)  # retried, fails again
        assert engine.paused
    assert not engine.paused  # leaving the connection resumed it
    assert engine.calls.count("resume") == 3


async def test_a_begin_cancelled_while_starting_is_ended_before_generation_resumes() -> None:
    async with engine_link() as (engine, workers):
        engine.before["start"] = lambda: anyio.sleep(0.3)
        with anyio.move_on_after(0.05):
            await workers[0].begin_update(1)
        await workers[0].abort_update(1)
        assert after(engine.calls, "pause") == ["pause", "start", "serve", "finish:None", "resume"]
        assert not engine.paused and not engine.session


async def test_a_failed_finish_relabels_the_engine_incomplete() -> None:
    async with engine_link() as (engine, workers):
        await begin_and_load(workers, 1)
        await workers[0].commit_update(1, 1)
        engine.label = "1"
        await begin_and_load(workers, 2)
        engine.fail["finish:2"] = 1
        with pytest.raises(WorkerRemoteError, match="finish:2 failed"):
            await workers[0].commit_update(2, 1)
        engine.session = True  # vLLM's update stays open when its finish raised
        await workers[0].abort_update(2)
        assert engine.label == "incomplete-2"
        assert not engine.paused and not engine.session


# --- the prefix cache and the weight version move together --------------------------


async def test_a_commit_resets_the_prefix_cache_after_the_label_and_before_resuming() -> None:
    async with engine_link() as (engine, workers):
        for version in (1, 2):
            await begin_and_load(workers, version)
            await workers[0].commit_update(version, 1)
            assert after(engine.calls, f"finish:{version}") == [
                f"finish:{version}",
                "reset",
                "resume",
            ]
        assert engine.stale_resumes == 0 and not engine.paused


async def test_an_abort_before_any_byte_keeps_the_cache() -> None:
    async with engine_link() as (engine, workers):
        await begin_and_load(workers, 1)
        await workers[0].commit_update(1, 1)
        await each(workers, lambda w: w.begin_update(2))
        await workers[0].abort_update(2)
        assert "reset" not in after(engine.calls, "pause") and engine.label == "1"
        assert not engine.paused


async def test_a_failed_reset_fails_the_commit_and_the_abort_resets_before_resuming() -> None:
    async with engine_link() as (engine, workers):
        await begin_and_load(workers, 1)
        engine.fail["reset"] = 1
        with pytest.raises(WorkerRemoteError, match="resetting the prefix cache failed"):
            await workers[0].commit_update(1, 1)
        assert engine.paused and engine.cache_stale  # nothing served meanwhile
        await workers[0].abort_update(1)
        assert after(engine.calls, "reset") == ["reset", "resume"]
        assert engine.stale_resumes == 0 and not engine.paused and engine.label == "1"


async def test_a_reset_that_keeps_failing_relabels_the_engine_and_still_resumes() -> None:
    async with engine_link() as (engine, workers):
        await begin_and_load(workers, 1)
        engine.fail["reset"] = 2
        with pytest.raises(WorkerRemoteError):
            await workers[0].commit_update(1, 1)
        await workers[0].abort_update(1)
        assert engine.label == "stale-cache"  # outputs say the cache could not follow
        assert not engine.paused


# --- errors name the rank that failed ----------------------------------------------


async def test_a_peer_rank_that_dies_is_named_by_the_other_ranks_error() -> None:
    async with engine_link(world=2) as (engine, workers):
        await each(workers, lambda w: w.begin_update(1))
        engine.workers[1].before["LoadBucket"] = engine.workers[1].close
        errors: dict[str, Exception] = {}

        async def load(w: VLLMWorker) -> None:
            try:
                await w.load_bucket(1, 0, ())
            except Exception as exc:
                errors[w.name] = exc

        await each(workers, load)
        died, peer = errors["vllm/rank-1"], errors["vllm/rank-0"]
        assert isinstance(died, WorkerDiedError) and died.worker == "vllm/rank-1"
        assert isinstance(peer, PeerWorkerError) and not isinstance(peer, WorkerDiedError)
        assert peer.worker == "vllm/rank-0" and peer.peer == "vllm/rank-1"
        assert peer.peer_error == "WorkerDiedError"
        assert "rank 1 closed its channel" in str(peer)


async def test_a_push_that_fails_at_one_rank_names_that_rank() -> None:
    tensors = {"w": torch.zeros(64), "b": torch.ones(8)}
    specs = tuple(
        ParamSpec(name=n, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
        for n, t in sorted(tensors.items())
    )
    async with engine_link(world=2, specs=specs) as (engine, workers):
        trainer = LocalTrainer(tensors)
        async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=4096) as refit:
            await refit.push(1)
            engine.workers[1].before["LoadBucket"] = engine.workers[1].close
            with pytest.raises(PushError) as info:
                await refit.push(2)
        assert info.value.failed == "vllm/rank-1"
        assert isinstance(info.value.cause, WorkerDiedError)
        assert info.value.cause.worker == "vllm/rank-1"
        assert not engine.paused


def test_translate_names_the_rank_that_failed() -> None:
    ranks = ["vllm/rank-0", "vllm/rank-1"]
    died = WorkerDiedError("vllm/rank-1", "rank 1 closed its channel")
    peer = _translate(died, "vllm/rank-0", ranks)
    assert isinstance(peer, PeerWorkerError)
    assert (peer.worker, peer.peer, peer.peer_error) == (
        "vllm/rank-0",
        "vllm/rank-1",
        "WorkerDiedError",
    )
    assert str(peer) == (
        "worker 'vllm/rank-0': its peer 'vllm/rank-1' failed: WorkerDiedError: "
        "rank 1 closed its channel"
    )
    own = _translate(died, "vllm/rank-1", ranks)
    assert type(own) is WorkerDiedError and own.worker == "vllm/rank-1"
    # a peer's report, asked again for the rank that failed, is that rank's error
    back = _translate(peer, "vllm/rank-1", ranks)
    assert isinstance(back, WorkerRemoteError) and back.remote_type == "WorkerDiedError"
    # the engine's own errors (its link is dead) are every rank's
    dead = _translate(WorkerDiedError("vllm", "rank 1 closed its channel"), "vllm/rank-0", ranks)
    assert type(dead) is WorkerDiedError and dead.worker == "vllm/rank-0"
    assert "rank 1" in str(dead)
    integrity = WorkerIntegrityError("vllm/rank-0", "IntegrityError", "bucket 3: checksum")
    assert type(_translate(integrity, "vllm/rank-0", ranks)) is WorkerIntegrityError


async def test_a_push_error_prefers_the_failed_worker_over_its_peers_report() -> None:
    died = WorkerDiedError("vllm/rank-1", "rank 1 closed its channel")
    peer = PeerWorkerError("vllm/rank-0", "vllm/rank-1", "WorkerDiedError", died.detail)
    assert primary_error(ExceptionGroup("push", [peer, died])) is died
    assert primary_error(ExceptionGroup("push", [peer, RuntimeError("x")])) is peer


# --- direct versions: begin, commit and abort on the control channels ----------------


async def begin_direct(workers: list[VLLMWorker], version: int) -> None:
    await each(workers, lambda w: w.begin_direct(version))


async def test_a_direct_version_makes_no_engine_call_but_pause_reset_label_and_resume() -> None:
    """The ranks' control threads take the begin and the commit: vLLM's update is never
    opened, no trigger RPC is sent, and the cache is still reset before resuming (while
    the ranks commit), so no generation resumes on a stale cache."""
    async with engine_link(world=2) as (engine, workers):
        for version in (1, 2):
            await begin_direct(workers, version)
            assert engine.paused
            await each(workers, lambda w, v=version: w.commit_update(v, 3))  # type: ignore[misc]
        assert after(engine.calls, "pause") == ["pause", "reset", "label:2", "resume"]
        assert engine.stale_resumes == 0
        assert engine.calls.count("pause") == 2 and "start" not in engine.calls
        assert not [c for c in engine.calls if c in ("serve", "update") or "finish" in c]
        for w in engine.workers:
            assert w.controlled == ["BeginUpdate", "CommitUpdate"] * 2
            assert "BeginUpdate" not in w.seen and "CommitUpdate" not in w.seen
        assert engine.label == "2" and not engine.paused and not engine.session


async def test_a_direct_commit_refused_at_one_rank_is_aborted_on_the_control_channels() -> None:
    async with engine_link(world=2) as (engine, workers):
        await begin_direct(workers, 1)
        engine.workers[1].fail.add("CommitUpdate")
        with pytest.raises(ExceptionGroup) as info:
            await each(workers, lambda w: w.commit_update(1, 3))
        errors = info.value.exceptions
        assert {type(e) for e in errors} <= {WorkerRemoteError, PeerWorkerError}
        assert all("rank-1" in str(e) or "rank 1" in str(e) for e in errors)
        await workers[0].abort_update(1)  # as the coordinator does
        assert [w.controlled[-1] for w in engine.workers] == ["AbortUpdate", "AbortUpdate"]
        # vLLM's update was never open: nothing to finish; bytes were written (the
        # reset and the label that ran with the commit are made again before resuming)
        assert after(engine.calls, "pause") == [
            "pause",
            "reset",
            "label:1",
            "label:incomplete-1",
            "reset",
            "resume",
        ]
        assert engine.stale_resumes == 0
        assert engine.label == "incomplete-1" and not engine.paused
        await begin_direct(workers, 2)  # the next push begins
        await each(workers, lambda w: w.commit_update(2, 3))
        assert engine.label == "2"


async def test_a_reset_failed_during_a_direct_commit_fails_it_and_the_abort_resets() -> None:
    async with engine_link(world=2) as (engine, workers):
        await begin_direct(workers, 1)
        engine.fail["reset"] = 1
        with pytest.raises(ExceptionGroup) as info:
            await each(workers, lambda w: w.commit_update(1, 3))
        assert any("resetting the prefix cache failed" in str(e) for e in info.value.exceptions)
        # Every rank committed: the version is in, and its label says so.
        assert [w.controlled[-1] for w in engine.workers] == ["CommitUpdate"] * 2
        assert engine.label == "1" and engine.paused and engine.cache_stale
        await workers[0].abort_update(1)  # as the coordinator does
        assert after(engine.calls, "label:1") == ["label:1", "reset", "resume"]
        assert engine.stale_resumes == 0 and not engine.paused and engine.label == "1"


async def test_a_label_failed_during_a_direct_commit_fails_it_and_the_abort_relabels() -> None:
    """The label runs with the ranks' commit (generation paused): if it fails, the push
    fails, and no generation resumes before the abort labels the engine incomplete."""
    async with engine_link(world=2) as (engine, workers):
        await begin_direct(workers, 1)
        engine.fail["label:1"] = 1
        with pytest.raises(ExceptionGroup) as info:
            await each(workers, lambda w: w.commit_update(1, 3))
        assert any("labelling it failed" in str(e) for e in info.value.exceptions)
        assert [w.controlled[-1] for w in engine.workers] == ["CommitUpdate"] * 2
        assert engine.paused and "resume" not in after(engine.calls, "pause")
        await workers[0].abort_update(1)  # as the coordinator does
        relabelled = ["label:1", "label:incomplete-1", "reset", "resume"]
        assert after(engine.calls, "label:1") == relabelled
        assert engine.stale_resumes == 0 and not engine.paused
        assert engine.label == "incomplete-1"


async def test_a_direct_begin_refused_ends_with_an_abort_and_resumes() -> None:
    async with engine_link() as (engine, workers):
        engine.workers[0].fail.add("BeginUpdate")
        with pytest.raises(WorkerRemoteError, match="BeginUpdate failed"):
            await workers[0].begin_direct(1)
        await workers[0].abort_update(1)
        assert engine.workers[0].controlled == ["BeginUpdate", "AbortUpdate"]
        assert after(engine.calls, "pause") == ["pause", "resume"]  # nothing was written
        assert not engine.paused


async def test_an_unanswered_direct_abort_is_bounded_and_generation_resumes() -> None:
    async with engine_link(cleanup=0.3) as (engine, workers):
        await begin_direct(workers, 1)
        engine.workers[0].before["AbortUpdate"] = lambda: anyio.sleep(1.0)
        with pytest.raises(WorkerTimeoutError, match=r"no answer within 0\.3 s"):
            await workers[0].abort_update(1)
        assert after(engine.calls, "pause") == ["pause", "label:incomplete-1", "reset", "resume"]
        assert not engine.paused
        await anyio.sleep(1.0)  # the late answer comes, and is dropped
        await workers[0].abort_update(1)  # asked again, answered now
        assert engine.workers[0].controlled == ["BeginUpdate", "AbortUpdate", "AbortUpdate"]


# --- LoRA adapters -------------------------------------------------------------------

POLICY = LoRAAdapter(
    name="policy",
    id=1,
    config={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]},
    tensors={"base_model.model.m.q_proj.lora_A.weight": (2, 4)},
)


async def push_adapter(workers: list[VLLMAdapterWorker], version: int) -> None:
    await each(workers, lambda w: w.begin_update(version))
    await each(workers, lambda w: w.load_bucket(version, 0, ()))
    await each(workers, lambda w: w.commit_update(version, 1))


async def test_an_adapter_push_goes_by_the_control_channels_and_keeps_the_label() -> None:
    """An adapter's push makes no weight update and no trigger RPC: its steps go to the
    ranks' control channels, the commit builds at every rank before any rank installs,
    the cache is reset before generation resumes, and the engine's label (its
    weights') stays."""
    async with engine_link(world=2) as (engine, workers):
        await engine.set_label("7")
        adapters = [w.lora(POLICY) for w in workers]
        for version in (1, 2):
            await push_adapter(adapters, version)
        assert after(engine.calls, "pause") == ["pause", "reset", "resume"]
        assert engine.calls.count("pause") == 2 and engine.stale_resumes == 0
        assert not [c for c in engine.calls if c in ("serve", "update", "start") or "finish" in c]
        for w in engine.workers:
            steps = ["BeginUpdate", "LoadBucket", "CommitUpdate", "InstallAdapter"]
            assert w.controlled == [f"policy:{s}" for s in steps] * 2
            assert w.adapters["policy"] == (2, None, False)
        assert engine.label == "7" and not engine.paused
        assert [await a.weight_version() for a in adapters] == [2, 2]
        assert adapters[1].name == "vllm/rank-1/lora-policy"


async def test_a_build_refused_at_one_rank_leaves_every_rank_serving_the_old_version() -> None:
    async with engine_link(world=2) as (engine, workers):
        adapters = [w.lora(POLICY) for w in workers]
        await push_adapter(adapters, 1)
        engine.workers[1].fail.add("policy:CommitUpdate")
        await each(adapters, lambda w: w.begin_update(2))
        with pytest.raises(ExceptionGroup) as info:
            await each(adapters, lambda w: w.commit_update(2, 0))
        assert all("rank-1" in str(e) or "rank 1" in str(e) for e in info.value.exceptions)
        await adapters[0].abort_update(2)  # as the coordinator does
        for w in engine.workers:
            assert "policy:InstallAdapter" not in w.controlled[4:]
            assert w.adapters["policy"][0] == 1
        assert after(engine.calls, "pause") == ["pause", "resume"]  # nothing changed


async def test_an_install_failed_at_one_rank_takes_the_adapter_out_at_every_rank() -> None:
    """Every rank built the new version, one could not install it: rather than ranks
    serving different versions, every rank takes the adapter out; the abort resets the
    cache and resumes, and relabels nothing (the label is the weights')."""
    async with engine_link(world=2) as (engine, workers):
        await engine.set_label("7")
        adapters = [w.lora(POLICY) for w in workers]
        await push_adapter(adapters, 1)
        engine.workers[1].fail.add("policy:InstallAdapter")
        await each(adapters, lambda w: w.begin_update(2))
        with pytest.raises(ExceptionGroup):
            await each(adapters, lambda w: w.commit_update(2, 0))
        await adapters[0].abort_update(2)
        for w in engine.workers:
            assert w.controlled[-2:] == ["policy:RemoveAdapter", "policy:AbortUpdate"]
            assert w.adapters["policy"][0] is None
        assert after(engine.calls, "pause") == ["pause", "reset", "resume"]
        assert engine.stale_resumes == 0 and engine.label == "7"
        await push_adapter(adapters, 3)  # the next push puts it back
        assert [await a.weight_version() for a in adapters] == [3, 3]


async def test_pushes_of_the_weights_and_of_an_adapter_run_one_at_a_time() -> None:
    """A push of an adapter waits while a push of the weights holds the engine's session
    (and an abort of the adapter meanwhile leaves that push alone); it begins once the
    weights are committed."""
    async with engine_link(world=2) as (engine, workers):
        adapters = [w.lora(POLICY) for w in workers]
        await begin_and_load(workers, 5)
        begun = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def adapter_push() -> None:
                await each(adapters, lambda w: w.begin_update(1))
                begun.set()

            tg.start_soon(adapter_push)
            await anyio.sleep(0.2)
            assert not begun.is_set()
            await adapters[0].abort_update(1)  # not the adapter's session: nothing
            assert engine.session and engine.paused
            await each(workers, lambda w: w.commit_update(5, 1))
            assert engine.label == "5"
            with anyio.fail_after(5):
                await begun.wait()
        await each(adapters, lambda w: w.load_bucket(1, 0, ()))
        await each(adapters, lambda w: w.commit_update(1, 1))
        assert [await a.weight_version() for a in adapters] == [1, 1]
        assert [c for c in after(engine.calls, "finish:5") if c != "serve"] == [
            "finish:5",
            "reset",
            "resume",
            "pause",
            "reset",
            "resume",
        ]
        assert engine.stale_resumes == 0


async def test_an_adapter_push_cancelled_at_every_scheduling_point_never_mixes() -> None:
    """Cancel an adapter's push after 0, 1, 2, ... scheduling points until one ends:
    after each, generation runs (resumed on a fresh cache), no session is open, every
    rank serves the same version of the adapter (the one before, or the new one when the
    cancellation came after it was installed), and the next push succeeds."""
    from .test_cancellation import push_cancelled_after

    names = [f"base_model.model.m.l{i}.q_proj.lora_{ab}.weight" for i in range(4) for ab in "AB"]
    tensors = {n: torch.full((2, 64), float(i)) for i, n in enumerate(names)}
    big = LoRAAdapter(name="big", id=3, config=POLICY.config, tensors={n: (2, 64) for n in names})
    async with engine_link(world=2) as (engine, workers):
        adapters = [w.lora(big) for w in workers]
        async with RefitCoordinator(
            trainer=LocalTrainer(tensors), workers=adapters, budget_bytes=1024
        ) as refit:
            await refit.push(1)
            version, k, cancelled = 1, 0, 0
            while True:
                version += 1
                before = engine.workers[0].adapters["big"][0]
                finished = await push_cancelled_after(refit, version, k)
                await engine.drain()
                # One version at every rank: the old one, or (cancelled once it was in)
                # the new one.
                served = {w.adapters["big"][0] for w in engine.workers}
                assert served == {version} if finished else served in ({before}, {version})
                assert not engine.paused and not engine.session, k
                assert engine.stale_resumes == 0, k
                if finished:
                    break
                cancelled += 1
                version += 1
                await refit.push(version)
                assert {w.adapters["big"][0] for w in engine.workers} == {version}
                k += 1
            assert cancelled >= 10, "the push finished too soon to test anything"
