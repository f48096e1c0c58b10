"""The rank barrier: an engine-wide step runs once, when every rank asked; no engine."""

from __future__ import annotations

import anyio
import pytest

from asyncrefit import AsyncRefitError, WorkerRemoteError
from asyncrefit.vllm._barrier import DROPPED, RankBarrier

pytestmark = pytest.mark.timeout(10)


def name(rank: int) -> str:
    return f"e/rank-{rank}"


def translate(exc: BaseException, rank: int) -> Exception:
    return WorkerRemoteError(name(rank), type(exc).__name__, str(exc))


def barrier(world: int) -> RankBarrier[str, str]:
    return RankBarrier(world, name, translate)


async def test_the_last_rank_runs_the_step_once_for_every_rank() -> None:
    gate = barrier(3)
    runs: list[dict[int, str]] = []
    answers: dict[int, str] = {}

    async def run(requests: dict[int, str]) -> dict[int, str]:
        runs.append(requests)
        return {r: f"{q}!" for r, q in requests.items()}

    async def ask(rank: int) -> None:
        answers[rank] = await gate.gather(("load", 1, 0), rank, f"q{rank}", run)

    async with anyio.create_task_group() as tg:
        for rank in range(3):
            tg.start_soon(ask, rank)
            await anyio.wait_all_tasks_blocked()
            assert runs == [] or rank == 2
    assert runs == [{0: "q0", 1: "q1", 2: "q2"}]
    assert answers == {0: "q0!", 1: "q1!", 2: "q2!"}
    assert len(gate) == 0


async def test_one_rank_runs_at_once() -> None:
    async def run(requests: dict[int, str]) -> dict[int, str]:
        return {0: "done"}

    assert await barrier(1).gather("x", 0, "q", run) == "done"


async def test_a_failed_step_is_every_ranks_error_translated_for_it() -> None:
    gate = barrier(2)
    errors: dict[int, Exception] = {}

    async def run(requests: dict[int, str]) -> dict[int, str]:
        raise RuntimeError("boom")

    async def ask(rank: int) -> None:
        try:
            await gate.gather("commit", rank, "q", run)
        except Exception as exc:
            errors[rank] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, 0)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(ask, 1)
    for rank, exc in errors.items():
        assert isinstance(exc, WorkerRemoteError) and exc.worker == name(rank)
        assert exc.remote_type == "RuntimeError" and isinstance(exc.__cause__, RuntimeError)
    assert sorted(errors) == [0, 1]


async def test_a_cancelled_step_interrupts_the_waiting_ranks() -> None:
    gate = barrier(2)
    waiting: list[BaseException] = []

    async def run(requests: dict[int, str]) -> dict[int, str]:
        await anyio.sleep_forever()
        raise AssertionError

    async def wait() -> None:
        try:
            await gate.gather("s", 0, "q", run)
        except Exception as exc:
            waiting.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        with anyio.move_on_after(0.05) as scope:
            await gate.gather("s", 1, "q", run)
        assert scope.cancelled_caught  # the runner's own cancellation is not translated
    assert len(waiting) == 1 and isinstance(waiting[0], WorkerRemoteError)
    assert waiting[0].worker == name(0)


async def test_asking_twice_is_refused() -> None:
    gate = barrier(2)

    async def run(requests: dict[int, str]) -> dict[int, str]:
        raise AssertionError("never runs")

    async def first() -> None:
        with pytest.raises(WorkerRemoteError, match="the push ended"):
            await gate.gather("s", 0, "q", run)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(AsyncRefitError, match=r"e/rank-0 asked for step s twice"):
            await gate.gather("s", 0, "q", run)
        gate.drop()


async def test_drop_wakes_the_ranks_of_steps_that_will_never_run() -> None:
    gate = barrier(2)
    errors: list[Exception] = []

    async def run(requests: dict[int, str]) -> dict[int, str]:
        raise AssertionError("never runs")

    async def ask(key: str) -> None:
        try:
            await gate.gather(key, 0, "q", run)
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "a")
        tg.start_soon(ask, "b")
        await anyio.wait_all_tasks_blocked()
        assert len(gate) == 2
        gate.drop()
    assert len(gate) == 0 and len(errors) == 2
    for exc in errors:
        assert isinstance(exc, WorkerRemoteError) and exc.remote_type == "AsyncRefitError"
        assert DROPPED in str(exc)
