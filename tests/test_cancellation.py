"""Cancel a push after k scheduling points, for every k until it completes.

After every cancelled push: no task is left running, the budget is fully returned, no
slot is held, no segment leaked, every worker holds either a complete version whose
bytes are right or no complete version, and the next push succeeds. Nothing reaches
the event loop's exception handler (a callback failing behind a cancelled wait).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import anyio
import pytest
import torch
from anyio.lowlevel import checkpoint

from asyncrefit import RefitCoordinator, SharedParameterTrainer, cpu_device
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults

from .fakes import FakeWorker
from .helpers import assert_hold, digests, no_loop_errors, own_segments, step
from .models import make_mlp

KIB = 1024


@pytest.fixture(autouse=True)
async def loop_errors_fail_the_test() -> AsyncIterator[None]:
    async with no_loop_errors():
        yield


async def push_cancelled_after(refit: RefitCoordinator, version: int, k: int) -> bool:
    """Start ``push(version)``, cancel it after ``k`` scheduling points; True if it finished."""
    finished = False
    scope = anyio.CancelScope()

    async def pusher() -> None:
        nonlocal finished
        with scope:
            await refit.push(version)
            finished = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(pusher)
        for _ in range(k):
            await checkpoint()
        scope.cancel()
    return finished


async def check_clean(refit: RefitCoordinator, tasks_before: int, segments: set[str]) -> None:
    stats = refit.statistics()
    assert stats.in_use == 0 and stats.waiters == 0, stats
    assert not refit.quarantined_slots()
    assert len(asyncio.all_tasks()) == tasks_before
    assert set(own_segments()) == segments  # the coordinator's own slots, nothing more


async def cancel_at_every_point(
    refit: RefitCoordinator,
    workers: list[FakeWorker],
    model: torch.nn.Module,
    state: Callable[[], dict[str, str]],
    *,
    least: int = 10,
) -> None:
    """Cancel pushes after 0, 1, 2, ... scheduling points until one completes; after
    each, everything is clean, a worker's complete version is ``state()`` of that
    version (the digests of what the trainer pushed), and the next push succeeds.
    A push with fewer than ``least`` points fails the test (it tested too little)."""
    await refit.push(1)
    tasks_before = len(asyncio.all_tasks())
    segments = set(own_segments())
    history = {1: state()}
    version, k, cancelled = 1, 0, 0
    while True:
        version += 1
        step(model, version)
        history[version] = state()
        finished = await push_cancelled_after(refit, version, k)
        await check_clean(refit, tasks_before, segments)
        for w in workers:
            held = await w.weight_version()
            # a complete version is one whose bytes the worker really holds
            if held is not None:
                assert w.receiver.digests() == history[held], (k, w.name, held)
        if finished:
            break
        cancelled += 1
        # and the coordinator is still usable
        version += 1
        history[version] = history[version - 1]
        await refit.push(version)
        assert all(w.receiver.digests() == history[version] for w in workers)
        k += 1
    assert cancelled >= least, "the push finished too soon to test anything"


async def test_cancel_at_every_scheduling_point_with_fake_workers() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(3)]
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await cancel_at_every_point(refit, workers, model, lambda: digests(model))


async def test_cancel_at_every_scheduling_point_moe_under_checkpoint_names() -> None:
    """An MoE trainer's fused experts pushed one expert at a time (a budget below one
    fused expert tensor): a worker's complete version is always the trainer's
    checkpoint tensors of that version, bitwise."""
    pytest.importorskip("transformers.core_model_loading")
    from .moe_models import checkpoint_tensors, fused_expert_bytes, make_model

    model = make_model("mixtral", num_hidden_layers=1, hidden_size=64, intermediate_size=64)
    shapes = checkpoint_tensors(model)
    workers = [
        FakeWorker(
            name=f"w{i}",
            device=cpu_device(i),
            parameters={n: torch.zeros_like(t) for n, t in shapes.items()},
        )
        for i in range(2)
    ]

    def state() -> dict[str, str]:
        return {n: tensor_digest(t) for n, t in checkpoint_tensors(model).items()}

    budget = fused_expert_bytes(model) // 2
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=budget) as refit:
        await cancel_at_every_point(refit, workers, model, state)


async def test_cancel_at_every_scheduling_point_zero_copy() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    trainer = SharedParameterTrainer(model)
    async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        tasks_before = len(asyncio.all_tasks())
        segments = set(own_segments())
        version, k = 1, 0
        while True:
            version += 1
            if await push_cancelled_after(refit, version, k):
                break
            await check_clean(refit, tasks_before, segments)
            version += 1
            await refit.push(version)
            k += 1
        assert k >= 10


async def test_cancel_at_scheduling_points_with_processes() -> None:
    """Real processes: replies arrive late, after the cancel; the channel must survive."""
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(load_delay=0.002)}
    async with spawn_with_faults(make_mlp, 2, faults=faults) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
            await refit.push(1)
            tasks_before = len(asyncio.all_tasks())
            segments = set(own_segments())
            version, k = 1, 0
            history = {1: digests(model)}
            while True:
                version += 1
                step(model, version)
                history[version] = digests(model)
                if await push_cancelled_after(refit, version, k):
                    break
                await check_clean(refit, tasks_before, segments)
                for w in workers:
                    # a worker may have committed before the cancel reached it: any
                    # complete version it claims must be one whose bytes it holds
                    held = await w.weight_version()
                    if held is not None:
                        assert await w.parameter_digests() == history[held], (k, held)
                version += 1
                history[version] = history[version - 1]
                await refit.push(version)
                await assert_hold(workers, model, version)
                k += 3  # processes are slow to cycle: every third point
            await assert_hold(workers, model, version)
            assert k >= 6


@pytest.mark.timeout(240)
async def test_cancelled_pushes_to_processes_report_nothing_to_the_loop() -> None:
    """200 pushes cut off at random moments: no callback fails behind a cancelled read.

    On uvloop, a cancelled read through anyio's socket stream could leave its readiness
    callback setting the result of a cancelled future (``InvalidStateError`` reported to
    the loop's exception handler, a few times in 200).
    """
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(load_delay=0.002)}
    rng = random.Random(0)
    async with spawn_with_faults(make_mlp, 2, faults=faults) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
            await refit.push(1)
            version = 1
            for _ in range(200):
                version += 1
                with anyio.move_on_after(rng.uniform(0, 0.01)):
                    await refit.push(version)
            version += 1
            step(model, version)
            await refit.push(version)
            await assert_hold(workers, model, version)
