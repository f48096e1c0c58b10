"""Direct writes: the trainer writes straight into the workers' exported parameters.

Workers that export their parameters (local processes with ``shared_parameters=True``,
in-process :class:`DirectFakeWorker`) get a begin and a commit per push and no bucket
request; their source writes every bucket into their memory, nothing staged. The tests
check the bytes (bitwise, casts, parts), the calls, a push that mixes direct and staged
workers, and the failures: a worker killed or stopped mid-push, hostile destinations,
cancellation at every scheduling point.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import anyio
import pytest
import torch

from asyncrefit import (
    LocalTrainer,
    ParameterMismatchError,
    PushError,
    RefitCoordinator,
    TransportError,
    WorkerDiedError,
    WorkerTimeoutError,
    cpu_device,
)
from asyncrefit.abc import DirectWorker, WriteGate, WritingSource
from asyncrefit.events import BucketPacked, PushEvent
from asyncrefit.local import spawn_local_workers
from asyncrefit.planning import Bucket
from asyncrefit.transport.destinations import (
    DestinationEntry,
    Destinations,
    Region,
    layout,
    share_parameters,
    views,
)
from asyncrefit.transport.shm import list_segments

from .fakes import DirectFakeWorker, FakeWorker, direct_workers
from .helpers import assert_hold, child_pids, digests, no_loop_errors, own_segments, step
from .models import make_mlp, make_mlp_bf16
from .test_cancellation import cancel_at_every_point, check_clean, push_cancelled_after

KIB = 1024


def segments_of(pids: set[int | None]) -> list[str]:
    """The segments under /dev/shm created by the processes ``pids`` (the workers')."""
    return [s for s in list_segments() if any(s.startswith(f"asyncrefit-{p}-") for p in pids)]


@pytest.fixture(autouse=True)
async def loop_errors_fail_the_test() -> AsyncIterator[None]:
    async with no_loop_errors():
        yield


def direct_fakes(
    model: torch.nn.Module, count: int
) -> AbstractContextManager[list[DirectFakeWorker]]:
    """``count`` direct workers holding zeroed copies of ``model``'s parameters."""
    return direct_workers(DirectFakeWorker, model, count)


def test_local_trainer_writes_and_local_workers_export() -> None:
    assert isinstance(LocalTrainer({}), WritingSource)
    model = make_mlp()
    with direct_fakes(model, 1) as (worker,):
        assert isinstance(worker, DirectWorker)


# --- the bytes and the calls ---------------------------------------------------------


async def test_direct_push_into_processes_is_bitwise_and_stages_nothing() -> None:
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2, shared_parameters=True) as workers:
        pids = {w.pid for w in workers}
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
            for version in (1, 2, 3):
                step(model, version)
                report = await refit.push(version)
                await assert_hold(workers, model, version)
                assert report.buckets > 1
                assert report.slots == 0 and report.peak_budget_bytes == 0
                assert report.bytes_per_transport == {"direct": 2 * report.bytes}
                assert set(report.handle_bytes_per_worker.values()) == {0}
            assert refit.statistics().capacity == 0
            x = torch.randn(4, 64)
            with torch.no_grad():
                assert torch.equal(await workers[0].forward(x), model(x))
    assert own_segments() == [] and segments_of(pids) == []


async def test_workers_are_written_directly_by_one_coordinator_after_another() -> None:
    """The segment keeps its name while the worker lives: a second coordinator (or a
    re-plan, or a worker removed and added again) opens it anew."""
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2, shared_parameters=True) as workers:
        pids = {w.pid for w in workers}
        version = 0
        for _ in range(2):
            async with RefitCoordinator(
                trainer=model, workers=workers, budget_bytes=64 * KIB
            ) as refit:
                version += 1
                step(model, version)
                report = await refit.push(version)
                assert report.bytes_per_transport == {"direct": 2 * report.bytes}
                await assert_hold(workers, model, version)
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as r:
            await r.remove_worker("worker-1")
            await r.add_worker(workers[1])
            version += 1
            step(model, version)
            report = await r.push(version)
            assert report.bytes_per_transport == {"direct": 2 * report.bytes}
            await assert_hold(workers, model, version)
        assert len(segments_of(pids)) == 2  # one per live worker, nothing more
    assert own_segments() == [] and segments_of(pids) == []


async def test_direct_push_costs_two_calls_per_worker_whatever_the_buckets() -> None:
    model = make_mlp()
    with direct_fakes(model, 3) as workers:
        # 8 KiB buckets: the 64 KiB weights go in parts, written into rows of the places
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=8 * KIB) as refit:
            assert refit.plan is not None and len(refit.plan.buckets) > 10
            assert refit.plan.split
            for version in (1, 2, 3):
                step(model, version)
                for w in workers:
                    w.calls.clear()
                await refit.push(version)
                for w in workers:
                    assert w.calls == [("begin_direct", version), ("commit", version)]
                    assert w.equals(model)
                    assert await w.weight_version() == version
    assert own_segments() == []


async def test_a_source_is_called_once_per_push_for_a_set_under_the_write_batch() -> None:
    """Buckets far below the budget, a set far below the least write batch (64 MiB):
    the source gets one write call per push for all its buckets (a remote source: one
    actor call), not one per budget's worth."""
    model = make_mlp()
    source = LocalTrainer(model)
    calls: list[int] = []
    write, write_gated = source.write, source.write_gated

    async def counted(buckets: Sequence[Bucket], workers: Sequence[str]) -> None:
        calls.append(len(buckets))
        await write(buckets, workers)

    async def counted_gated(
        buckets: Sequence[Bucket], workers: Sequence[str], gate: WriteGate
    ) -> bool:
        calls.append(len(buckets))
        return await write_gated(buckets, workers, gate)

    source.write = counted  # type: ignore[method-assign]
    source.write_gated = counted_gated  # type: ignore[method-assign]
    with direct_fakes(model, 2) as workers:
        async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=8 * KIB) as refit:
            assert refit.plan is not None
            for version in (1, 2):
                step(model, version)
                calls.clear()
                await refit.push(version)
                assert calls == [len(refit.plan.buckets)]
                assert all(w.equals(model) for w in workers)


async def test_direct_writes_cast_to_the_workers_dtype() -> None:
    model = make_mlp()  # float32 master weights
    engine = make_mlp_bf16()
    params = {n: torch.zeros_like(p.detach()) for n, p in engine.named_parameters()}
    worker = DirectFakeWorker(name="bf16", device=cpu_device(0), parameters=params)
    try:
        async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=64 * KIB) as r:
            step(model, 1)
            report = await r.push(1)
            assert report.bytes_per_transport == {"direct": report.bytes}
            for name, p in model.named_parameters():
                assert torch.equal(worker.parameters[name], p.detach().to(torch.bfloat16))
    finally:
        worker.close()


async def test_one_push_mixes_direct_and_staged_workers() -> None:
    model = make_mlp()
    staged = FakeWorker.like("staged", cpu_device(1), model)
    with direct_fakes(model, 1) as (direct,):
        async with RefitCoordinator(
            trainer=model, workers=[direct, staged], budget_bytes=64 * KIB
        ) as refit:
            for version in (1, 2):
                step(model, version)
                report = await refit.push(version)
                assert direct.equals(model) and staged.equals(model)
                assert report.bytes_per_transport == {"direct": report.bytes, "shm": report.bytes}
                assert report.slots > 0
            assert [c for c, _ in direct.calls].count("load") == 0
            assert [c for c, _ in staged.calls].count("load") == 2 * report.buckets
    assert own_segments() == []


class _Event:
    """Stands for a worker's completion event: complete after ``polls`` queries
    (never, with ``None``). The GPU tests wait on real ones."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


def test_a_direct_commit_waits_for_the_trainers_writes_in_bounded_time() -> None:
    from asyncrefit.transport.destinations import SharedParameters

    found = Destinations(kind="cuda_ipc", device=cpu_device(0), regions=(), entries=())
    later = _Event(polls=5)
    SharedParameters(found, event=later).wait_for_writes(timeout=10.0)
    assert later.queries == 6
    SharedParameters(found).wait_for_writes(timeout=0.0)  # no event: writes are done
    with pytest.raises(TransportError, match=r"did not complete within 0.05 s"):
        SharedParameters(found, event=_Event(polls=None)).wait_for_writes(timeout=0.05)


def test_write_batches_group_consecutive_buckets_up_to_the_limit() -> None:
    from asyncrefit import ParamSpec
    from asyncrefit._core._push import write_batches
    from asyncrefit.planning import plan_buckets

    specs = [ParamSpec(name=f"t{i}", shape=(256,), dtype="float32") for i in range(7)]
    plan = plan_buckets(specs, 1024)  # one 1 KiB tensor per bucket
    batches = write_batches(plan.buckets, 3 * 1024)
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [b.index for batch in batches for b in batch] == list(range(7))
    assert [len(b) for b in write_batches(plan.buckets, 10)] == [1] * 7  # one each, at least


async def test_direct_push_reports_every_bucket_once() -> None:
    model = make_mlp()
    with direct_fakes(model, 2) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as r:
            events: list[PushEvent] = []
            r.subscribe(events.append)
            report = await r.push(1)
            packed = sorted(e.bucket for e in events if isinstance(e, BucketPacked))
            assert packed == list(range(report.buckets))
            assert report.stages.pack <= report.seconds


@pytest.mark.parametrize("option", ["verify", "direct_write_off"])
async def test_verify_and_direct_write_off_stage_every_bucket(option: str) -> None:
    model = make_mlp()
    with direct_fakes(model, 2) as workers:
        kw = {"verify": True} if option == "verify" else {"direct_write": False}
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=64 * KIB, **kw
        ) as refit:
            step(model, 1)
            report = await refit.push(1)
            assert report.bytes_per_transport == {"shm": 2 * report.bytes}
            assert all(w.equals(model) for w in workers)
            assert all(("destinations", 0) not in w.calls for w in workers)


async def test_a_worker_added_later_is_written_directly() -> None:
    model = make_mlp()
    with direct_fakes(model, 2) as (first, second):
        async with RefitCoordinator(trainer=model, workers=[first], budget_bytes=64 * KIB) as r:
            await r.push(1)
            await r.add_worker(second)
            step(model, 2)
            report = await r.push(2)
            assert report.bytes_per_transport == {"direct": 2 * report.bytes}
            assert first.equals(model) and second.equals(model)
            await r.remove_worker("w0")
            step(model, 3)
            await r.push(3)
            assert second.equals(model) and not first.equals(model)
    assert own_segments() == []


# --- failures ------------------------------------------------------------------------


def at_bucket(index: int, action: Callable[[], object]) -> Callable[[PushEvent], None]:
    """An event callback that runs ``action`` once bucket ``index`` was written."""

    def callback(event: PushEvent) -> None:
        if isinstance(event, BucketPacked) and event.bucket == index:
            action()

    return callback


async def test_fake_worker_dead_before_its_commit_is_named_and_others_abort() -> None:
    model = make_mlp()
    with direct_fakes(model, 3) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=8 * KIB) as refit:
            await refit.push(1)
            step(model, 2)
            refit.subscribe(at_bucket(3, lambda: setattr(workers[1], "dead", True)))
            with pytest.raises(PushError) as info:
                await refit.push(2)
            assert isinstance(info.value.__cause__, WorkerDiedError)
            assert info.value.failed == "w1"
            assert "w1" in info.value.incomplete
            # The others committed concurrently (then they hold version 2, bitwise), or
            # were aborted: written from their begin on, they then hold no version.
            for w in (workers[0], workers[2]):
                held = await w.weight_version()
                assert held == (None if w.name in info.value.incomplete else 2)
                assert held is None or w.equals(model)
            await refit.remove_worker("w1")
            step(model, 3)
            await refit.push(3)
            assert workers[0].equals(model) and workers[2].equals(model)


@pytest.mark.timeout(120)
async def test_process_killed_mid_write_is_detected_and_named() -> None:
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2, shared_parameters=True) as workers:
        pids = {w.pid for w in workers}
        victim = workers[1]
        assert victim.pid is not None
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as refit:
            await refit.push(1)
            step(model, 2)
            pid = victim.pid
            refit.subscribe(at_bucket(2, lambda: os.kill(pid, signal.SIGKILL)))
            with pytest.raises(PushError) as info:
                await refit.push(2)
            assert isinstance(info.value.__cause__, WorkerDiedError)
            assert info.value.failed == "worker-1"
            held = await workers[0].weight_version()
            assert held == (None if "worker-0" in info.value.incomplete else 2)
            await refit.remove_worker("worker-1")
            step(model, 3)
            await refit.push(3)
            await assert_hold(workers[:1], model, 3)
    assert own_segments() == [] and segments_of(pids) == []
    assert child_pids() == set()


@pytest.mark.timeout(120)
async def test_process_stopped_mid_write_times_out_and_is_named() -> None:
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2, shared_parameters=True) as workers:
        pids = {w.pid for w in workers}
        pid = workers[0].pid
        assert pid is not None
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=16 * KIB, timeout=2, cleanup_timeout=1
        ) as refit:
            await refit.push(1)
            step(model, 2)
            refit.subscribe(at_bucket(1, lambda: os.kill(pid, signal.SIGSTOP)))
            try:
                with pytest.raises(PushError) as info:
                    await refit.push(2)
                assert isinstance(info.value.__cause__, WorkerTimeoutError)
                assert info.value.failed == "worker-0"
            finally:
                await workers[0].kill()
            await refit.remove_worker("worker-0")
            step(model, 3)
            await refit.push(3)
            await assert_hold(workers[1:], model, 3)
    assert own_segments() == [] and segments_of(pids) == []


def _moved(entry_index: int, offset: int) -> object:
    def tamper(d: Destinations) -> Destinations:
        entries = list(d.entries)
        entries[entry_index] = dataclasses.replace(entries[entry_index], offset=offset)
        return dataclasses.replace(d, entries=tuple(entries))

    return tamper


@pytest.mark.parametrize(
    ("tamper", "error", "match"),
    [
        (_moved(0, 1 << 30), TransportError, "does not fit"),
        (_moved(0, 3), TransportError, "does not fit"),  # misaligned for float32
        (
            lambda d: dataclasses.replace(
                d, regions=(dataclasses.replace(d.regions[0], segment="../../etc/passwd"),)
            ),
            TransportError,
            "segment",
        ),
        (
            lambda d: dataclasses.replace(
                d, entries=(dataclasses.replace(d.entries[0], region=3), *d.entries[1:])
            ),
            TransportError,
            "no region",
        ),
        (lambda d: dataclasses.replace(d, kind="nvme"), TransportError, "kind"),
        (
            lambda d: dataclasses.replace(
                d, entries=(dataclasses.replace(d.entries[0], shape=(1,)), *d.entries[1:])
            ),
            ParameterMismatchError,
            "destination",
        ),
        (
            lambda d: dataclasses.replace(d, entries=d.entries[1:]),
            ParameterMismatchError,
            "no place",
        ),
    ],
)
async def test_hostile_destinations_are_refused_before_any_byte_moves(
    tamper: object, error: type[Exception], match: str
) -> None:
    model = make_mlp()
    with direct_fakes(model, 2) as workers:
        workers[1].tamper = tamper  # type: ignore[assignment]
        before = digests(model)
        with pytest.raises(error, match=match):
            async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB):
                pass
        assert digests(model) == before
        for w in workers:
            assert await w.weight_version() is None
            assert all(not torch.any(p) for p in w.parameters.values())  # nothing written
    assert own_segments() == []


def test_share_parameters_refuses_tensors_on_several_devices() -> None:
    tensors = {"a": torch.zeros(4), "b": torch.zeros(4, device="meta")}
    with pytest.raises(TransportError, match="several devices"):
        share_parameters(tensors, cpu_device(0))
    assert tensors["a"].untyped_storage().nbytes() == 16  # unchanged
    assert own_segments() == []


async def test_cancel_at_every_scheduling_point_direct() -> None:
    model = make_mlp()
    with direct_fakes(model, 3) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as refit:
            await cancel_at_every_point(refit, workers, model, lambda: digests(model))  # type: ignore[arg-type]
    assert own_segments() == []


@pytest.mark.timeout(180)
async def test_cancel_at_scheduling_points_with_processes_direct() -> None:
    """Real processes written directly: a push cut off anywhere leaves nothing behind,
    and every version a worker claims is one whose bytes it holds."""
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2, shared_parameters=True) as workers:
        pids = {w.pid for w in workers}
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as refit:
            await refit.push(1)
            tasks_before = len(asyncio.all_tasks())
            version, k = 1, 0
            history = {1: digests(model)}
            while True:
                version += 1
                step(model, version)
                history[version] = digests(model)
                if await push_cancelled_after(refit, version, k):
                    break
                await check_clean(refit, tasks_before, set())
                for w in workers:
                    held = await w.weight_version()
                    if held is not None:
                        assert await w.parameter_digests() == history[held], (k, held)
                version += 1
                history[version] = history[version - 1]
                await refit.push(version)
                await assert_hold(workers, model, version)
                k += 2
            await assert_hold(workers, model, version)
            assert k >= 6
    assert own_segments() == [] and segments_of(pids) == []


# --- GPU -------------------------------------------------------------------------------

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run with -m gpu on a GPU machine)")
async def test_direct_push_into_gpu_workers_is_bitwise_equal() -> None:
    from asyncrefit._cuda import cuda_device

    from .gpu_models import make_gpu_mixed

    model = make_gpu_mixed()
    dev = cuda_device(0)
    async with spawn_local_workers(
        make_gpu_mixed, 2, devices=[dev, dev], shared_parameters=True
    ) as workers:
        trainer = LocalTrainer(model, devices=[dev])
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=256 * 1024
        ) as refit:
            for version in (1, 2, 3):
                step(model, version)
                report = await refit.push(version)
                await assert_hold(workers, model, version)
                assert report.slots == 0
                assert report.bytes_per_transport == {"direct": 2 * report.bytes}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run with -m gpu on a GPU machine)")
async def test_gpu_workers_commit_after_the_writes_the_trainer_did_not_wait_for() -> None:
    """A GPU worker exports a completion event; the source records it after its writes
    and waits for nothing on the host (flush(wait=False)); each worker's commit waits
    for the event, so every byte is in when the push returns."""
    from asyncrefit._cuda import cuda_device

    from .gpu_models import make_gpu_mixed

    model = make_gpu_mixed()
    dev = cuda_device(0)
    synchronized: list[object] = []
    real = torch.cuda.synchronize

    def spy(device: object = None) -> None:
        synchronized.append(device)
        real(device)  # type: ignore[arg-type]

    async with spawn_local_workers(
        make_gpu_mixed, 2, devices=[dev, dev], shared_parameters=True
    ) as workers:
        found = [await w.destinations() for w in workers]
        assert all(d is not None and d.event for d in found)
        trainer = LocalTrainer(model, devices=[dev])
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=1 << 20
        ) as refit:
            await refit.push(1)
            for version in (2, 3):
                step(model, version)
                torch.cuda.synchronize()
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(torch.cuda, "synchronize", spy)
                    await refit.push(version)
                await assert_hold(workers, model, version)
    assert synchronized == []  # the trainer never waited for its writes on the host


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run with -m gpu on a GPU machine)")
async def test_gpu_copies_on_side_streams_follow_the_trainers_queued_work() -> None:
    """The trainer's new values are still queued behind a long kernel on its stream
    when the push starts; the copies spread over two streams, and those on the side
    stream must wait for that work too: every worker holds the new values."""
    from asyncrefit._cuda import cuda_device

    from .gpu_models import make_gpu_medium

    model = make_gpu_medium()
    dev = cuda_device(0)
    lanes: list[object] = []
    async with spawn_local_workers(
        make_gpu_medium, 2, devices=[dev, dev], shared_parameters=True
    ) as workers:
        trainer = LocalTrainer(model, devices=[dev])
        fork = trainer._fork

        def spy(names: tuple[str, ...]) -> list[Any] | None:
            forked = fork(names)
            lanes.append(forked and len(forked))
            return forked

        trainer._fork = spy  # type: ignore[method-assign,assignment]
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=32 << 20
        ) as refit:
            for version in (1, 2, 3):
                torch.cuda.synchronize()
                torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s
                step(model, version)  # queued behind it, on this thread's stream
                await refit.push(version)
                await assert_hold(workers, model, version)
    assert lanes == [2, 2, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run with -m gpu on a GPU machine)")
@pytest.mark.timeout(120)
def test_a_worker_never_commits_writes_of_a_trainer_that_died_before_they_ran() -> None:
    """The trainer records the worker's event after gigabytes of writes and exits at
    once. The worker's wait either gives up in its time (the record never completes)
    or returns with every byte written: it never returns on half-written memory."""
    import multiprocessing

    from asyncrefit._cuda import cuda_device
    from asyncrefit.transport.destinations import SharedParameters

    from .gpu_models import write_then_die

    params = {f"p{i}": torch.zeros(64 << 20, device="cuda") for i in range(4)}  # 1 GiB
    shared = share_parameters(params, cuda_device(0))
    assert isinstance(shared, SharedParameters) and shared.destinations.event
    ctx = multiprocessing.get_context("spawn")
    receives, sends = ctx.Pipe(duplex=False)
    child = ctx.Process(target=write_then_die, args=(shared.destinations, sends, 400))
    child.start()
    try:
        assert receives.poll(60) and receives.recv() == "recorded"
        try:
            shared.wait_for_writes(timeout=10.0)
        except TransportError as exc:
            assert "did not complete" in str(exc)
        else:
            assert all(bool((p == 1.0).all()) for p in params.values())
    finally:
        child.join(30)
        shared.close()
    assert child.exitcode == 0


# --- destinations made of blocks (an engine that fuses and shards) ---------------------


@dataclasses.dataclass
class FusedWorker(FakeWorker):
    """Holds :func:`make_mlp`'s tensors the way an engine with fused parameters does,
    in a shared-memory segment it exports (see ``layout`` below): whole tensors, column
    blocks of a tensor in two parameters, a tensor strided as a column of a matrix, and
    one tensor in two places. ``group`` is its ``direct_group``; ``exports`` off makes
    it export nothing."""

    group: str | None = None
    exports: bool = True

    def __post_init__(self) -> None:
        from asyncrefit.transport.shm import _Segment, segment_name

        super().__post_init__()
        self.fused = torch.zeros(320, 64)  # rows 0:256 <- 0.weight, 256:320 <- 2.weight[:, :64]
        self.rest = torch.zeros(64, 192)  # <- 2.weight[:, 64:]
        self.cols = torch.zeros(256, 2)  # column 0 <- 0.bias
        self.bias = torch.zeros(2, 64)  # both rows <- 2.bias
        held = {"fused": self.fused, "rest": self.rest, "cols": self.cols, "bias": self.bias}
        entries, nbytes = layout(held)
        self.segment = _Segment.create(segment_name(secrets.token_hex(4), 0, 0), nbytes)
        assert self.segment.tensor is not None
        where = {e.name: e for e in entries}
        with torch.no_grad():
            for name, t in held.items():
                t.data = views([self.segment.tensor], entries)[name]

        def at(name: str, t: torch.Tensor) -> int:
            return where[name].offset + int(t.storage_offset() - held[name].storage_offset()) * 4

        def entry(source: str, held_name: str, t: torch.Tensor, box: object = None) -> Any:
            return DestinationEntry(
                name=source,
                region=0,
                offset=at(held_name, t),
                shape=tuple(t.shape),
                dtype="float32",
                strides=None if t.is_contiguous() else tuple(t.stride()),
                source_box=box,  # type: ignore[arg-type]
            )

        self.exported = Destinations(
            kind="shm",
            device=self.device,
            regions=(Region(nbytes=nbytes, segment=self.segment.name),),
            entries=(
                entry("0.weight", "fused", self.fused[0:256]),
                entry("2.weight", "fused", self.fused[256:320], ((0, 64), (0, 64))),
                entry("2.weight", "rest", self.rest, ((0, 64), (64, 256))),
                entry("0.bias", "cols", self.cols[:, 0]),
                entry("2.bias", "bias", self.bias[0]),
                entry("2.bias", "bias", self.bias[1]),
            ),
        )

    @property
    def direct_group(self) -> str | None:
        return self.group

    async def destinations(self) -> Destinations | None:
        await anyio.lowlevel.checkpoint()
        self.calls.append(("destinations", 0))
        return self.exported if self.exports else None

    async def begin_direct(self, version: int) -> None:
        await anyio.lowlevel.checkpoint()
        self.calls.append(("begin_direct", version))
        self.receiver.sink.begin(version)
        self.receiver.state.begin(version, direct=True)

    def holds(self, model: torch.nn.Module) -> bool:
        p = {n: t.detach() for n, t in model.named_parameters()}
        return (
            torch.equal(self.fused[:256], p["0.weight"])
            and torch.equal(self.fused[256:], p["2.weight"][:, :64])
            and torch.equal(self.rest, p["2.weight"][:, 64:])
            and torch.equal(self.cols[:, 0], p["0.bias"])
            and not torch.any(self.cols[:, 1])
            and torch.equal(self.bias[0], p["2.bias"])
            and torch.equal(self.bias[1], p["2.bias"])
        )

    def close(self) -> None:
        self.segment.close()
        from asyncrefit.transport.shm import _unlink

        _unlink(self.segment.name)


def fused_worker(name: str, model: torch.nn.Module, **kwargs: Any) -> FusedWorker:
    params = {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()}
    return FusedWorker(name=name, device=cpu_device(0), parameters=params, **kwargs)


@pytest.mark.parametrize("budget", [256 * KIB, 16 * KIB], ids=["whole", "parts"])
async def test_blocks_of_tensors_are_written_into_fused_and_strided_places(budget: int) -> None:
    """Destinations as an engine's copy plan gives them: blocks of a tensor in several
    parameters, a strided place, one tensor in two places; tensors sent whole or in
    parts of rows (each part writes where its rows land in each block)."""
    model = make_mlp()
    worker = fused_worker("fused", model)
    try:
        async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=budget) as refit:
            for version in (1, 2):
                step(model, version)
                report = await refit.push(version)
                assert report.bytes_per_transport == {"direct": report.bytes}
                assert worker.holds(model)
                assert await worker.weight_version() == version
            if budget < 64 * KIB:
                plan = refit.plan
                assert plan is not None
                assert any(e.part for b in plan.buckets for e in b.entries)
    finally:
        worker.close()
    assert own_segments() == []


async def test_workers_of_one_group_are_all_written_directly_or_none() -> None:
    """The ranks of one engine take their steps together: when one of them exports
    nothing, its peers are staged too (and written in full by the staged path)."""
    model = make_mlp()
    exporting = fused_worker("e/rank-0", model, group="e")
    silent = fused_worker("e/rank-1", model, group="e", exports=False)
    other = fused_worker("other", model, group="f")
    try:
        async with RefitCoordinator(
            trainer=model, workers=[exporting, silent, other], budget_bytes=256 * KIB
        ) as refit:
            step(model, 1)
            report = await refit.push(1)
            assert report.bytes_per_transport == {"direct": report.bytes, "shm": 2 * report.bytes}
            assert other.holds(model)
            assert ("begin", 1) in exporting.calls and ("begin", 1) in silent.calls
            for w in (exporting, silent):
                assert receiver_holds(w, model)
    finally:
        for w in (exporting, silent, other):
            w.close()
    assert own_segments() == []


def receiver_holds(worker: FakeWorker, model: torch.nn.Module) -> bool:
    return all(torch.equal(worker.parameters[n], p.detach()) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"strides": (1,)}, "strides"),
        ({"strides": (-1, 1)}, "strides"),
        ({"source_box": ((0, 5), (0, 64))}, "block"),
        ({"shape": (-1, 64)}, "shape"),
        ({"strides": (1 << 40, 1)}, "does not fit"),
    ],
)
async def test_hostile_blocks_are_refused_before_any_byte_moves(
    entry: dict[str, Any], match: str
) -> None:
    model = make_mlp()
    worker = fused_worker("fused", model)
    first = worker.exported.entries[1]
    worker.exported = dataclasses.replace(
        worker.exported,
        entries=(
            worker.exported.entries[0],
            dataclasses.replace(first, **entry),
            *worker.exported.entries[2:],
        ),
    )
    try:
        with pytest.raises(TransportError, match=match):
            async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=256 * KIB):
                pass
        assert not torch.any(worker.fused) and not torch.any(worker.rest)
    finally:
        worker.close()
    assert own_segments() == []
