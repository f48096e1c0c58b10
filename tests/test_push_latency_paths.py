"""The short paths of a push's control: what they skip must not change what they see.

A trainer module's parameters are read at every push from the walk of the last push
when nothing changed (``_ModuleWalk``); a push into one directly written worker begins,
writes and commits in one task; a bucket's payload is summed once. Every change of the
module tree is still seen, and a push with one worker still fails, aborts and cancels
as one with several does.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from asyncrefit import (
    LocalTrainer,
    PackError,
    PushError,
    RefitCoordinator,
    WorkerDiedError,
    cpu_device,
)
from asyncrefit._core._plan import ParamSpec, plan_buckets
from asyncrefit.events import PushBegun, PushEvent
from asyncrefit.trainer._local import _reader

from .fakes import DirectFakeWorker, FakeWorker
from .helpers import digests, no_loop_errors, own_segments, step
from .models import make_mlp
from .test_cancellation import cancel_at_every_point

KIB = 1024


@pytest.fixture(autouse=True)
async def loop_errors_fail_the_test() -> AsyncIterator[None]:
    async with no_loop_errors():
        yield


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 3),
        torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2, bias=False)),
        torch.nn.Linear(2, 2),
    )


def _linear(model: torch.nn.Module, path: str) -> torch.nn.Linear:
    found = model.get_submodule(path)
    assert isinstance(found, torch.nn.Linear)
    return found


def _replace_weight(m: torch.nn.Module) -> None:
    _linear(m, "0").weight = torch.nn.Parameter(torch.zeros(3, 4))


def _new_parameter(m: torch.nn.Module) -> None:
    m.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))


def _drop_bias(m: torch.nn.Module) -> None:
    del _linear(m, "2").bias


def _rename(m: torch.nn.Module) -> None:
    params = _linear(m, "0")._parameters
    params["w"] = params.pop("weight")


def _move(m: torch.nn.Module) -> None:
    # The last parameter of one module becomes the first of the next one walked: the
    # same names and objects in the same order, under another module.
    inner = m.get_submodule("1")
    first, second = _linear(m, "1.0"), _linear(m, "1.1")
    bias = first._parameters.pop("bias")
    assert bias is not None
    second._parameters = {"bias": bias, **second._parameters}
    assert inner is m.get_submodule("1")


def _new_child(m: torch.nn.Module) -> None:
    _linear(m, "2").add_module("head", torch.nn.Linear(2, 1))


def _replace_child(m: torch.nn.Module) -> None:
    m.get_submodule("1")._modules["0"] = torch.nn.Linear(3, 3)


def _drop_child(m: torch.nn.Module) -> None:
    del m.get_submodule("1")._modules["1"]


def _rename_child(m: torch.nn.Module) -> None:
    children = m.get_submodule("1")._modules
    children["z"] = children.pop("0")


def _none_child(m: torch.nn.Module) -> None:
    m.get_submodule("1")._modules["1"] = None


def _tie(m: torch.nn.Module) -> None:
    _linear(m, "2").weight = _linear(m, "1.1").weight


@pytest.mark.parametrize(
    "change",
    [
        _replace_weight,
        _new_parameter,
        _drop_bias,
        _rename,
        _move,
        _new_child,
        _replace_child,
        _drop_child,
        _rename_child,
        _none_child,
        _tie,
    ],
)
def test_every_change_of_the_module_tree_is_read(change: Callable[[torch.nn.Module], None]) -> None:
    model = _model()
    read = _reader(model)
    assert list(read().items()) == list(model.named_parameters())
    assert list(read().items()) == list(model.named_parameters())  # from the last walk
    change(model)
    assert list(read().items()) == list(model.named_parameters())
    assert list(read().items()) == list(model.named_parameters())


def test_modules_comparing_equal_are_walked_every_time() -> None:
    class Same(torch.nn.Linear):
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Same)

        __hash__ = torch.nn.Linear.__hash__

    model = torch.nn.Sequential(Same(2, 2), torch.nn.Linear(2, 2))
    read = _reader(model)
    assert list(read().items()) == list(model.named_parameters())
    model._modules["0"] = Same(2, 2)  # equal to the old one, with other parameters
    assert list(read().items()) == list(model.named_parameters())


def test_what_is_read_is_a_copy() -> None:
    model = _model()
    read = _reader(model)
    first = read()
    assert isinstance(first, dict)
    first.clear()
    assert list(read().items()) == list(model.named_parameters())


async def test_describe_sees_a_new_shape_of_the_same_parameter_object() -> None:
    model = _model()
    source = LocalTrainer(model)
    try:
        info = await source.describe()
        assert await source.describe() is info
        weight = _linear(model, "0").weight
        weight.data = torch.zeros(5, 4)
        grown = await source.describe()
        assert grown is not info and grown.specs[0].shape == (5, 4)
        weight.data = weight.data.double()
        assert (await source.describe()).specs[0].dtype == "float64"
    finally:
        await source.aclose()


def test_a_buckets_payload_is_summed_once_and_survives_copies() -> None:
    specs = [
        ParamSpec(name="a", shape=(3, 4), dtype="float32"),
        ParamSpec(name="b", shape=(5,), dtype="float32"),
    ]
    plan = plan_buckets(specs, 1 << 20)
    (bucket,) = plan.buckets
    assert bucket.payload_bytes == 68 == plan.payload_bytes
    assert pickle.loads(pickle.dumps(bucket)).payload_bytes == 68
    assert pickle.loads(pickle.dumps(bucket)) == bucket
    assert dataclasses.replace(bucket, entries=bucket.entries[:1]).payload_bytes == 48
    assert "payload_bytes" not in repr(bucket)


# --- one directly written worker: begin, writes and commit in one task -----------------


def _direct(model: torch.nn.Module) -> DirectFakeWorker:
    return DirectFakeWorker(
        name="w0",
        device=cpu_device(0),
        parameters={n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()},
    )


async def test_one_direct_worker_dead_at_its_begin_fails_the_push_typed() -> None:
    model = make_mlp()
    worker = _direct(model)
    try:
        async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=8 * KIB) as refit:
            await refit.push(1)
            worker.dead = True
            step(model, 2)
            with pytest.raises(PushError) as info:
                await refit.push(2)
            assert isinstance(info.value.__cause__, WorkerDiedError)
            assert info.value.failed == "w0" and info.value.incomplete == ("w0",)
            assert ("begin_direct", 2) not in worker.calls
    finally:
        worker.close()
    assert own_segments() == []


async def test_one_direct_worker_failing_its_commit_is_aborted() -> None:
    model = make_mlp()
    worker = _direct(model)
    try:
        async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=8 * KIB) as refit:
            await refit.push(1)
            worker.faults.fail_at_commit = True
            step(model, 2)
            with pytest.raises(PushError) as info:
                await refit.push(2)
            assert info.value.failed == "w0"
            assert worker.calls[-3:] == [("begin_direct", 2), ("commit", 2), ("abort", 2)]
            assert await worker.weight_version() is None  # written from its begin on
            worker.faults.fail_at_commit = False
            step(model, 3)
            await refit.push(3)
            assert worker.equals(model) and await worker.weight_version() == 3
    finally:
        worker.close()


async def test_cancel_at_every_scheduling_point_one_direct_worker() -> None:
    model = make_mlp()
    worker = _direct(model)
    try:
        workers: list[FakeWorker] = [worker]
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=16 * KIB) as refit:
            # A push into one direct worker has few scheduling points (8 on uvloop,
            # measured): every one of them is cancelled at.
            await cancel_at_every_point(refit, workers, model, lambda: digests(model), least=5)
    finally:
        worker.close()
    assert own_segments() == []


async def test_a_direct_write_failure_names_the_parameter() -> None:
    params = {f"p{i}": torch.randn(1024) for i in range(4)}
    params["p2"] = torch.empty(1024, device="meta")  # a shape and a dtype, no data
    worker = DirectFakeWorker(
        name="w0", device=cpu_device(0), parameters={n: torch.zeros(1024) for n in params}
    )
    try:
        async with RefitCoordinator(
            trainer=LocalTrainer(params, name="policy"),
            workers=[worker],
            budget_bytes=64 * KIB,
            bucket_bytes=4 * KIB,
        ) as refit:
            with pytest.raises(PushError) as info:
                await refit.push(1)
        cause = info.value.cause
        assert isinstance(cause, PackError)
        assert (cause.source, cause.parameter) == ("policy", "p2")
        assert "meta" in str(cause)
    finally:
        worker.close()


async def test_a_parameter_changed_after_the_begin_is_not_written() -> None:
    model = make_mlp()
    worker = _direct(model)
    try:
        async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=8 * KIB) as refit:
            await refit.push(1)
            weight = model.get_parameter("0.weight")

            def grow(event: PushEvent) -> None:
                if isinstance(event, PushBegun):
                    weight.data = torch.zeros(weight.shape[0] + 1, weight.shape[1])

            refit.subscribe(grow)
            with pytest.raises(PushError) as info:
                await refit.push(2)
            cause = info.value.cause
            assert isinstance(cause, PackError) and cause.parameter == "0.weight"
            assert "changed shape or dtype mid-push" in str(cause)
    finally:
        worker.close()
