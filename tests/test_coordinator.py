"""The coordinator against in-process fake workers: routing, acks, versions, errors."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
import torch

from asyncrefit import (
    BudgetTooSmallError,
    DeviceId,
    DuplicateWorkerError,
    LocalTrainer,
    ParameterMismatchError,
    ParamSpec,
    PushError,
    RefitCoordinator,
    SourceDiedError,
    SourceRemoteError,
    UnknownDeviceError,
    UnknownWorkerError,
    VersionError,
    WorkerDiedError,
    WorkerProtocolError,
    WorkerRemoteError,
    WorkerTimeoutError,
    cpu_device,
)
from asyncrefit.abc import SourceInfo, TransmittingSource
from asyncrefit.planning import Bucket, Plan
from asyncrefit.transport import Handle

from .fakes import FakeWorker, Faults
from .helpers import own_segments, step
from .models import make_mixed, make_mlp, make_mlp_wide

KIB = 1024


def fakes(module: torch.nn.Module, devices: int, **faults: Faults) -> list[FakeWorker]:
    return [
        FakeWorker.like(f"w{i}", cpu_device(i), module, faults.get(f"w{i}")) for i in range(devices)
    ]


async def test_push_copies_bitwise_and_reports() -> None:
    model = make_mlp()
    workers = fakes(model, 2)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        for version in (1, 2, 3):
            step(model, version)
            report = await refit.push(version)
            assert all(w.equals(model) for w in workers)
            assert [await w.weight_version() for w in workers] == [version, version]
            assert refit.versions() == {"w0": version, "w1": version}
            assert report.version == version
            assert refit.plan is not None and report.buckets == len(refit.plan.buckets)
            assert report.bytes == sum(p.numel() * 4 for p in model.parameters())
            assert report.workers == ("w0", "w1")
            assert report.seconds > 0 and report.gbps > 0
            assert set(report.handle_bytes_per_worker) == {"w0", "w1"}
        assert refit.version == 3
        assert refit.statistics().in_use == 0
    assert own_segments() == []


async def test_mixed_dtypes_and_special_values_arrive_bit_exact() -> None:
    model = make_mixed()
    with torch.no_grad():
        model.get_parameter("a")[0, :4] = torch.tensor(
            [float("nan"), float("inf"), -float("inf"), -0.0]
        )
        model.get_parameter("b")[:2] = torch.tensor([float("nan"), -0.0], dtype=torch.bfloat16)
    workers = fakes(model, 2)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=8 * KIB) as refit:
        await refit.push(1)
    assert all(w.equals(model) for w in workers)


async def test_each_worker_gets_only_its_own_devices_handle() -> None:
    model = make_mlp()
    workers = fakes(model, 4)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        assert refit.devices == {w.name: w.device for w in workers}
    for w in workers:
        assert w.device_queries == 1
        assert w.handles, "no bucket was sent"
        for handles in w.handles:
            assert [h.device for h in handles] == [w.device]


async def test_workers_sharing_a_device_all_get_that_devices_handle() -> None:
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i // 2), model) for i in range(4)]
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
    assert all(w.equals(model) for w in workers)
    assert {h.device for w in workers[:2] for hs in w.handles for h in hs} == {cpu_device(0)}


@pytest.mark.parametrize("broadcast", [False, True])
async def test_handle_bytes_per_worker_do_not_grow_with_devices(broadcast: bool) -> None:
    per_worker: dict[int, set[int]] = {}
    for devices in (2, 8, 32):
        model = make_mlp()
        workers = fakes(model, devices)
        async with RefitCoordinator(
            trainer=model,
            workers=workers,
            budget_bytes=64 * KIB,
            broadcast_all_handles=broadcast,
        ) as refit:
            report = await refit.push(1)
        # what the coordinator reports is what the workers were sent
        for w in workers:
            assert report.handle_bytes_per_worker[w.name] == sum(w.load_bytes)
        per_worker[devices] = set(report.handle_bytes_per_worker.values())
    # device names of different lengths ("cpu:3" vs "cpu:31") may differ by a few bytes
    sizes = {d: max(s) for d, s in per_worker.items()}
    if broadcast:
        # The pre-filter behaviour grows with the device count. (Not 16x: the handles of
        # one bucket share their layout, which pickle writes once.)
        assert sizes[2] < sizes[8] < sizes[32]
        assert sizes[32] > 3 * sizes[2]
    else:
        assert sizes[32] < 1.05 * sizes[2]


async def test_broadcast_baseline_sends_every_exported_device() -> None:
    model = make_mlp()
    workers = fakes(model, 2)
    trainer = LocalTrainer(model, devices=[cpu_device(i) for i in range(8)])
    async with RefitCoordinator(
        trainer=trainer, workers=workers, budget_bytes=64 * KIB, broadcast_all_handles=True
    ) as refit:
        await refit.push(1)
    assert all(len(hs) == 8 for w in workers for hs in w.handles)
    assert all(w.equals(model) for w in workers)  # each picked its own


async def test_parameter_mismatch_is_found_before_any_byte_moves() -> None:
    model = make_mlp()
    good = FakeWorker.like("good", cpu_device(0), model)
    bad = FakeWorker.like("bad", cpu_device(1), make_mlp_wide())
    with pytest.raises(ParameterMismatchError) as info:
        async with RefitCoordinator(trainer=model, workers=[good, bad], budget_bytes=64 * KIB):
            pytest.fail("entered despite a mismatch")
    assert info.value.worker == "bad"
    assert info.value.parameter == "0.bias"
    assert "bad" in str(info.value) and "0.bias" in str(info.value)
    assert good.calls == [] and bad.calls == []
    assert own_segments() == []


@pytest.mark.parametrize("change", ["name", "dtype", "missing"])
async def test_name_and_dtype_mismatches(change: str) -> None:
    model = make_mlp()
    worker = FakeWorker.like("w", cpu_device(0), model)
    if change == "name":
        worker.parameters["extra"] = torch.zeros(3)
    elif change == "dtype":
        # float to integer is no cast a pack may make (float to float is)
        worker.parameters["2.bias"] = worker.parameters["2.bias"].to(torch.int32)
    else:
        del worker.parameters["2.weight"]
    worker.__post_init__()
    with pytest.raises(ParameterMismatchError) as info:
        async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=64 * KIB):
            pass
    assert (
        info.value.parameter == {"name": "extra", "dtype": "2.bias", "missing": "2.weight"}[change]
    )
    assert worker.calls == []


async def test_budget_smaller_than_a_tensor_is_a_typed_error() -> None:
    """Where a worker takes a tensor only whole (parts: tests/test_parts.py)."""
    model = make_mlp()  # 0.weight is 64 KiB
    workers = [FakeWorker.like("w0", cpu_device(0), model, whole=True)]
    with pytest.raises(BudgetTooSmallError) as info:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=32 * KIB):
            pass
    assert "0.weight" in str(info.value) or "2.weight" in str(info.value)
    assert "worker 'w0' takes only whole" in str(info.value)
    assert workers[0].calls == []
    assert own_segments() == []


async def test_unknown_device_and_duplicate_worker() -> None:
    model = make_mlp()
    remote = FakeWorker.like("remote", DeviceId(node="elsewhere", device="cpu:0"), model)
    with pytest.raises(UnknownDeviceError, match="remote"):
        async with RefitCoordinator(trainer=model, workers=[remote], budget_bytes=64 * KIB):
            pass
    w = FakeWorker.like("same", cpu_device(0), model)
    with pytest.raises(DuplicateWorkerError):
        RefitCoordinator(trainer=model, workers=[w, w], budget_bytes=64 * KIB)
    assert own_segments() == []


async def test_versions_must_increase_and_nothing_moves_otherwise() -> None:
    model = make_mlp()
    workers = fakes(model, 1)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(5)
        calls = list(workers[0].calls)
        for stale in (5, 4):
            with pytest.raises(VersionError):
                await refit.push(stale)
        assert workers[0].calls == calls
        await refit.push(6)
        assert refit.version == 6


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        (Faults(fail_at_bucket=1), WorkerRemoteError),
        (Faults(die_at_bucket=1), WorkerDiedError),
    ],
)
async def test_worker_failure_mid_push(fault: Faults, cause: type[Exception]) -> None:
    model = make_mlp()
    workers = fakes(model, 3)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        workers[1].faults = fault
        step(model, 2)
        with pytest.raises(PushError) as info:
            await refit.push(2)
        err = info.value
        assert isinstance(err.cause, cause) and err.__cause__ is err.cause
        assert err.failed == "w1" and err.version == 2
        assert set(err.incomplete) == {"w0", "w1", "w2"}
        assert "w1" in str(err)
        # the others were told to abort; nobody claims a complete version
        for w in (workers[0], workers[2]):
            assert ("abort", 2) in w.calls
            assert await w.weight_version() is None
        assert refit.versions() == {"w0": None, "w1": None, "w2": None}
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        # the coordinator keeps working without the failed worker
        await refit.remove_worker("w1")
        report = await refit.push(3)
        assert report.workers == ("w0", "w2")
        assert workers[0].equals(model) and workers[2].equals(model)


@pytest.mark.parametrize("at", ["begin_update", "commit_update"])
async def test_one_deadline_for_the_begins_or_commits_names_the_worker_that_hung(at: str) -> None:
    # The begins (and the commits) of a push share one deadline: the worker without an
    # answer at it is named, the push fails once, after about one timeout.
    model = make_mlp()
    workers = fakes(model, 3)
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, timeout=0.3, cleanup_timeout=0.3
    ) as refit:
        await refit.push(1)
        if at == "begin_update":
            workers[1].hung = True
        else:
            workers[1].faults = Faults(hang_at_commit=True)
        start = anyio.current_time()
        with pytest.raises(PushError) as info:
            await refit.push(2)
        took = anyio.current_time() - start
    cause = info.value.cause
    assert isinstance(cause, WorkerTimeoutError)
    assert cause.worker == info.value.failed == "w1"
    assert f"{at} got no answer within 0.3 s" in str(cause)
    assert "w1" in info.value.incomplete
    assert took < 3.0  # one timeout and the abort's bound, not one per worker
    # The others answered: at a begin, they were told to abort; at a commit, they committed.
    ended = ("abort", 2) if at == "begin_update" else ("commit", 2)
    assert ended in workers[0].calls and ended in workers[2].calls


async def test_hung_worker_times_out_and_its_slot_is_held_until_it_is_gone() -> None:
    model = make_mlp()
    workers = fakes(model, 2, w1=Faults(hang_at_bucket=0))
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, timeout=0.5, cleanup_timeout=0.5
    ) as refit:
        with pytest.raises(PushError) as info:
            await refit.push(1)
        assert isinstance(info.value.cause, WorkerTimeoutError)
        assert info.value.failed == "w1"
        # The hung worker may still read slot 0: it must not be reused or freed yet,
        # not even once the worker is removed from the coordinator.
        held = {frozenset({"w1"})}
        assert set(refit.quarantined_slots().values()) == held
        await refit.remove_worker("w1")
        assert set(refit.quarantined_slots().values()) == held
        assert refit.statistics().in_use > 0
        assert refit.versions() == {"w0": None}
        # Once it is known dead, the next push releases its slot first.
        workers[1].hung, workers[1].dead = False, True
        await refit.push(2)
        assert not refit.quarantined_slots() and refit.statistics().in_use == 0
        assert workers[0].equals(model)


async def test_cancelled_push_releases_everything_and_next_push_works() -> None:
    model = make_mlp()
    workers = fakes(model, 2, w0=Faults(delay=0.05), w1=Faults(delay=0.05))
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        with anyio.move_on_after(0.12) as scope:
            await refit.push(1)
        assert scope.cancelled_caught
        assert refit.statistics().in_use == 0
        assert not refit.quarantined_slots()
        assert refit.versions() == {"w0": None, "w1": None}
        for w in workers:
            assert ("abort", 1) in w.calls
            assert await w.weight_version() is None
        for w in workers:
            w.faults.delay = 0
        await refit.push(2)
        assert all(w.equals(model) for w in workers)


async def test_slots_are_reused_only_after_every_ack() -> None:
    """Slow, uneven consumers and two slots: an early reuse would corrupt the copy."""
    model = make_mlp()
    workers = fakes(model, 3, w0=Faults(delay=0.02), w2=Faults(delay=0.005))
    async with RefitCoordinator(
        # 0.weight (64 KiB) and 2.weight go in parts: every slot holds 8 KiB
        trainer=model,
        workers=workers,
        budget_bytes=16 * KIB,
        bucket_bytes=8 * KIB,
    ) as refit:
        assert refit.plan is not None and len(refit.plan.buckets) >= 16
        for version in (1, 2):
            step(model, version)
            report = await refit.push(version)
            assert all(w.equals(model) for w in workers)
            assert report.peak_budget_bytes <= refit.statistics().capacity
            assert report.slots == 2


async def test_concurrent_pushes_never_interleave_on_a_worker() -> None:
    model = make_mlp()
    workers = fakes(model, 2, w0=Faults(delay=0.01))
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        async with anyio.create_task_group() as tg:
            tg.start_soon(refit.push, 1)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(refit.push, 2)
        assert refit.version == 2
    for w in workers:
        versions = [v for kind, v in w.calls if kind != "release"]
        assert versions == sorted(versions), w.calls


async def test_changed_parameter_set_is_revalidated_before_sending() -> None:
    model = make_mlp()
    workers = fakes(model, 1)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        assert isinstance(model, torch.nn.Sequential)
        model[2].bias = torch.nn.Parameter(torch.zeros(65))
        calls = list(workers[0].calls)
        with pytest.raises(ParameterMismatchError, match=r"2\.bias"):
            await refit.push(2)
        assert workers[0].calls == calls


async def test_add_worker_joins_later_pushes() -> None:
    model = make_mlp()
    first = FakeWorker.like("first", cpu_device(0), model)
    late = FakeWorker.like("late", cpu_device(1), model)
    async with RefitCoordinator(trainer=model, workers=[first], budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        await refit.add_worker(late)
        assert refit.versions()["late"] is None
        with pytest.raises(DuplicateWorkerError):
            await refit.add_worker(late)
        step(model, 2)
        await refit.push(2)
        assert late.equals(model) and first.equals(model)
        wide = FakeWorker.like("wide", cpu_device(2), make_mlp_wide())
        with pytest.raises(ParameterMismatchError):
            await refit.add_worker(wide)
        assert "wide" not in refit.versions()


def test_repr_shows_state() -> None:
    model = make_mlp()
    refit = RefitCoordinator(trainer=model, workers=fakes(model, 1), budget_bytes=64 * KIB)
    assert "new" in repr(refit) and "workers=1" in repr(refit)


class TransmittingTrainer(LocalTrainer):
    """A source that also transmits each bucket while the workers load it."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.transmitted: list[int] = []

    async def transmit(self, bucket: Bucket, slot: int) -> None:
        await anyio.lowlevel.checkpoint()
        self.transmitted.append(bucket.index)


async def test_transmitting_source_acts_once_per_bucket_and_bytes_per_transport() -> None:
    model = make_mlp()
    trainer = TransmittingTrainer(model)
    assert isinstance(trainer, TransmittingSource)
    assert not isinstance(LocalTrainer(model), TransmittingSource)
    workers = fakes(model, 2)
    async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=64 * KIB) as refit:
        report = await refit.push(1)
        assert refit.plan is not None
        assert sorted(trainer.transmitted) == list(range(len(refit.plan.buckets)))
    assert report.bytes_per_transport == {"shm": 2 * report.bytes}


def test_a_source_may_serve_remote_devices() -> None:
    remote = DeviceId(node="elsewhere", device="gpu-7")
    info = SourceInfo(name="t", node="here", devices=None, specs=(), remote=frozenset({remote}))
    assert info.serves(remote) and info.serves(DeviceId(node="here", device="x"))
    assert not info.serves(DeviceId(node="elsewhere", device="gpu-6"))
    anywhere = SourceInfo(name="t", node="here", devices=frozenset(), specs=(), remote=None)
    assert anywhere.serves(remote)


# --- a failed re-plan is not remembered as done (issue 11, item 4) ----------------------


async def test_a_rejected_parameter_set_is_rejected_again_at_the_next_push() -> None:
    model = make_mlp()
    workers = fakes(model, 1)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        model.extra = torch.nn.Parameter(torch.ones(8))  # the engine has no such parameter
        calls = list(workers[0].calls)
        for version in (2, 3):
            with pytest.raises(ParameterMismatchError, match="extra"):
                await refit.push(version)
        assert workers[0].calls == calls  # nothing was sent, the second time neither
        del model.extra
        await refit.push(4)
        assert workers[0].equals(model) and refit.version == 4


async def test_a_grown_tensor_over_the_budget_is_refused_at_every_push() -> None:
    model = make_mlp()
    workers = [FakeWorker.like("w0", cpu_device(0), model, whole=True)]
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        assert isinstance(model, torch.nn.Sequential)
        old = model[0].weight
        model[0].weight = torch.nn.Parameter(torch.zeros(256, 128))  # 128 KiB
        for version in (2, 3):
            with pytest.raises(BudgetTooSmallError):
                await refit.push(version)
        model[0].weight = old
        await refit.push(4)
        assert workers[0].equals(model)


class FlakyPrepare(LocalTrainer):
    """Fails its next ``prepare`` after :meth:`arm`: the buffers are gone by then."""

    armed = False
    prepares = 0

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        self.prepares += 1
        await super().prepare(plan, slots, slot_bytes, checksum=checksum)
        if self.armed:
            self.armed = False
            await super().aclose()
            raise OSError("out of pinned memory")


async def test_a_failed_prepare_is_prepared_again_before_the_next_push() -> None:
    model = make_mlp()
    workers = fakes(model, 1)
    tensors = dict(model.named_parameters())
    source = FlakyPrepare(lambda: tensors)
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        # The trainer lists its parameters in another order: a re-plan is due.
        tensors = dict(reversed(tensors.items()))
        source.armed = True
        with pytest.raises(OSError, match="pinned"):
            await refit.push(2)
        prepares = source.prepares
        await refit.push(3)
        assert source.prepares == prepares + 1  # prepared again, not trusted
        assert workers[0].equals(model) and refit.version == 3


# --- versions are fenced by the highest one begun (issue 11, item 5) --------------------


async def test_a_version_a_failed_push_began_is_never_used_again() -> None:
    model = make_mlp()
    workers = fakes(model, 2)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        step(model, 2)
        workers[1].faults = Faults(fail_at_commit=True)
        with pytest.raises(PushError) as info:
            await refit.push(2)
        assert info.value.failed == "w1"
        # w0 committed 2 before w1 failed: a different weight set must not also be 2.
        assert await workers[0].weight_version() == 2
        assert refit.version == 1
        workers[1].faults = Faults()
        step(model, 3)
        with pytest.raises(VersionError, match="failed") as stale:
            await refit.push(2)
        assert stale.value.failed and stale.value.current == 2
        await refit.push(3)
        assert all(w.equals(model) for w in workers) and refit.version == 3


# --- errors say what and where (issue 11, item 13) --------------------------------------


async def test_removing_an_unknown_worker_is_a_typed_key_error_naming_the_workers() -> None:
    model = make_mlp()
    async with RefitCoordinator(
        trainer=model, workers=fakes(model, 2), budget_bytes=64 * KIB
    ) as refit:
        with pytest.raises(UnknownWorkerError, match=r"'nope' \(workers: 'w0', 'w1'\)") as info:
            await refit.remove_worker("nope")
        assert isinstance(info.value, KeyError) and info.value.worker == "nope"


class BadSpecsWorker(FakeWorker):
    async def parameter_specs(self) -> Sequence[ParamSpec]:
        await anyio.lowlevel.checkpoint()
        return [{"name": "0.weight"}]  # type: ignore[list-item]


async def test_specs_of_the_wrong_type_are_a_protocol_error_naming_the_worker() -> None:
    model = make_mlp()
    good = FakeWorker.like("good", cpu_device(0), model)
    bad = BadSpecsWorker(name="bad", device=cpu_device(1), parameters={})
    with pytest.raises(WorkerProtocolError, match=r"'bad'.*item 0 is a dict, not a ParamSpec"):
        async with RefitCoordinator(trainer=model, workers=[good, bad], budget_bytes=64 * KIB):
            pass


# --- the ranks of a sharded trainer: one failing does not cut the others off ---------------


class FailingRank(LocalTrainer):
    """A rank of a sharded trainer (in process) whose export of bucket 1 fails as told."""

    _gathers = True

    def __init__(self, model: torch.nn.Module, device: DeviceId, name: str, how: str) -> None:
        super().__init__(model, devices=[device], node=device.node, name=name)
        self.how = how
        self.started: list[int] = []
        self.ended: list[int] = []

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        self.started.append(bucket.index)
        if bucket.index == 1:
            if self.how == "gather-failed":  # at once: the peer it gathers with is gone
                self.ended.append(1)
                raise SourceRemoteError(self.name, "PackError", "gathering: peer closed")
            await anyio.sleep(0.3)  # the rank's death is noticed later than its peer's error
            self.ended.append(1)
            raise SourceDiedError(self.name, "the actor died")
        handles = await super().export(bucket, slot, devices)
        self.ended.append(bucket.index)
        return handles


async def test_a_rank_that_died_is_the_cause_not_its_peers_failed_gather() -> None:
    model = make_mlp()
    ranks = [
        FailingRank(model, cpu_device(0), "rank-0", "gather-failed"),
        FailingRank(model, cpu_device(1), "rank-1", "died"),
    ]
    workers = fakes(model, 2)
    async with RefitCoordinator(trainer=ranks, workers=workers, budget_bytes=64 * KIB) as refit:
        assert refit.plan is not None and len(refit.plan.buckets) > 2
        with pytest.raises(PushError) as err:
            await refit.push(1)
        # rank-0 failed first, but rank-1's export was seen through: its death is the cause
        assert isinstance(err.value.cause, SourceDiedError) and err.value.cause.source == "rank-1"
        for rank in ranks:
            assert rank.ended == [0, 1], rank.name
            assert rank.started == [0, 1], rank.name  # no rank began bucket 2
        assert refit.statistics().in_use == 0
    assert own_segments() == []


@pytest.mark.parametrize("broadcast", [False, True])
async def test_handle_bytes_are_the_encoded_size_of_every_load_request(broadcast: bool) -> None:
    """The sizes are remembered across pushes, so versions cross every integer width."""
    model = make_mlp()
    workers = fakes(model, 3)
    async with RefitCoordinator(
        trainer=model,
        workers=workers,
        budget_bytes=128 * KIB,
        bucket_bytes=64 * KIB,
        broadcast_all_handles=broadcast,
    ) as refit:
        for version in (1, 2, 255, 256, 257, 65535, 65536, 2**31, 2**40):
            for w in workers:
                w.load_bytes.clear()
            step(model, version % 7)
            report = await refit.push(version)
            assert report.buckets >= 2
            assert report.handle_bytes_per_worker == {w.name: sum(w.load_bytes) for w in workers}
            assert all(w.equals(model) for w in workers)
