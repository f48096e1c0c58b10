"""The bad days: readers that outlive a timeout, trainers that fail, bad versions."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
import torch

from asyncrefit import (
    AsyncRefitError,
    ClosedError,
    LocalTrainer,
    PushError,
    RefitCoordinator,
    TransportError,
    WorkerDiedError,
    WorkerTimeoutError,
    cpu_device,
)
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.abc import SourceInfo
from asyncrefit.local import spawn_local_workers
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults
from asyncrefit.planning import Bucket, Plan
from asyncrefit.transport import Handle, SharedMemoryExporter

from .fakes import FakeWorker, Faults
from .helpers import step
from .models import make_mlp

KIB = 1024
POISON = 0xFF  # bytes of NaN in every float dtype we use


class PoisoningExporter(SharedMemoryExporter):
    """Poisons a slot each time it is handed out for packing (that is, reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.packs: list[int] = []

    def buffer(self, slot: int) -> torch.Tensor:
        buffer = super().buffer(slot)
        buffer.fill_(POISON)
        self.packs.append(slot)
        return buffer


async def test_a_slot_is_not_reused_while_a_timed_out_worker_may_still_read_it() -> None:
    model = make_mlp()
    exporter = PoisoningExporter()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    late = workers[1]
    async with RefitCoordinator(
        trainer=LocalTrainer(model, exporter=exporter),
        workers=workers,
        budget_bytes=128 * KIB,
        bucket_bytes=8 * KIB,
        timeout=0.3,
        cleanup_timeout=0.3,
    ) as refit:
        assert refit.plan is not None and len(refit.plan.buckets) >= 3
        await refit.push(1)

        step(model, 2)
        v2 = {n: p.detach().clone() for n, p in model.named_parameters()}
        late.faults = Faults(read_late_at=0, read_late=1.5)
        with pytest.raises(PushError) as info:
            await refit.push(2)
        assert isinstance(info.value.cause, WorkerTimeoutError) and info.value.failed == "w1"
        (slot, readers), *_ = refit.quarantined_slots().items()
        assert readers == {"w1"}

        # Removing the worker does not free the slot it may still read.
        await refit.remove_worker("w1")
        assert refit.quarantined_slots() == {slot: frozenset({"w1"})}

        # Pushes go on with the other slot only: the poisoned reuse never hits `slot`.
        step(model, 3)
        exporter.packs.clear()
        await refit.push(3)
        assert exporter.packs and slot not in exporter.packs
        assert workers[0].equals(model)

        # The late reader finishes: it read version 2's bytes, never poison or v3.
        await anyio.to_thread.run_sync(late.reading.wait)
        bucket0 = refit.plan.buckets[0]
        for entry in bucket0.entries:
            got = late.parameters[entry.name]
            assert torch.equal(got.view(torch.uint8), v2[entry.name].view(torch.uint8)), entry

        # Now it can confirm: the next push settles it and the slot comes back.
        await refit.push(4)
        assert not refit.quarantined_slots()
        assert refit.statistics().in_use == 0


class FailingSource:
    """A trainer source that dies while exporting bucket ``at`` (a trainer crash)."""

    def __init__(self, inner: LocalTrainer, at: int) -> None:
        self.inner, self.at, self.armed = inner, at, False

    async def describe(self) -> SourceInfo:
        return await self.inner.describe()

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        await self.inner.prepare(plan, slots, slot_bytes, checksum=checksum)

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[object]
    ) -> tuple[Handle, ...]:
        if self.armed and bucket.index == self.at:
            raise ConnectionResetError("trainer shard lost")
        return await self.inner.export(bucket, slot, devices)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_trainer_dying_mid_push_aborts_every_worker() -> None:
    model = make_mlp()
    source = FailingSource(LocalTrainer(model), at=2)
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        source.armed = True
        step(model, 2)
        with pytest.raises(PushError) as info:
            await refit.push(2)
        err = info.value
        assert isinstance(err.cause, ConnectionResetError) and err.failed is None
        assert set(err.incomplete) == {"w0", "w1"}
        for w in workers:
            assert ("abort", 2) in w.calls
            assert await w.weight_version() is None  # buckets 0-1 of v2 were written
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        source.armed = False
        await refit.push(3)
        assert all(w.equals(model) for w in workers)


async def test_no_free_slot_is_a_clear_error_not_a_hang() -> None:
    model = make_mlp()
    workers = [FakeWorker.like("w0", cpu_device(0), model)]
    workers[0].faults = Faults(hang_at_bucket=0)
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, timeout=0.2, cleanup_timeout=0.2
    ) as refit:
        with pytest.raises(PushError):
            await refit.push(1)
        # its only slot is quarantined: the next push says so at once
        with anyio.fail_after(5), pytest.raises(AsyncRefitError, match="no staging slot"):
            await refit.push(2)


async def test_sigkill_mid_copy_is_reported_fast_and_a_replacement_joins() -> None:
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(kill_at_bucket=1)}
    async with spawn_with_faults(make_mlp, 2, faults=faults) as workers:
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=64 * KIB, timeout=30
        ) as refit:
            started = anyio.current_time()
            with pytest.raises(PushError) as info:
                await refit.push(1)
            # far sooner than the 30 s timeout: the closed socket says it at once
            assert anyio.current_time() - started < 10
            assert isinstance(info.value.cause, WorkerDiedError)
            assert info.value.failed == "worker-1"
            assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
            await refit.remove_worker("worker-1")
            async with spawn_local_workers(
                make_mlp, 1, names=["replacement"], devices=["cpu:1"]
            ) as (replacement,):
                await refit.add_worker(replacement)
                step(model, 2)
                await refit.push(2)
                want = {n: tensor_digest(p) for n, p in model.named_parameters()}
                for w in (workers[0], replacement):
                    assert await w.weight_version() == 2
                    assert await w.parameter_digests() == want
                await refit.remove_worker("replacement")


class RefusingSource(LocalTrainer):
    """A source that cannot allocate its buffers."""

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        raise TransportError("/dev/shm is full")


async def test_a_source_failing_at_entry_raises_its_own_typed_error() -> None:
    model = make_mlp()
    workers = [FakeWorker.like("w0", cpu_device(0), model)]
    with pytest.raises(TransportError, match="full"):  # one error, not an exception group
        async with RefitCoordinator(
            trainer=RefusingSource(model), workers=workers, budget_bytes=64 * KIB
        ):
            pytest.fail("entered")
    assert workers[0].calls == []


# --- bookkeeping by identity, not by name (issue 11, item 8) ----------------------------


async def test_a_new_worker_under_an_old_name_cannot_free_the_old_ones_slot() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    late = workers[1]
    async with RefitCoordinator(
        trainer=model,
        workers=workers,
        budget_bytes=256 * KIB,
        bucket_bytes=8 * KIB,
        timeout=0.3,
        cleanup_timeout=0.2,
    ) as refit:
        await refit.push(1)
        late.faults = Faults(read_late_at=0, read_late=4.0)
        with pytest.raises(PushError):
            await refit.push(2)
        held = refit.quarantined_slots()
        assert list(held.values()) == [frozenset({"w1"})]
        await refit.remove_worker("w1")  # it cannot confirm yet: the slot stays held

        # A replacement under the same name joins, and dies in its first push.
        replacement = FakeWorker.like("w1", cpu_device(1), model, Faults(die_at_bucket=1))
        await refit.add_worker(replacement)
        with pytest.raises(PushError) as info:
            await refit.push(3)
        assert isinstance(info.value.cause, WorkerDiedError)
        # The old reader is still reading that slot: it must stay held.
        assert refit.quarantined_slots() == held
        assert not late.reading.is_set()

        await refit.remove_worker("w1")
        await anyio.to_thread.run_sync(late.reading.wait)
        await refit.push(4)  # now the old worker confirms, and the slot comes back
        assert not refit.quarantined_slots() and refit.statistics().in_use == 0
        assert workers[0].equals(model)


# --- removal and closing (issue 11, item 9) -----------------------------------------------


async def test_a_removed_worker_that_is_alive_is_told_to_release_its_handles() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        assert len(workers[1].receiver._importers["shm"]) > 0  # type: ignore[arg-type]
        await refit.remove_worker("w1")
        assert workers[1].calls[-1] == ("release", 0)
        assert len(workers[1].receiver._importers["shm"]) == 0  # type: ignore[arg-type]
        step(model, 2)
        await refit.push(2)
        assert ("release", 0) not in workers[0].calls


async def test_a_removed_straggler_releases_its_handles_once_it_confirms() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    late = workers[1]
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, timeout=0.3, cleanup_timeout=0.2
    ) as refit:
        await refit.push(1)
        late.faults = Faults(read_late_at=0, read_late=1.0)
        with pytest.raises(PushError):
            await refit.push(2)
        await refit.remove_worker("w1")
        assert ("release", 0) not in late.calls  # it has not confirmed yet
        await anyio.to_thread.run_sync(late.reading.wait)
        await refit.push(3)  # settles it: abort confirmed, then its handles released
        assert late.calls[-2:] == [("abort", 2), ("release", 0)]
        assert not refit.quarantined_slots()


async def test_closing_cancels_a_push_that_would_never_end() -> None:
    model = make_mlp()
    # whole: one slot per bucket of this plan, so w1 hangs holding exactly one
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model, whole=True) for i in range(2)]
    refit = RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, timeout=None, cleanup_timeout=0.3
    )
    errors: list[BaseException] = []

    async def pusher() -> None:
        try:
            await refit.push(2)
        except PushError as exc:
            errors.append(exc)

    async with refit:
        await refit.push(1)
        workers[1].faults = Faults(hang_at_bucket=0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pusher)
            await anyio.sleep(0.1)
            with anyio.fail_after(3):  # no timeout: without aclose's bound, forever
                await refit.aclose()
    (error,) = errors
    assert isinstance(error, PushError) and isinstance(error.cause, ClosedError)
    assert set(error.incomplete) == {"w0", "w1"}
    # w1 never confirmed its abort: its slot stays held (freed with the source).
    assert list(refit.quarantined_slots().values()) == [frozenset({"w1"})]
