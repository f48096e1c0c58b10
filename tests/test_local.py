"""Real refits into local worker processes: bitwise results, versions, failures."""

from __future__ import annotations

import os

import anyio
import pytest
import torch

from asyncrefit import (
    ParameterMismatchError,
    PushError,
    RefitCoordinator,
    WorkerDiedError,
    WorkerTimeoutError,
)
from asyncrefit.local import spawn_local_workers
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults

from .helpers import assert_hold, child_pids, digests, own_segments, step
from .models import make_mixed, make_mlp, make_mlp_wide

KIB = 1024


async def test_real_refit_is_bitwise_equal_over_three_pushes() -> None:
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2) as workers:
        pids = {w.pid for w in workers}
        assert None not in pids and os.getpid() not in pids and len(pids) == 2
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
            assert refit.devices["worker-0"].device == "cpu:0"
            for version in (1, 2, 3):
                step(model, version)
                report = await refit.push(version)
                await assert_hold(workers, model, version)
                assert report.buckets > 1
                a, b = report.handle_bytes_per_worker.values()
                assert a == b
            # a forward pass in the worker gives the trainer's output, bit for bit
            x = torch.randn(4, 64)
            with torch.no_grad():
                assert torch.equal(await workers[0].forward(x), model(x))
    assert own_segments() == []


async def test_mixed_dtypes_and_zero_size_through_processes() -> None:
    model = make_mixed()
    with torch.no_grad():
        model.get_parameter("a")[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    async with spawn_local_workers(make_mixed, 2) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=8 * KIB) as refit:
            await refit.push(1)
            await assert_hold(workers, model, 1)


async def test_mismatch_is_refused_before_any_byte_reaches_a_worker() -> None:
    model = make_mlp()
    async with (
        spawn_local_workers(make_mlp, 1) as good,
        spawn_local_workers(make_mlp_wide, 1, names=["wide"], devices=["cpu:1"]) as wide,
    ):
        before = await good[0].parameter_digests()
        with pytest.raises(ParameterMismatchError) as info:
            async with RefitCoordinator(
                trainer=model, workers=[*good, *wide], budget_bytes=64 * KIB
            ):
                pass
        assert info.value.worker == "wide"
        assert await good[0].parameter_digests() == before
        assert await good[0].weight_version() is None


async def test_worker_killed_mid_push_is_named_and_others_abort() -> None:
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(crash_at_bucket=2)}
    async with spawn_with_faults(make_mlp, 3, faults=faults) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
            with anyio.fail_after(30):
                with pytest.raises(PushError) as info:
                    await refit.push(1)
            err = info.value
            assert isinstance(err.cause, WorkerDiedError)
            assert err.failed == "worker-1" and "worker-1" in str(err)
            assert not workers[1].alive
            # the survivors were aborted: they claim no complete version
            for w in (workers[0], workers[2]):
                assert await w.weight_version() is None
            assert refit.statistics().in_use == 0
            # and the coordinator carries on with them
            await refit.remove_worker("worker-1")
            step(model, 2)
            await refit.push(2)
            await assert_hold([workers[0], workers[2]], model, 2)
    assert own_segments() == []


async def test_worker_killed_between_pushes() -> None:
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
            await refit.push(1)
            version_1 = digests(model)
            await workers[0].kill()
            step(model, 2)
            with anyio.fail_after(30), pytest.raises(PushError) as info:
                await refit.push(2)
            assert isinstance(info.value.cause, WorkerDiedError)
            assert info.value.failed == "worker-0"
            # The survivor either still holds version 1 whole (nothing of 2 reached it
            # before the abort) or claims no version: never a silent mix.
            held = await workers[1].weight_version()
            assert held in (1, None)
            if held == 1:
                assert await workers[1].parameter_digests() == version_1


async def test_hung_worker_times_out_then_is_removed() -> None:
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(hang_at_bucket=0)}
    async with spawn_with_faults(make_mlp, 2, faults=faults) as workers:
        async with RefitCoordinator(
            trainer=model,
            workers=workers,
            budget_bytes=64 * KIB,
            timeout=1.0,
            cleanup_timeout=1.0,
        ) as refit:
            with pytest.raises(PushError) as info:
                await refit.push(1)
            assert isinstance(info.value.cause, WorkerTimeoutError)
            # the hung worker may still be reading: its slot is held back
            assert refit.quarantined_slots()
            await workers[1].kill()
            await refit.remove_worker("worker-1")
            assert not refit.quarantined_slots() and refit.statistics().in_use == 0
            await refit.push(2)
            await assert_hold([workers[0]], model, 2)


async def test_cancelled_push_with_processes() -> None:
    model = make_mlp()
    faults = {f"worker-{i}": WorkerFaults(load_delay=0.05) for i in range(2)}
    async with spawn_with_faults(make_mlp, 2, faults=faults) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
            with anyio.move_on_after(0.1) as scope:
                await refit.push(1)
            assert scope.cancelled_caught
            assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
            for w in workers:
                assert await w.weight_version() is None
            await refit.push(2)
            await assert_hold(workers, model, 2)


async def test_worker_that_fails_to_start_leaves_nothing() -> None:
    with pytest.raises(WorkerDiedError, match="start-up"):
        async with spawn_local_workers(_broken_factory, 2):
            pytest.fail("started")
    assert child_pids() == set()


def _broken_factory() -> torch.nn.Module:
    raise RuntimeError("cannot build the model")
