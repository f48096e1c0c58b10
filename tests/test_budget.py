"""ByteBudget: the byte-weighted, FIFO-fair async semaphore."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from asyncrefit import BudgetStatistics, CapacityExceededError
from asyncrefit.planning import ByteBudget


def stats(budget: ByteBudget) -> tuple[int, int, int, int]:
    s = budget.statistics()
    return (s.capacity, s.in_use, s.waiters, s.peak)


async def test_immediate_grant_and_release() -> None:
    budget = ByteBudget(100)
    assert budget.capacity == 100
    assert stats(budget) == (100, 0, 0, 0)
    with anyio.fail_after(1):
        await budget.acquire(60)
        await budget.acquire(40)
    assert stats(budget) == (100, 100, 0, 100)
    budget.release(70)
    assert stats(budget) == (100, 30, 0, 100)
    await budget.acquire(0)  # a zero-byte request is granted even when full
    budget.release(30)
    assert stats(budget) == (100, 0, 0, 100)


async def test_waits_until_release() -> None:
    budget = ByteBudget(10)
    await budget.acquire(8)
    got = anyio.Event()

    async def want(n: int) -> None:
        await budget.acquire(n)
        got.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 5)
        await anyio.wait_all_tasks_blocked()
        assert not got.is_set()
        assert stats(budget) == (10, 8, 1, 8)
        budget.release(2)  # 6 in use: 5 more do not fit yet
        await anyio.wait_all_tasks_blocked()
        assert not got.is_set()
        assert stats(budget) == (10, 6, 1, 8)
        budget.release(1)  # 5 in use: now they fit
        with anyio.fail_after(1):
            await got.wait()
    assert stats(budget) == (10, 10, 0, 10)


async def test_fifo_big_head_is_not_overtaken() -> None:
    budget = ByteBudget(10)
    await budget.acquire(10)
    granted: list[str] = []

    async def want(name: str, n: int) -> None:
        await budget.acquire(n)
        granted.append(name)

    async with anyio.create_task_group() as tg:
        # Arrival order: big first, then small ones that would fit earlier on their own.
        for name, n in [("big", 6), ("s1", 3), ("s2", 1), ("s3", 4)]:
            tg.start_soon(want, name, n)
            await anyio.wait_all_tasks_blocked()
        assert stats(budget) == (10, 10, 4, 10)

        budget.release(3)  # 7 in use: s1 (3) would fit, but big (6) is at the head
        await anyio.wait_all_tasks_blocked()
        assert granted == []
        assert stats(budget) == (10, 7, 4, 10)

        budget.release(3)  # 4 in use: big fits (10); s1 no longer fits
        await anyio.wait_all_tasks_blocked()
        assert granted == ["big"]
        assert stats(budget) == (10, 10, 3, 10)

        budget.release(6)  # 4 in use: s1 (7) and s2 (8) fit, s3 (12) does not
        await anyio.wait_all_tasks_blocked()
        assert granted == ["big", "s1", "s2"]
        assert stats(budget) == (10, 8, 1, 10)

        budget.release(2)
        await anyio.wait_all_tasks_blocked()
        assert granted == ["big", "s1", "s2", "s3"]
    assert stats(budget) == (10, 10, 0, 10)


async def test_newcomer_queues_behind_waiter_even_if_it_fits() -> None:
    budget = ByteBudget(10)
    await budget.acquire(5)
    order: list[str] = []

    async def want(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, "big", 8)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(want, "small", 1)  # 5 + 1 <= 10, but big is waiting
        await anyio.wait_all_tasks_blocked()
        assert order == []
        assert stats(budget) == (10, 5, 2, 5)
        budget.release(5)
        await anyio.wait_all_tasks_blocked()
        assert order == ["big", "small"]
    assert stats(budget) == (10, 9, 0, 9)


async def test_cancelled_waiter_holds_nothing() -> None:
    budget = ByteBudget(10)
    await budget.acquire(10)
    reached = False

    async def want() -> None:
        nonlocal reached
        await budget.acquire(4)
        reached = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.wait_all_tasks_blocked()
        assert stats(budget) == (10, 10, 1, 10)
        tg.cancel_scope.cancel()
    assert not reached
    assert stats(budget) == (10, 10, 0, 10)
    budget.release(10)
    assert stats(budget) == (10, 0, 0, 10)
    with anyio.fail_after(1):
        await budget.acquire(10)  # the whole capacity is free again


async def test_cancelling_the_head_lets_those_behind_proceed() -> None:
    budget = ByteBudget(10)
    await budget.acquire(6)
    done: list[str] = []

    async def want(name: str, n: int) -> None:
        await budget.acquire(n)
        done.append(name)

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as head_scope:
            async with anyio.create_task_group() as head_tg:
                head_tg.start_soon(want, "head", 8)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(want, "a", 2)
                tg.start_soon(want, "b", 2)
                await anyio.wait_all_tasks_blocked()
                assert done == []
                assert stats(budget) == (10, 6, 3, 6)
                head_scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert sorted(done) == ["a", "b"]
    assert stats(budget) == (10, 10, 0, 10)


async def test_cancelled_right_after_grant_gives_bytes_back() -> None:
    budget = ByteBudget(10)
    await budget.acquire(10)

    async def holder() -> None:
        async with budget.hold(7):
            await anyio.sleep_forever()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await anyio.wait_all_tasks_blocked()
            assert stats(budget) == (10, 10, 1, 10)
            budget.release(10)  # grants the waiter ...
            assert stats(budget) == (10, 7, 0, 10)
            scope.cancel()  # ... which is cancelled before it ran again
    assert stats(budget) == (10, 0, 0, 10)


async def test_request_larger_than_capacity_raises_at_once() -> None:
    budget = ByteBudget(10)
    await budget.acquire(3)
    with anyio.fail_after(1), pytest.raises(CapacityExceededError) as info:
        await budget.acquire(11)
    assert info.value.requested == 11
    assert info.value.capacity == 10
    assert "11" in str(info.value) and "10" in str(info.value)
    assert stats(budget) == (10, 3, 0, 3)


async def test_negative_request_raises_value_error() -> None:
    budget = ByteBudget(10)
    with pytest.raises(ValueError, match="non-negative"):
        await budget.acquire(-1)
    assert stats(budget) == (10, 0, 0, 0)


def test_negative_capacity_raises() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ByteBudget(-1)


async def test_zero_capacity_grants_only_nothing() -> None:
    # Nothing staged (every worker written directly): the budget holds no bytes.
    budget = ByteBudget(0)
    await budget.acquire(0)
    with pytest.raises(CapacityExceededError):
        await budget.acquire(1)


async def test_over_release_raises_runtime_error() -> None:
    budget = ByteBudget(10)
    await budget.acquire(4)
    with pytest.raises(RuntimeError, match="releasing 5 bytes but 4"):
        budget.release(5)
    with pytest.raises(RuntimeError):
        budget.release(-1)
    assert stats(budget) == (10, 4, 0, 4)
    budget.release(4)
    with pytest.raises(RuntimeError):
        budget.release(1)


async def test_statistics_is_a_frozen_snapshot() -> None:
    budget = ByteBudget(50)
    await budget.acquire(20)
    snap = budget.statistics()
    assert isinstance(snap, BudgetStatistics)
    assert dataclasses.is_dataclass(snap)
    assert {f.name for f in dataclasses.fields(snap)} == {"capacity", "in_use", "waiters", "peak"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.in_use = 0  # type: ignore[misc]
    await budget.acquire(25)
    budget.release(45)
    assert (snap.capacity, snap.in_use, snap.waiters, snap.peak) == (50, 20, 0, 20)
    assert stats(budget) == (50, 0, 0, 45)
    assert "in_use=0/50" in repr(budget)


async def test_hold_releases_on_exit_and_on_exception() -> None:
    budget = ByteBudget(10)
    async with budget.hold(6):
        assert stats(budget) == (10, 6, 0, 6)
    assert stats(budget) == (10, 0, 0, 6)
    with pytest.raises(KeyError):
        async with budget.hold(9):
            assert budget.statistics().in_use == 9
            raise KeyError("boom")
    assert stats(budget) == (10, 0, 0, 9)


async def test_peak_tracks_concurrent_holders() -> None:
    budget = ByteBudget(10)
    gate = anyio.Event()

    async def user(n: int) -> None:
        async with budget.hold(n):
            await gate.wait()

    async with anyio.create_task_group() as tg:
        for n in (3, 4, 5):  # 3 + 4 fit; 5 waits
            tg.start_soon(user, n)
        await anyio.wait_all_tasks_blocked()
        assert stats(budget) == (10, 7, 1, 7)
        gate.set()
    capacity, in_use, waiters, peak = stats(budget)
    assert (capacity, in_use, waiters) == (10, 0, 0)
    assert 8 <= peak <= 10  # 5 joined whichever holder was left
