"""Trainer sources: staging slots (LocalTrainer) and zero-copy shared parameters."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import anyio
import pytest
import torch

from asyncrefit import (
    BudgetTooSmallError,
    ClosedError,
    DeviceId,
    LocalTrainer,
    PackError,
    PushError,
    RefitCoordinator,
    SharedParameterTrainer,
    cpu_device,
)
from asyncrefit._core._plan import Bucket
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import spawn_local_workers
from asyncrefit.planning import Plan, plan_buckets
from asyncrefit.transport import Handle, SharedMemoryExporter

from .fakes import FakeWorker
from .helpers import own_segments
from .models import make_mixed, make_mlp

KIB = 1024


def shm_backed(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in one of this process's shared-memory segments."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/asyncrefit-" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= t.data_ptr() < hi:
                    return True
    return False


def adam_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = torch.stack([(p.float() ** 2).sum() for p in model.parameters()]).sum()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad()


async def test_shared_parameters_push_without_packing_and_train_in_place() -> None:
    model = make_mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SharedParameterTrainer(model)
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=64 * KIB) as refit:
        # the layout moved every parameter into shared memory, values unchanged
        for name, p in model.named_parameters():
            assert shm_backed(p), name
            assert torch.equal(p, before[name])
        for version in (1, 2, 3):
            adam_step(model, opt)  # updates the shared memory in place
            assert all(shm_backed(p) for p in model.parameters())
            await refit.push(version)
            assert all(w.equals(model) for w in workers)
        assert trainer.relocated == 0
    assert own_segments() == []
    # the parameters outlive the segment names and stay trainable
    adam_step(model, opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())


async def test_a_zero_copy_push_has_every_bucket_in_flight_whatever_the_budget() -> None:
    """Slabs stage nothing: the budget bounds no memory, so it neither refuses a bucket
    larger than itself nor holds buckets back; a staging source beside it still does
    (for workers that take parameters whole only)."""
    model = make_mlp()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model, whole=True) for i in range(2)]
    trainer = SharedParameterTrainer(model)
    async with RefitCoordinator(
        trainer=trainer, workers=workers, budget_bytes=1 * KIB, bucket_bytes=4 * KIB
    ) as refit:
        report = await refit.push(1)
        assert report.buckets > 2 and report.slots == report.buckets
        assert all(w.equals(model) for w in workers)
    assert own_segments() == []
    with pytest.raises(BudgetTooSmallError):
        async with RefitCoordinator(
            trainer=LocalTrainer(model), workers=workers, budget_bytes=1 * KIB, bucket_bytes=4 * KIB
        ):
            pass


async def test_replaced_parameter_is_copied_back_into_place() -> None:
    model = make_mlp()
    assert isinstance(model, torch.nn.Sequential)
    trainer = SharedParameterTrainer(model)
    workers = [FakeWorker.like("w0", cpu_device(0), model)]
    async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        model[0].bias = torch.nn.Parameter(torch.full((256,), 3.0))  # new storage
        await refit.push(2)
        assert trainer.relocated == 1
        assert shm_backed(model[0].bias)
        assert workers[0].equals(model)


async def test_shared_parameters_into_worker_processes() -> None:
    model = make_mixed()
    trainer = SharedParameterTrainer(model)
    async with spawn_local_workers(make_mixed, 2) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=8 * KIB
        ) as refit:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            await refit.push(1)
            want = {n: tensor_digest(p) for n, p in model.named_parameters()}
            for w in workers:
                assert await w.parameter_digests() == want


async def test_local_trainer_refuses_to_export_before_prepare() -> None:
    model = make_mlp()
    trainer = LocalTrainer(model)
    plan = plan_buckets(trainer.specs(), 64 * KIB)
    with pytest.raises(ClosedError):
        await trainer.export(plan.buckets[0], 0, [cpu_device(0)])
    await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    handles = await trainer.export(plan.buckets[0], 0, [cpu_device(0)])
    assert [h.device for h in handles] == [cpu_device(0)]
    await trainer.aclose()
    with pytest.raises(ClosedError):
        await trainer.export(plan.buckets[0], 0, [cpu_device(0)])
    assert own_segments() == []


async def test_a_source_hands_out_the_same_handle_object_while_it_is_unchanged() -> None:
    """Workers recognise a handle they met by identity: a source hands the same object
    out for a slot while the handle's value is unchanged (the weights may change), and
    a new one as soon as anything it says changes (a checksum, the slots)."""
    model = make_mlp()
    devices = [cpu_device(0), cpu_device(1)]
    for checksum in (False, True):
        trainer = LocalTrainer(model)
        plan = plan_buckets(trainer.specs(), 64 * KIB)
        await trainer.prepare(plan, 2, plan.max_bucket_bytes, checksum=checksum)
        try:
            bucket = plan.buckets[0]
            first = await trainer.export(bucket, 0, devices)
            assert [h.device for h in first] == devices
            with torch.no_grad():
                next(model.parameters()).add_(1.0)  # a training step
            again = await trainer.export(bucket, 0, devices)
            assert again == first or checksum  # equal unless the checksum changed
            if checksum:
                pairs = zip(again, first, strict=True)
                assert all(a is not b and a.checksum != b.checksum for a, b in pairs)
            else:
                assert all(a is b for a, b in zip(again, first, strict=True))
            other = await trainer.export(bucket, 1, devices)  # another slot: its own
            assert all(o is not a and o != a for o, a in zip(other, again, strict=True))
            await trainer.prepare(plan, 2, 2 * plan.max_bucket_bytes, checksum=checksum)
            fresh = await trainer.export(bucket, 0, devices)  # new slots: new handles
            assert all(f is not a and f != a for f, a in zip(fresh, again, strict=True))
        finally:
            await trainer.aclose()
    assert own_segments() == []


async def test_shared_trainer_rejects_a_changed_parameter() -> None:
    # a parameter set change between plan and export is a typed error, not garbage
    model = make_mlp()
    assert isinstance(model, torch.nn.Sequential)
    trainer = SharedParameterTrainer(model)
    plan = plan_buckets(trainer.specs(), 64 * KIB)
    await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    try:
        model[2].bias = torch.nn.Parameter(torch.zeros(65))
        bucket = next(b for b in plan.buckets if any(e.name == "2.bias" for e in b.entries))
        with pytest.raises(PackError, match=r"2\.bias") as info:
            await trainer.export(bucket, 0, [cpu_device(0)])
        assert (info.value.source, info.value.bucket) == ("trainer", bucket.index)
        assert "changed shape or dtype" in str(info.value)
    finally:
        await trainer.aclose()


def with_meta(name: str) -> dict[str, torch.Tensor]:
    """Parameters of which ``name`` has a shape and a dtype but no data (a meta tensor)."""
    params = {f"p{i}": torch.randn(1024) for i in range(4)}  # 4 KiB each
    params[name] = torch.empty(1024, device="meta")
    return params


async def test_a_pack_failure_names_the_source_bucket_and_parameter() -> None:
    params = with_meta("p2")
    trainer = LocalTrainer(params, name="policy")
    plan = plan_buckets(trainer.specs(), 4 * KIB)
    await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    try:
        await trainer.export(plan.buckets[1], 0, [cpu_device(0)])  # fine
        with pytest.raises(PackError) as info:
            await trainer.export(plan.buckets[2], 0, [cpu_device(0)])
    finally:
        await trainer.aclose()
    err = info.value
    assert (err.source, err.bucket, err.parameter) == ("policy", 2, "p2")
    assert "trainer source 'policy', bucket 2, parameter 'p2'" in str(err)
    assert "meta" in str(err)  # what went wrong, from the cause
    assert err.__cause__ is not None


async def test_a_pack_failure_fails_the_push_naming_the_parameter() -> None:
    params = with_meta("p3")
    workers = [FakeWorker(name="w0", device=cpu_device(0), parameters=_zeros_like(params))]
    async with RefitCoordinator(
        trainer=LocalTrainer(params), workers=workers, budget_bytes=64 * KIB, bucket_bytes=4 * KIB
    ) as refit:
        with pytest.raises(PushError) as info:
            await refit.push(1)
    assert isinstance(info.value.cause, PackError)
    assert "bucket 3, parameter 'p3'" in str(info.value)


async def test_shared_trainer_names_a_parameter_it_cannot_place_and_leaks_nothing() -> None:
    params = with_meta("p1")
    trainer = SharedParameterTrainer(params, name="shared")
    plan = plan_buckets(trainer.specs(), 4 * KIB)
    with pytest.raises(PackError) as info:
        await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    assert (info.value.source, info.value.bucket, info.value.parameter) == ("shared", 1, "p1")
    assert "not the CPU" in str(info.value)
    assert own_segments() == []  # the segments made for the layout were unlinked
    await trainer.aclose()


async def test_every_shared_segment_is_mapped_once_across_pushes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One segment per bucket, and more buckets than any small cache of mappings: the
    # worker maps each segment at the first push and never again.
    from asyncrefit.transport import shm

    opened: list[str] = []
    real_open = shm._Segment.open

    def counting_open(name: str) -> shm._Segment:
        opened.append(name)
        return real_open(name)

    monkeypatch.setattr(shm._Segment, "open", staticmethod(counting_open))
    params = {f"p{i}": torch.randn(1024) for i in range(24)}  # 4 KiB each
    trainer = SharedParameterTrainer(params)
    workers = [FakeWorker(name="w0", device=cpu_device(0), parameters=_zeros_like(params))]
    async with RefitCoordinator(
        trainer=trainer, workers=workers, budget_bytes=64 * KIB, bucket_bytes=4 * KIB
    ) as refit:
        assert refit.plan is not None and len(refit.plan.buckets) == 24
        await refit.push(1)
        assert len(opened) == 24 and len(set(opened)) == 24
        with torch.no_grad():
            for t in params.values():
                t.add_(1)
        await refit.push(2)
        assert len(opened) == 24, "a segment was mapped again at the second push"
        for name, t in params.items():
            assert torch.equal(workers[0].parameters[name], t), name


def _zeros_like(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in params.items()}


async def test_shared_trainer_keeps_every_parameters_strides() -> None:
    params = {
        "normal": torch.randn(8, 16),
        "transposed": torch.randn(16, 8).t(),  # shape (8, 16), strides (1, 8)
        "channels_last": torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last),
        "bias": torch.randn(16),
    }
    strides = {n: t.stride() for n, t in params.items()}
    assert not params["transposed"].is_contiguous()
    trainer = SharedParameterTrainer(params)
    workers = [FakeWorker(name="w0", device=cpu_device(0), parameters=_zeros_like(params))]
    async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=64 * KIB) as refit:
        assert {n: t.stride() for n, t in params.items()} == strides
        # contiguous parameters live in the shared segments; the others keep their memory
        assert shm_backed(params["normal"]) and shm_backed(params["bias"])
        assert not shm_backed(params["transposed"])
        assert not shm_backed(params["channels_last"])
        for version in (1, 2):
            with torch.no_grad():
                for t in params.values():
                    t.mul_(2).add_(version)  # an optimizer step, in place
            await refit.push(version)
            for name, t in params.items():
                assert torch.equal(workers[0].parameters[name], t), (version, name)
            assert {n: t.stride() for n, t in params.items()} == strides
        assert trainer.relocated == 0


class SlowExporter:
    """Shared memory whose close blocks like a GPU exporter's (synchronize, ipc_collect)."""

    kind = "shm"

    def __init__(self, close_seconds: float = 0.3, seal_seconds: float = 0.0) -> None:
        self.inner = SharedMemoryExporter()
        self.close_seconds = close_seconds
        self.seal_seconds = seal_seconds
        self.events: list[str] = []
        self.close_thread: int | None = None
        self.sealing = threading.Event()
        self.closed = threading.Event()

    def allocate(self, slots: int, slot_bytes: int) -> None:
        self.inner.allocate(slots, slot_bytes)

    def buffer(self, slot: int) -> torch.Tensor:
        return self.inner.buffer(slot)

    def seal(self, slot: int) -> None:
        self.sealing.set()
        time.sleep(self.seal_seconds)
        self.events.append("sealed")

    def handle(self, slot: int, bucket: Bucket, device: DeviceId) -> Handle:
        return self.inner.handle(slot, bucket, device)

    def close(self) -> None:
        self.events.append("close")
        self.close_thread = threading.get_ident()
        time.sleep(self.close_seconds)
        self.inner.close()
        self.closed.set()


async def prepared(exporter: SlowExporter) -> tuple[LocalTrainer, Plan]:
    trainer = LocalTrainer({"w": torch.randn(256)}, exporter=exporter)
    plan = plan_buckets(trainer.specs(), 64 * KIB)
    await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    return trainer, plan


async def test_local_trainer_closes_its_exporter_off_the_event_loop() -> None:
    exporter = SlowExporter(close_seconds=0.3)
    trainer, _ = await prepared(exporter)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await trainer.aclose()
        tg.cancel_scope.cancel()
    assert exporter.closed.is_set()
    assert exporter.close_thread != threading.get_ident()
    assert ticks >= 10, "the event loop was blocked while the exporter closed"


@pytest.mark.parametrize("when", ["before", "during"])
async def test_a_cancelled_close_still_frees_the_buffers(when: str) -> None:
    exporter = SlowExporter(close_seconds=0.3)
    trainer, _ = await prepared(exporter)
    with anyio.CancelScope() as scope:
        if when == "before":
            scope.cancel()  # already cancelled when aclose starts
        else:
            scope.deadline = anyio.current_time() + 0.05  # in the middle of the close
        await trainer.aclose()
    assert scope.cancelled_caught
    # The close goes on in its thread, to the end.
    assert await anyio.to_thread.run_sync(exporter.closed.wait, 5.0)
    assert exporter.events == ["close"]


async def test_close_waits_for_a_pack_still_running() -> None:
    exporter = SlowExporter(close_seconds=0.0, seal_seconds=0.3)
    trainer, plan = await prepared(exporter)
    outcome: list[object] = []

    async def export() -> None:
        try:
            outcome.append(await trainer.export(plan.buckets[0], 0, [cpu_device(0)]))
        except ClosedError as exc:  # the close came first: no handle of a freed slot
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(export)
        await anyio.to_thread.run_sync(exporter.sealing.wait, 5.0)
        await trainer.aclose()
    assert exporter.events == ["sealed", "close"]
    assert len(outcome) == 1
    with pytest.raises(ClosedError):
        await trainer.export(plan.buckets[0], 0, [cpu_device(0)])


async def test_a_failing_close_is_raised_by_aclose() -> None:
    exporter = SlowExporter(close_seconds=0.0)
    trainer, _ = await prepared(exporter)

    def broken_close() -> None:
        exporter.inner.close()
        raise RuntimeError("the device went away")

    exporter.close = broken_close  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the device went away"):
        await trainer.aclose()


async def test_describe_answers_the_same_info_until_a_spec_changes() -> None:
    model = make_mlp()
    source = LocalTrainer(model)
    try:
        first = await source.describe()
        assert await source.describe() is first  # nothing changed: no specs rebuilt
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # values are not specs
        assert await source.describe() is first
        name, param = next(iter(model.named_parameters()))
        owner = model.get_submodule(name.rpartition(".")[0])
        setattr(
            owner,
            name.rpartition(".")[2],
            torch.nn.Parameter(torch.zeros(param.shape[0] + 1, *param.shape[1:])),
        )
        grown = await source.describe()
        assert grown is not first and grown != first
        assert grown.specs[0].shape[0] == param.shape[0] + 1
        assert await source.describe() is grown
        owner.register_parameter(
            name.rpartition(".")[2], torch.nn.Parameter(param.to(torch.float64))
        )
        assert (await source.describe()).specs[0].dtype == "float64"
    finally:
        await source.aclose()


def test_the_engine_tensors_are_kept_only_while_the_trainer_tensors_are_unchanged() -> None:
    from asyncrefit.trainer._local import _Reading

    model = make_mlp()

    def trainer() -> dict[str, torch.Tensor]:
        return dict(model.named_parameters())

    reading = _Reading(trainer, trainer)
    first = reading.read()
    assert reading.read() is first and reading.made == 1
    weight = model.get_parameter("0.weight")
    weight.data = weight.data.clone()  # new memory, same shape: the object reads it
    assert reading.read() is first and first["0.weight"] is weight
    weight.data = torch.zeros(weight.shape[0] + 1, weight.shape[1])  # a new shape
    grown = reading.read()
    assert grown is not first and reading.made == 2
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))  # a new name
    assert "extra" in reading.read() and reading.made == 3
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))  # a new object
    reading.read()
    assert reading.made == 4 and reading.read()["extra"] is model.get_parameter("extra")
    # A view of a trainer tensor is never kept: it would go on viewing old memory.
    views = _Reading(trainer, lambda: {"w": model.get_parameter("0.weight")[:2]})
    views.read()
    views.read()
    assert views.made == 2


def test_the_trainer_reads_the_parameters_named_parameters_gives() -> None:
    """The trainer's own walk of a module (faster than ``named_parameters()``, which a
    push reads every time) gives the same names, order and objects: tied parameters
    and shared modules once, at their first name; ``None`` parameters left out; a
    module whose class names its parameters itself is asked."""
    from asyncrefit.trainer._local import _reader

    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3, bias=False), shared, torch.nn.ReLU(), shared, torch.nn.Linear(3, 4)
    )
    last = model[4]
    assert isinstance(last, torch.nn.Linear)
    head = torch.nn.Linear(3, 4, bias=False)
    head.weight = last.weight  # tied
    model.add_module("head", head)
    assert list(_reader(model)().items()) == list(model.named_parameters())

    class Renamed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def named_parameters(
            self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
        ) -> Iterator[tuple[str, torch.nn.Parameter]]:
            for name, p in super().named_parameters():
                yield name.removeprefix("inner."), p

    assert list(_reader(Renamed())()) == ["weight", "bias"]
