"""Begins ahead: workers written directly begin while the push reads the trainer.

When every worker of a push is written directly and can take a begin back
(:class:`~asyncrefit.abc.RestoringWorker`: local workers, vLLM ranks), a push begins
them while it reads the trainer's tensors, so the begins' round trip overlaps the read.
The tests check that it does (the read waits for the begins), and what happens when
the read finds the plan no longer holds, fails, or a worker refuses its begin: nothing
was written, so every worker holds the version it held before (bitwise, and as the
coordinator sees it), and the version's number stays free.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractContextManager

import anyio
import pytest
import torch

from asyncrefit import (
    LocalTrainer,
    ParameterMismatchError,
    PushError,
    RefitCoordinator,
)
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.abc import RestoringWorker, SourceInfo
from asyncrefit.events import PushBegun
from asyncrefit.local import spawn_local_workers

from .fakes import DirectFakeWorker, Faults, PlainDirectFakeWorker, direct_workers
from .helpers import assert_hold, digests, no_loop_errors, own_segments, step
from .models import make_mlp

KIB = 1024


@pytest.fixture(autouse=True)
async def loop_errors_fail_the_test() -> AsyncIterator[None]:
    async with no_loop_errors():
        yield


class ReadTrainer(LocalTrainer):
    """A :class:`LocalTrainer` whose reads (``describe``) first await ``before_read``."""

    before_read: Callable[[], Awaitable[None]] | None = None

    async def describe(self) -> SourceInfo:
        if self.before_read is not None:
            await self.before_read()
        return await super().describe()


def fakes(
    model: torch.nn.Module, count: int, *, restoring: bool = True
) -> AbstractContextManager[list[PlainDirectFakeWorker]]:
    kind = DirectFakeWorker if restoring else PlainDirectFakeWorker
    return direct_workers(kind, model, count)


def layer(model: torch.nn.Module, index: int) -> torch.nn.Linear:
    found = model.get_submodule(str(index))
    assert isinstance(found, torch.nn.Linear)
    return found


def begun(workers: Sequence[PlainDirectFakeWorker], version: int) -> bool:
    return all(("begin_direct", version) in w.calls for w in workers)


async def until_begun(workers: Sequence[PlainDirectFakeWorker], version: int) -> None:
    """Wait (at most 5 s) until every worker began ``version``."""
    for _ in range(5000):
        if begun(workers, version):
            return
        await anyio.sleep(0.001)
    raise AssertionError(f"the workers did not begin {version} while the trainer was read")


def reads_record(
    trainer: ReadTrainer, workers: Sequence[PlainDirectFakeWorker], version: list[int]
) -> list[bool]:
    """Have each read of ``trainer`` record whether every worker's last call by then
    (after letting other tasks run) was its begin of ``version[0]``."""
    seen: list[bool] = []

    async def before_read() -> None:
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        seen.append(all(w.calls[-1:] == [("begin_direct", version[0])] for w in workers))

    trainer.before_read = before_read
    return seen


def test_local_workers_and_the_fakes_can_take_a_begin_back() -> None:
    model = make_mlp()
    with fakes(model, 1) as (restoring,), fakes(model, 1, restoring=False) as (plain,):
        assert isinstance(restoring, RestoringWorker)
        assert not isinstance(plain, RestoringWorker)


async def test_workers_begin_while_the_trainers_tensors_are_read() -> None:
    """The read waits until every worker began: a push that read before it began
    would wait forever (here: fail after 5 s)."""
    model = make_mlp()
    trainer = ReadTrainer(model)
    with fakes(model, 3) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            step(model, 1)
            await refit.push(1)  # the first push plans: it reads first
            pushing = 2

            async def read_after_the_begins() -> None:
                await until_begun(workers, pushing)

            trainer.before_read = read_after_the_begins
            for pushing in (2, 3):
                step(model, pushing)
                await refit.push(pushing)
                for w in workers:
                    assert w.calls[-2:] == [("begin_direct", pushing), ("commit", pushing)]
                    assert w.equals(model)
    assert own_segments() == []


async def test_workers_that_cannot_take_a_begin_back_begin_after_the_read() -> None:
    model = make_mlp()
    trainer = ReadTrainer(model)
    with fakes(model, 3, restoring=False) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            version = [1]
            seen = reads_record(trainer, workers, version)
            for version[0] in (1, 2, 3):
                step(model, version[0])
                await refit.push(version[0])
                assert all(w.equals(model) for w in workers)
            assert seen == [False, False, False]  # one read per push, each before the begins


async def test_a_changed_plan_found_after_the_begins_takes_them_back_and_plans_again() -> None:
    """The trainer's weights changed dtype (castable: the plan changes, the workers
    still match). The begins made ahead are taken back before any write, the push
    plans again and goes on; the next push reads first, the one after begins ahead."""
    model = make_mlp()
    trainer = ReadTrainer(model)
    with fakes(model, 2) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            await refit.push(1)
            version = [2]
            seen = reads_record(trainer, workers, version)
            model.to(torch.float64)
            step(model, 2)
            begins: list[int] = []
            refit.subscribe(
                lambda e: begins.append(e.version) if isinstance(e, PushBegun) else None
            )
            await refit.push(2)
            assert begins == [2]  # announced once, by the push that went on
            as_held = copy.deepcopy(model).to(torch.float32)
            for w in workers:
                assert w.calls[-5:] == [
                    ("begin_direct", 2),
                    ("abort_unwritten", 2),
                    ("destinations", 0),  # planned again
                    ("begin_direct", 2),
                    ("commit", 2),
                ]
                assert w.equals(as_held)
            assert seen == [True, False]  # the push read again after taking back
            for version[0] in (3, 4):
                step(model, version[0])
                await refit.push(version[0])
            assert seen == [True, False, False, True]
            assert refit.versions() == {"w0": 4, "w1": 4}


async def test_a_plan_that_no_longer_holds_leaves_the_workers_their_version() -> None:
    """A parameter changed shape: the push raises the plan's error as a push that
    read first would, and every worker holds version 1 (bitwise, and as the
    coordinator sees it); version 2 may still be pushed once the shape is back."""
    model = make_mlp()
    with fakes(model, 2) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as refit:
            step(model, 1)
            await refit.push(1)
            held = digests(model)
            first = layer(model, 0).weight
            layer(model, 0).weight = torch.nn.Parameter(torch.zeros(255, 64))
            with pytest.raises(ParameterMismatchError):
                await refit.push(2)
            for w in workers:
                assert w.calls[-2:] == [("begin_direct", 2), ("abort_unwritten", 2)]
                assert await w.weight_version() == 1
                assert {n: tensor_digest(t) for n, t in w.parameters.items()} == held
            assert refit.versions() == {"w0": 1, "w1": 1} and refit.version == 1
            layer(model, 0).weight = first
            step(model, 2)
            await refit.push(2)
            assert all(w.equals(model) for w in workers)
    assert own_segments() == []


async def test_a_read_that_fails_after_the_begins_raises_and_loses_nothing() -> None:
    model = make_mlp()
    trainer = ReadTrainer(model)
    with fakes(model, 2) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            await refit.push(1)

            async def fail() -> None:
                await until_begun(workers, 2)
                raise RuntimeError("the trainer's tensors could not be read")

            trainer.before_read = fail
            with pytest.raises(RuntimeError, match="could not be read"):
                await refit.push(2)
            for w in workers:
                assert w.calls[-1] == ("abort_unwritten", 2)
                assert await w.weight_version() == 1
            assert refit.versions() == {"w0": 1, "w1": 1}
            trainer.before_read = None
            step(model, 2)
            await refit.push(2)
            assert all(w.equals(model) for w in workers)


async def test_a_begin_refused_before_any_write_leaves_every_worker_its_version() -> None:
    """One worker refuses its begin: the push fails naming it, and since nothing was
    written, no worker is left without a complete version."""
    model = make_mlp()
    with fakes(model, 3) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as refit:
            step(model, 1)
            await refit.push(1)
            one = layer(model, 0).weight.detach().clone()
            workers[1].faults = Faults(fail_at_begin=True)
            step(model, 2)
            with pytest.raises(PushError) as info:
                await refit.push(2)
            assert info.value.failed == "w1" and info.value.incomplete == ()
            for w in workers:
                assert ("abort_unwritten", 2) in w.calls
                assert await w.weight_version() == 1
                assert torch.equal(w.parameters["0.weight"], one)
            assert refit.versions() == {"w0": 1, "w1": 1, "w2": 1}
            workers[1].faults = Faults()
            await refit.push(3)
            assert all(w.equals(model) for w in workers)


@pytest.mark.timeout(120)
async def test_local_processes_keep_their_version_when_the_plan_no_longer_holds() -> None:
    """Real worker processes (shared parameters): begun ahead, taken back over the
    wire; the bytes and versions of version 1 stay, the same number is pushed next."""
    model = make_mlp()
    async with spawn_local_workers(make_mlp, 2, shared_parameters=True) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as refit:
            step(model, 1)
            await refit.push(1)
            step(model, 2)
            await refit.push(2)  # begun ahead
            await assert_hold(workers, model, 2)
            held = digests(model)
            first = layer(model, 2).weight
            layer(model, 2).weight = torch.nn.Parameter(torch.zeros(64, 255))
            with pytest.raises(ParameterMismatchError):
                await refit.push(3)
            for w in workers:
                assert await w.weight_version() == 2
                assert await w.parameter_digests() == held
            layer(model, 2).weight = first
            step(model, 3)
            await refit.push(3)
            await assert_hold(workers, model, 3)
    assert own_segments() == []
