"""The first direct write waits at a gate: handed over early, written only once all began.

A push whose sources take gated writes (:class:`~asyncrefit.abc.GatedWritingSource`,
as :class:`~asyncrefit.LocalTrainer` does) hands its first write to them while the
workers are still beginning, so the write starts as soon as the last begin is
answered. The tests hold a worker's begin and check that the write was handed over,
that nothing was written meanwhile (invariant 3: no write before every begin), that it
goes on once the begin is answered, that a push cancelled or failed at the gate
writes nothing, returns, and leaves every worker its version, and that one cancelled
while it writes stops before the next bucket.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch

from asyncrefit import LocalTrainer, PushError, RefitCoordinator
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.abc import GatedWritingSource, WriteGate
from asyncrefit.planning import Bucket

from .fakes import DirectFakeWorker, PlainDirectFakeWorker, direct_workers
from .helpers import no_loop_errors, own_segments, step
from .models import make_mlp

KIB = 1024


@pytest.fixture(autouse=True)
async def loop_errors_fail_the_test() -> AsyncIterator[None]:
    async with no_loop_errors():
        yield


@dataclass
class HeldBegin:
    """Holds the begins of one worker until released (then fails them, if told)."""

    released: anyio.Event = field(default_factory=anyio.Event)
    waiting: anyio.Event = field(default_factory=anyio.Event)
    refuse: bool = False


@dataclass
class SlowRestoring(DirectFakeWorker):
    held: HeldBegin | None = None

    async def begin_direct(self, version: int) -> None:
        if self.held is not None:
            self.held.waiting.set()
            await self.held.released.wait()
            if self.held.refuse:
                raise RuntimeError("injected failure at a held begin")
        await super().begin_direct(version)


@dataclass
class SlowPlain(PlainDirectFakeWorker):
    held: HeldBegin | None = None

    async def begin_direct(self, version: int) -> None:
        if self.held is not None:
            self.held.waiting.set()
            await self.held.released.wait()
        await super().begin_direct(version)


def fakes(
    model: torch.nn.Module, count: int, *, restoring: bool
) -> AbstractContextManager[Sequence[SlowRestoring | SlowPlain]]:
    return direct_workers(SlowRestoring if restoring else SlowPlain, model, count)


def gates_of(trainer: LocalTrainer) -> list[WriteGate]:
    """Record the gate of every gated write ``trainer`` is handed."""
    gates: list[WriteGate] = []
    write_gated = trainer.write_gated

    async def recorded(buckets: Sequence[Bucket], workers: Sequence[str], gate: WriteGate) -> bool:
        gates.append(gate)
        return await write_gated(buckets, workers, gate)

    trainer.write_gated = recorded  # type: ignore[method-assign]
    return gates


def held_bytes(worker: SlowRestoring | SlowPlain) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in worker.parameters.items()}


async def until_handed_over(gates: list[WriteGate], count: int, held: HeldBegin) -> None:
    """Wait until the trainer was handed the write of push ``count`` (its gate is the
    ``count``-th) and the held begin is waiting."""
    await until(lambda: len(gates) == count, f"push {count}'s gated write")
    await held.waiting.wait()


async def until(condition: object, what: str) -> None:
    for _ in range(5000):
        if callable(condition) and condition():
            return
        await anyio.sleep(0.001)
    raise AssertionError(f"waited 5 s for {what}")


def test_local_trainers_take_gated_writes() -> None:
    assert isinstance(LocalTrainer(make_mlp()), GatedWritingSource)


@pytest.mark.parametrize("restoring", [True, False], ids=["begun-ahead", "read-first"])
async def test_the_first_write_waits_at_the_gate_until_every_worker_began(restoring: bool) -> None:
    """One worker's begin is held: the first write is handed to the trainer, which
    writes nothing (no worker's bytes change) until that begin is answered."""
    model = make_mlp()
    trainer = LocalTrainer(model)
    gates = gates_of(trainer)
    with fakes(model, 2, restoring=restoring) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            step(model, 1)
            await refit.push(1)
            assert len(gates) == 1 and gates[0].decided
            before = [held_bytes(w) for w in workers]
            held = HeldBegin()
            workers[1].held = held
            step(model, 2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(refit.push, 2)
                await until_handed_over(gates, 2, held)
                await anyio.sleep(0.05)  # the trainer's thread waits at the gate
                assert not gates[1].decided
                assert [held_bytes(w) for w in workers] == before
                assert ("begin_direct", 2) in workers[0].calls
                held.released.set()
            assert all(w.equals(model) for w in workers)
            assert refit.versions() == {"w0": 2, "w1": 2}
    assert own_segments() == []


async def test_a_push_cancelled_at_the_gate_writes_nothing_and_returns() -> None:
    """Cancelled while its first write waits at the gate: the gate is shut, the
    trainer's thread returns without writing, and every worker holds version 1."""
    model = make_mlp()
    trainer = LocalTrainer(model)
    gates = gates_of(trainer)
    with fakes(model, 2, restoring=True) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            step(model, 1)
            await refit.push(1)
            before = [held_bytes(w) for w in workers]
            held = HeldBegin()
            workers[0].held = held
            step(model, 2)
            with anyio.fail_after(10):  # a thread left at the gate would hang here
                async with anyio.create_task_group() as tg:
                    tg.start_soon(refit.push, 2)
                    await until_handed_over(gates, 2, held)
                    tg.cancel_scope.cancel()
            assert gates[1].decided and not gates[1].wait()  # shut
            assert [held_bytes(w) for w in workers] == before
            assert refit.versions() == {"w0": 1, "w1": 1}
            workers[0].held = None
            await refit.push(3)
            assert all(w.equals(model) for w in workers)
    assert own_segments() == []


async def test_a_begin_refused_at_the_gate_writes_nothing() -> None:
    """The held begin is refused after the first write was handed over: the push
    fails naming that worker, nothing was written, no worker is left incomplete."""
    model = make_mlp()
    trainer = LocalTrainer(model)
    gates = gates_of(trainer)
    with fakes(model, 3, restoring=True) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            step(model, 1)
            await refit.push(1)
            held_model = copy.deepcopy(model)
            held = HeldBegin(refuse=True)
            workers[2].held = held
            step(model, 2)

            async def release_once_handed_over() -> None:
                await until_handed_over(gates, 2, held)
                held.released.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(release_once_handed_over)
                with pytest.raises(PushError) as info:
                    await refit.push(2)
            assert info.value.failed == "w2" and info.value.incomplete == ()
            assert not gates[1].wait()
            assert all(w.equals(held_model) for w in workers)
            assert refit.versions() == {"w0": 1, "w1": 1, "w2": 1}
            workers[2].held = None
            await refit.push(3)
            assert all(w.equals(model) for w in workers)
    assert own_segments() == []


async def test_a_push_cancelled_while_it_writes_stops_at_the_next_bucket() -> None:
    """Every bucket goes to the trainer in one call; cancelled after the first bucket
    was written, the trainer writes no further bucket, the push aborts the workers,
    and the next push gives them a complete version."""
    model = make_mlp()
    trainer = LocalTrainer(model)
    gates = gates_of(trainer)
    issued: list[int] = []
    first_issued, go_on = threading.Event(), threading.Event()
    write = trainer._write

    def counted(bucket: Bucket, workers: Any, lanes: Any) -> None:
        write(bucket, workers, lanes)
        issued.append(bucket.index)
        if len(issued) == 1:
            first_issued.set()
            go_on.wait(10)

    with fakes(model, 2, restoring=True) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            assert refit.plan is not None and len(refit.plan.buckets) > 2
            step(model, 1)
            await refit.push(1)
            trainer._write = counted  # type: ignore[method-assign]
            step(model, 2)
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(refit.push, 2)
                    await until(first_issued.is_set, "the first bucket's write")
                    tg.cancel_scope.cancel()
                    with anyio.CancelScope(shield=True):
                        await until(lambda: gates[-1].stopped, "the gate to stop")
                        go_on.set()
            assert issued == [0]  # no further bucket
            assert refit.versions() == {"w0": None, "w1": None}
            trainer._write = write  # type: ignore[method-assign]
            step(model, 3)
            await refit.push(3)
            assert all(w.equals(model) for w in workers)
    assert own_segments() == []


def test_the_gate_is_decided_once() -> None:
    """Opened, a gate lets a thread's wait go and stops it only once shut; shut first,
    it stays shut (an open after that lets nothing go)."""
    opened = WriteGate()
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(opened.wait()))
    waiter.start()
    assert not opened.decided
    opened.open()
    waiter.join(5)
    assert seen == [True] and opened.wait() and not opened.stopped
    opened.shut()
    assert opened.stopped and opened.wait()  # the writes began: they stop
    shut = WriteGate()
    shut.shut()
    shut.open()
    assert shut.decided and not shut.wait() and not shut.stopped
    assert "shut" in repr(shut) and "stopped" in repr(opened)
