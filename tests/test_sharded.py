"""Sharded trainers: FSDP2 ranks in their own processes, gathered bucket by bucket.

Two trainer processes shard a small transformer with ``fully_shard`` (fp32 master
weights, row counts that two ranks split unevenly) over gloo; the test process is the
coordinator, driving both ranks through every bucket in plan order; local worker
processes hold the model in bf16. After each of three optimizer steps, every worker
must hold, bitwise, the trainer's gathered full state cast to bf16. A world of one
rank (gloo on the CPU; NCCL and CUDA IPC on a GPU, with ``-m gpu``) pushes without
any collective.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest
import torch

from asyncrefit import PushError, RefitCoordinator, SourceDiedError
from asyncrefit.local import spawn_local_workers
from asyncrefit.tools._machine import free_port
from asyncrefit.trainer import RankSource, rank_path
from asyncrefit.transport.shm import list_segments

from .helpers import own_segments
from .sharded import (
    LAYOUTS,
    RankPlan,
    layouts_main,
    make_transformer_bf16,
    make_wide_transformer_bf16,
    one_rank_main,
    rank_main,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KIB = 1024


@contextmanager
def trainer_ranks(plan: RankPlan) -> Iterator[tuple[list[Any], Any]]:
    """Start ``plan.world`` rank processes; on exit wait for them, kill stragglers."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=rank_main, args=(r, plan, results), daemon=True)
        for r in range(plan.world)
    ]
    for p in processes:
        p.start()
    try:
        yield processes, results
    finally:
        for p in processes:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
        results.close()
        results.join_thread()


def take(results: Any, kind: str, timeout: float = 60.0) -> tuple[Any, ...]:
    """The next message of ``kind`` from the ranks (others are kept for later)."""
    deadline = time.monotonic() + timeout
    while True:
        for i, item in enumerate(take.pending):  # type: ignore[attr-defined]
            if item[0] == kind:
                return tuple(take.pending.pop(i))  # type: ignore[attr-defined]
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {kind!r} from the trainer ranks")
        try:
            take.pending.append(results.get(timeout=min(left, 1.0)))  # type: ignore[attr-defined]
        except queue.Empty:
            pass


take.pending = []  # type: ignore[attr-defined]


@asynccontextmanager
async def sharded_refit(
    plan: RankPlan, workers: list[Any], budget: int, **kwargs: Any
) -> AsyncIterator[RefitCoordinator]:
    sources = [RankSource(rank_path(plan.directory, r), timeout=60) for r in range(plan.world)]
    async with RefitCoordinator(
        trainer=sources, workers=workers, budget_bytes=budget, **kwargs
    ) as refit:
        yield refit


def rank_segments(processes: list[Any]) -> list[str]:
    pids = {p.pid for p in processes}
    return [s for s in list_segments() if int(s.split("-")[1]) in pids]


async def check_three_pushes(
    plan: RankPlan, worker_devices: list[str], budget: int, *, parts: bool = False
) -> list[int]:
    take.pending = []  # type: ignore[attr-defined]
    with trainer_ranks(plan) as (processes, results):
        async with spawn_local_workers(
            make_transformer_bf16, len(worker_devices), devices=worker_devices
        ) as workers:
            async with sharded_refit(plan, workers, budget, verify=True) as refit:
                assert refit.plan is not None and len(refit.plan.buckets) > 2
                assert bool(refit.plan.split) == parts
                for version in range(1, plan.steps + 1):
                    report = await refit.push(version)
                    _, step, expected = take(results, "expected")
                    assert step == version
                    for w in workers:
                        assert await w.parameter_digests() == expected, (w.name, version)
                        assert await w.weight_version() == version
                    assert report.bytes == sum(
                        p.numel() * 2 for p in make_transformer_bf16().parameters()
                    )
        peaks = [take(results, "peak")[3] for _ in range(plan.world * plan.steps)]
        for _ in range(plan.world):
            take(results, "closed")
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    assert rank_segments(processes) == []
    return peaks


async def test_fsdp2_ranks_push_their_gathered_state_cast_to_bf16() -> None:
    with tempfile.TemporaryDirectory() as directory:
        plan = RankPlan(world=2, port=free_port(), directory=directory, steps=3)
        await check_three_pushes(plan, ["cpu:0", "cpu:1"], budget=64 * KIB)


async def test_fsdp2_tensors_larger_than_a_bucket_go_in_parts() -> None:
    """A budget of 8 KiB (buckets of 4 KiB) under tensors of up to 14 KiB in bf16: each
    goes in parts of rows, gathered rank by rank (lm_head's 97 rows split 49 + 48, so
    some parts straddle the ranks' shards)."""
    with tempfile.TemporaryDirectory() as directory:
        plan = RankPlan(world=2, port=free_port(), directory=directory, steps=3)
        await check_three_pushes(plan, ["cpu:0", "cpu:1"], budget=8 * KIB, parts=True)


async def test_a_rank_that_serves_no_worker_still_takes_part_in_every_gather() -> None:
    """All four workers sit on rank 0's device; rank 1 serves none, but must gather.

    Were rank 1 not driven through every bucket, rank 0's gathers would wait for it
    until their timeout and the push would fail.
    """
    with tempfile.TemporaryDirectory() as directory:
        plan = RankPlan(world=2, port=free_port(), directory=directory, steps=3)
        await check_three_pushes(plan, ["cpu:0"] * 4, budget=64 * KIB)


async def test_a_rank_killed_mid_gather_fails_the_push_and_nothing_is_left() -> None:
    with tempfile.TemporaryDirectory() as directory:
        plan = RankPlan(
            world=2,
            port=free_port(),
            directory=directory,
            steps=1,
            kill_at_bucket={1: 1},
            gather_timeout=10.0,
        )
        take.pending = []  # type: ignore[attr-defined]
        with trainer_ranks(plan) as (processes, results):
            async with spawn_local_workers(
                make_transformer_bf16, 2, devices=["cpu:0", "cpu:1"]
            ) as workers:
                async with sharded_refit(plan, workers, 64 * KIB, timeout=20) as refit:
                    start = time.monotonic()
                    with pytest.raises(PushError) as info:
                        await refit.push(1)
                    assert time.monotonic() - start < 20
                    assert isinstance(info.value.cause, SourceDiedError)
                    assert "rank-1" in str(info.value.cause)
                    assert set(info.value.incomplete) == {"worker-0", "worker-1"}
            take(results, "closed")  # the surviving rank returned from serve_push
        assert processes[1].exitcode == 9 and processes[0].exitcode == 0
        assert rank_segments(processes) == []


async def test_peak_extra_memory_per_rank_stays_within_budget_plus_largest_tensor() -> None:
    budget = 2 << 20
    with tempfile.TemporaryDirectory() as directory:
        plan = RankPlan(world=2, port=free_port(), directory=directory, steps=2, hidden=256)
        take.pending = []  # type: ignore[attr-defined]
        with trainer_ranks(plan) as (_, results):
            async with spawn_local_workers(
                make_wide_transformer_bf16, 2, devices=["cpu:0", "cpu:1"]
            ) as workers:
                async with sharded_refit(plan, workers, budget) as refit:
                    for version in (1, 2):
                        await refit.push(version)
                        take(results, "expected")
            peaks = {(r, s): extra for _, r, s, extra in (take(results, "peak") for _ in range(4))}
            take(results, "closed")
            take(results, "closed")
    largest = max(p.numel() * 4 for p in make_wide_transformer_bf16().parameters())
    bound = budget + largest
    print(f"peak extra memory per rank and push: {peaks}; bound {bound}")
    # The first push also maps the staging slots (the budget); later ones reuse them.
    # Resident-set peaks also count the interpreter's own allocations during a push
    # (pickled plans and handles, a worker thread's stack): 512 KiB for those.
    assert all(extra <= bound + (512 << 10) for extra in peaks.values()), (peaks, bound)


def test_every_placement_on_1d_and_2d_meshes_is_gathered_bitwise() -> None:
    """Shard(0) (even, uneven, fewer rows than ranks), Shard(1), Replicate, 2-D meshes;
    whole, and rows of them (``gather_rows_into``)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=layouts_main, args=(r, 4, port, results), daemon=True)
        for r in range(4)
    ]
    for p in processes:
        p.start()
    try:
        got = [results.get(timeout=90) for _ in range(4 * 3 * len(LAYOUTS) + 4)]
    finally:
        for p in processes:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
        results.close()
        results.join_thread()
    bad = [g for g in got if g[0] in ("layout", "rows") and not g[4]]
    assert bad == []
    assert len([g for g in got if g[0] == "rows"]) == 4 * len(LAYOUTS)
    refusals = [g for g in got if g[0] == "refused"]
    assert len(refusals) == 4 and all(r[2] and "Partial" in r[2] for r in refusals)
    assert all(p.exitcode == 0 for p in processes)


async def test_a_sharded_push_cancelled_at_any_moment_leaves_everything_usable() -> None:
    """The cancellation harness over two FSDP2 ranks: a bucket whose gathers began is
    seen through on both ranks, every rank hears the push end, and the next push works."""
    from .test_cancellation import check_clean

    with tempfile.TemporaryDirectory() as directory:
        plan = RankPlan(world=2, port=free_port(), directory=directory, steps=10_000)
        take.pending = []  # type: ignore[attr-defined]
        with trainer_ranks(plan) as (processes, results):
            async with spawn_local_workers(
                make_transformer_bf16, 2, devices=["cpu:0", "cpu:1"]
            ) as workers:
                async with sharded_refit(plan, workers, 64 * KIB) as refit:
                    # A push that got going ends with the rank's ``serve_push``,
                    # after which the rank takes an optimizer step; one cancelled
                    # before it began leaves the rank waiting in the same step.
                    states: dict[int, dict[str, str]] = {}  # by step
                    step_of: dict[int, int] = {}  # by version

                    def state_of(version: int) -> dict[str, str]:
                        while version not in step_of:
                            _, step, pushed, _ok = take(results, "served")
                            step_of[pushed] = step
                        step = step_of[version]
                        while step not in states:
                            _, s, digests = take(results, "expected")
                            states[s] = digests
                        return states[step]

                    # Processes answer in their own time, so cut pushes off after a
                    # delay rather than after a number of scheduling points: from at
                    # once to a whole push, in steps of a twelfth of one.
                    await refit.push(1)
                    state_of(1)
                    start = time.perf_counter()
                    await refit.push(2)
                    whole = time.perf_counter() - start
                    tasks_before = len(asyncio.all_tasks())
                    segments = set(own_segments())
                    version, cancelled = 2, 0
                    for i in range(13):
                        version += 1
                        with anyio.move_on_after(whole * i / 12) as scope:
                            await refit.push(version)
                        cancelled += scope.cancelled_caught
                        await check_clean(refit, tasks_before, segments)
                        for w in workers:
                            held = await w.weight_version()
                            if held is not None:
                                assert await w.parameter_digests() == state_of(held), (i, held)
                        version += 1
                        await refit.push(version)
                        for w in workers:
                            assert await w.parameter_digests() == state_of(version)
                    assert cancelled >= 6
            for _ in range(plan.world):
                take(results, "closed")
    assert all(p.exitcode == 0 for p in processes)
    assert rank_segments(processes) == []


def run_one_rank(device: str) -> list[tuple[Any, ...]]:
    """Run :func:`one_rank_main` in a process of its own; its reports."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    # Not a daemon: it starts a worker process of its own.
    process = context.Process(target=one_rank_main, args=(device, results))
    process.start()
    got: list[tuple[Any, ...]] = []
    try:
        deadline = time.monotonic() + 150
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:
                if not process.is_alive():
                    break
                continue
            assert item[0] != "error", item[1]
            got.append(item)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(10)
        results.close()
        results.join_thread()
    assert process.exitcode == 0
    return got


def one_rank_bytes() -> int:
    return sum(p.numel() * 2 for p in make_transformer_bf16().parameters())


def test_a_world_of_one_rank_pushes_without_collectives_cast_to_bf16() -> None:
    """A mesh of size 1 (one trainer process): the copy casts, nothing is gathered."""
    got = run_one_rank("cpu")
    assert got == [("one-rank", v, True, one_rank_bytes()) for v in (1, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_world_of_one_rank_on_a_cuda_mesh_pushes_through_cuda_ipc() -> None:
    """NCCL, a CUDA mesh of size 1, fp32 shards cast to bf16 in the slot, CUDA IPC."""
    got = run_one_rank("cuda")
    assert got == [("one-rank", v, True, one_rank_bytes()) for v in (1, 2)]
