"""The coordinator's loop turns while the commits of a GPU direct push run, if told to.

With :data:`asyncrefit._core._push.SPIN_COMMIT_S` above 0, a push that wrote a worker
on a GPU keeps its loop turning while the workers commit (their commits wait for the
GPU's copies), for at most that long, and stops as soon as every commit answered or
one failed. Workers on the CPU never make it turn. The workers here are fakes whose
device id names a GPU (their memory is the CPU's: only the id decides).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest

from asyncrefit import DeviceId, LocalTrainer, PushError, RefitCoordinator
from asyncrefit._core import _push

from .fakes import DirectFakeWorker, Faults, direct_workers
from .helpers import no_loop_errors, step
from .models import make_mlp

HOLD_S = 0.05
BUDGET = 64 << 10


@pytest.fixture(autouse=True)
async def loop_errors_fail_the_test() -> AsyncIterator[None]:
    async with no_loop_errors():
        yield


@dataclass
class SlowCommit(DirectFakeWorker):
    """Answers its commit ``hold`` seconds late (as a commit waiting for the GPU does)."""

    hold: float = HOLD_S

    async def commit_update(self, version: int, buckets: int) -> None:
        await anyio.sleep(self.hold)
        await super().commit_update(version, buckets)


class Turns:
    """Counts the loop's turns: the times of every ``anyio.lowlevel.checkpoint()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: list[float] = []
        real = anyio.lowlevel.checkpoint

        async def counted() -> None:
            self.times.append(time.perf_counter())
            await real()

        monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted)

    def between(self, start: float, end: float) -> int:
        return sum(start <= t < end for t in self.times)


def on(device: str, workers: list[SlowCommit]) -> list[SlowCommit]:
    for w in workers:
        w.device = DeviceId(node=w.device.node, device=f"{device}-{w.name}")
    return workers


@pytest.fixture
def spin(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setattr(_push, "SPIN_COMMIT_S", 1.0)
    yield monkeypatch


async def second_push(device: str | None, hold: float = HOLD_S) -> tuple[float, float]:
    """Two pushes into 2 fake workers (on ``device``, else the CPU) whose commits answer
    ``hold`` seconds late: when the second one started and ended."""
    model = make_mlp()
    with direct_workers(SlowCommit, model, 2) as workers:
        if device is not None:
            on(device, workers)
        for w in workers:
            w.hold = hold
        async with RefitCoordinator(
            trainer=LocalTrainer(model), workers=workers, budget_bytes=BUDGET
        ) as refit:
            await refit.push(1)
            step(model, 2)
            start = time.perf_counter()
            await refit.push(2)
            end = time.perf_counter()
            assert [w.receiver.version for w in workers] == [2, 2]
    assert end - start >= hold
    return start, end


@pytest.mark.parametrize("device", ["GPU", "MIG"])
async def test_the_loop_turns_while_gpu_workers_commit(
    spin: pytest.MonkeyPatch, device: str
) -> None:
    turns = Turns(spin)
    start, end = await second_push(device)
    # The commits took HOLD_S; the loop turned all along (hundreds of turns), not once
    # per wake-up.
    assert turns.between(start, end) > 200


async def test_cpu_workers_never_make_the_loop_turn(spin: pytest.MonkeyPatch) -> None:
    turns = Turns(spin)
    start, end = await second_push(None)
    assert turns.between(start, end) < 100


async def test_the_turning_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _push.SPIN_COMMIT_S == 0
    turns = Turns(monkeypatch)
    start, end = await second_push("GPU")
    assert turns.between(start, end) < 100


async def test_the_turning_stops_at_its_limit(spin: pytest.MonkeyPatch) -> None:
    spin.setattr(_push, "SPIN_COMMIT_S", 0.01)
    turns = Turns(spin)
    start, end = await second_push("GPU", hold=0.3)
    # Turning for 10 ms from the commits' start, then asleep until they answer.
    assert turns.between(start + 0.15, end - 0.01) < 50


async def test_a_failed_commit_stops_the_turning_and_is_named(spin: pytest.MonkeyPatch) -> None:
    model = make_mlp()
    turns = Turns(spin)
    with direct_workers(SlowCommit, model, 2) as workers:
        on("GPU", workers)
        async with RefitCoordinator(
            trainer=LocalTrainer(model), workers=workers, budget_bytes=BUDGET
        ) as refit:
            await refit.push(1)
            workers[1].faults = Faults(fail_at_commit=True)
            tasks = len(asyncio.all_tasks())
            step(model, 2)
            with pytest.raises(PushError) as caught:
                await refit.push(2)
            assert caught.value.failed == "w1"
            after = time.perf_counter()
            await anyio.sleep(0.05)
            assert turns.between(after, after + 0.05) < 20  # no turning left behind
            assert len(asyncio.all_tasks()) == tasks
            workers[1].faults = Faults()
            step(model, 3)
            await refit.push(3)
            assert [w.receiver.version for w in workers] == [3, 3]
