"""ConvertingSource: engine-named tensors made by a conversion function, bucket by bucket.

The trainer holds a toy Megatron layout (TP=2 shards, fused QKV and gate_up, see
``convert_models``); the workers hold a Llama under Hugging Face names.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence

import anyio
import pytest
import torch
from anyio.lowlevel import checkpoint

from asyncrefit import (
    PackError,
    ParameterMismatchError,
    ParamSpec,
    PushError,
    RefitCoordinator,
    cpu_device,
)
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import spawn_local_workers
from asyncrefit.planning import plan_buckets
from asyncrefit.trainer import ConvertingSource

from .convert_models import (
    convert,
    export_hf_weights,
    hf_shapes,
    hf_specs,
    hf_tensors,
    make_engine_model,
    to_megatron,
)
from .fakes import FakeWorker
from .helpers import no_loop_errors, own_segments

pytestmark = pytest.mark.timeout(60)

KIB = 1024
BUDGET = 16 * KIB  # two 8 KiB slots: ~12 buckets; layers straddle buckets

Pairs = Iterator[tuple[str, torch.Tensor]]


def fakes(n: int = 2, dtype: torch.dtype = torch.float32) -> list[FakeWorker]:
    return [
        FakeWorker(
            name=f"w{i}",
            device=cpu_device(i),
            parameters={name: torch.zeros(shape, dtype=dtype) for name, shape in hf_shapes()},
        )
        for i in range(n)
    ]


def holds(worker: FakeWorker, want: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of the worker's parameters with ``want``."""
    return all(
        torch.equal(worker.parameters[n].view(torch.uint8), t.view(torch.uint8))
        for n, t in want.items()
    )


def per_bucket(shards: list[dict[str, torch.Tensor]]) -> Callable[[Sequence[str]], Pairs]:
    return lambda names: convert(shards, names)


@pytest.mark.parametrize("mode", ["per-bucket", "stream"])
async def test_a_fused_tp_layout_arrives_bitwise_in_worker_processes(mode: str) -> None:
    shards = to_megatron(hf_tensors(seed=1))
    if mode == "stream":
        source = ConvertingSource.from_stream(hf_specs(), lambda: export_hf_weights(shards))
    else:
        source = ConvertingSource(hf_specs(), per_bucket(shards))
    async with spawn_local_workers(make_engine_model, 2) as workers:
        async with RefitCoordinator(
            trainer=source, workers=workers, budget_bytes=BUDGET, verify=True
        ) as refit:
            for version, seed in ((1, 1), (2, 2)):
                full = hf_tensors(seed)
                shards[:] = to_megatron(full)  # a training step, in Megatron's layout
                report = await refit.push(version)
                assert report.buckets >= 8
                want = {n: tensor_digest(t) for n, t in full.items()}
                for w in workers:
                    assert await w.parameter_digests() == want, (version, w.name)
                    assert await w.weight_version() == version


async def test_fp32_master_weights_are_cast_into_a_bf16_engine() -> None:
    full = hf_tensors(seed=3)
    shards = to_megatron(full)
    workers = fakes(dtype=torch.bfloat16)
    source = ConvertingSource(hf_specs("bfloat16"), per_bucket(shards))
    async with RefitCoordinator(
        trainer=source, workers=workers, budget_bytes=BUDGET, verify=True
    ) as refit:
        await refit.push(1)
    want = {n: t.to(torch.bfloat16) for n, t in full.items()}
    assert all(holds(w, want) for w in workers)


async def test_the_function_is_asked_bucket_by_bucket_in_plan_order() -> None:
    full = hf_tensors(seed=4)
    asked: list[tuple[str, ...]] = []
    alive: list[str] = []  # a tensor still referenced when the next one was made

    def tensors(names: Sequence[str]) -> Pairs:
        asked.append(tuple(names))
        previous: weakref.ref[torch.Tensor] | None = None
        for name in reversed(names):  # any order will do
            if previous is not None and previous() is not None:
                alive.append(name)
            tensor = full[name].clone()  # materialised here, one at a time
            previous = weakref.ref(tensor)
            yield name, tensor
            del tensor

    workers = fakes()
    source = ConvertingSource(hf_specs(), tensors)
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
        assert refit.plan is not None
        buckets = [tuple(e.name for e in b.entries) for b in refit.plan.buckets]
        assert len(buckets) >= 8
        for version in (1, 2):
            asked.clear()
            await refit.push(version)
            assert asked == buckets  # each call is one whole bucket, in plan order
            assert all(holds(w, full) for w in workers)
    assert alive == []


async def test_a_stream_is_read_once_per_push_holding_one_tensor_at_a_time() -> None:
    full = hf_tensors(seed=5)
    calls = 0
    ended: list[bool] = []
    alive: list[str] = []

    def weights() -> Pairs:
        nonlocal calls
        calls += 1
        previous: weakref.ref[torch.Tensor] | None = None
        try:
            for name in full:
                if previous is not None and previous() is not None:
                    alive.append(name)
                tensor = full[name].clone()
                previous = weakref.ref(tensor)
                yield name, tensor
                del tensor
            yield "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)  # skipped
            ended.append(True)
        finally:
            ended.append(False)

    workers = fakes()
    source = ConvertingSource.from_stream(hf_specs(), weights, skip=lambda n: "rotary" in n)
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
        for version in (1, 2):
            await refit.push(version)
            assert all(holds(w, full) for w in workers)
            assert calls == version
            assert ended == [True, False] * version  # read to its end, then closed
    assert alive == []


async def test_stream_exports_that_come_early_wait_for_the_buckets_before_them() -> None:
    full = hf_tensors(seed=6)
    order: list[str] = []

    def weights() -> Pairs:
        for name, tensor in full.items():
            order.append(name)
            yield name, tensor

    source = ConvertingSource.from_stream(hf_specs(), weights)
    plan = plan_buckets(source.specs(), 8 * KIB)
    assert len(plan.buckets) >= 3
    await source.prepare(plan, 3, plan.max_bucket_bytes)
    try:
        done: list[int] = []

        async def export(i: int) -> None:
            await source.export(plan.buckets[i], i, [cpu_device(0)])
            done.append(i)

        async with anyio.create_task_group() as tg:
            for i in (2, 1, 0):  # the wrong order
                tg.start_soon(export, i)
                await checkpoint()
        assert done == [0, 1, 2]
        packed = [e.name for b in plan.buckets[:3] for e in b.entries]
        assert order[: len(packed)] == packed
    finally:
        await source.aclose()


async def test_the_specs_are_read_at_every_push_and_a_changed_set_is_refused() -> None:
    full = hf_tensors(seed=7)
    specs = hf_specs()
    reads = 0

    def current() -> list[ParamSpec]:
        nonlocal reads
        reads += 1
        return specs

    workers = fakes()
    source = ConvertingSource(current, lambda names: ((n, full[n]) for n in names))
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
        await refit.push(1)
        assert reads == 2  # entry, push
        specs = [*specs, ParamSpec(name="model.extra.weight", shape=(4,), dtype="float32")]
        loads = len(workers[0].handles)
        with pytest.raises(ParameterMismatchError, match=r"model\.extra\.weight"):
            await refit.push(2)
        assert len(workers[0].handles) == loads  # nothing was sent
        assert [await w.weight_version() for w in workers] == [1, 1]


async def test_specs_that_are_not_param_specs_are_refused_at_entry() -> None:
    specs = [*hf_specs(), "lm_head.bias"]
    source = ConvertingSource(specs, convert)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"specs item {len(specs) - 1} is a str"):
        async with RefitCoordinator(trainer=source, workers=fakes(1), budget_bytes=BUDGET):
            pytest.fail("entered")


# --- errors --------------------------------------------------------------------------------

FAULTY = "model.layers.1.self_attn.k_proj.weight"  # in the middle of the plan
FIRST = "model.embed_tokens.weight"  # in bucket 0: no byte moved when it fails


def faulty(full: dict[str, torch.Tensor], fault: str, at: str) -> Callable[[Sequence[str]], Pairs]:
    """A per-bucket conversion that goes wrong (``fault``) at parameter ``at``."""

    def tensors(names: Sequence[str]) -> Pairs:
        for name in names:
            if name != at:
                yield name, full[name]
            elif fault == "stranger":
                yield "model.layers.0.mlp.extra.weight", full[name]
            elif fault == "other-bucket":
                yield "lm_head.weight", full["lm_head.weight"]
            elif fault == "twice":
                yield name, full[name]
                yield name, full[name]
            elif fault == "missing":
                pass
            elif fault == "shape":
                yield name, full[name][:-1]
            elif fault == "integer":
                yield name, full[name].to(torch.int32)
            elif fault == "not-a-pair":
                yield name  # type: ignore[misc]
            elif fault == "raises":
                raise RuntimeError("the all-gather timed out")

    return tensors


FAULTS = {
    # fault: (parameter the error names, what it says)
    "stranger": ("model.layers.0.mlp.extra.weight", "is not among the specs"),
    "other-bucket": ("lm_head.weight", "is not a parameter of this bucket (it is in bucket"),
    "twice": (None, "was yielded twice"),
    "missing": (None, "was never yielded"),
    "shape": (None, "has shape [{rows_less}, 32], the engine's is [{rows}, 32]"),
    "integer": (None, "int32 cannot be cast to float32 (only floating-point dtypes are cast)"),
    "not-a-pair": (None, "yielded a str, not a (name, tensor) pair"),
    "raises": (None, "the conversion raised RuntimeError: the all-gather timed out"),
}


@pytest.mark.parametrize("at", [FIRST, FAULTY])
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_faulty_conversion_fails_the_push_with_a_pack_error(fault: str, at: str) -> None:
    good, full = hf_tensors(seed=8), hf_tensors(seed=9)
    source_of = {"fn": per_bucket(to_megatron(good))}
    workers = fakes()
    source = ConvertingSource(hf_specs(), lambda names: source_of["fn"](names), name="megatron")
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
        assert refit.plan is not None
        bucket = next(b.index for b in refit.plan.buckets if any(e.name == at for e in b.entries))
        await refit.push(1)
        sent = [len(w.handles) for w in workers]

        source_of["fn"] = faulty(full, fault, at)
        with pytest.raises(PushError) as info:
            await refit.push(2)
        err = info.value.cause
        assert isinstance(err, PackError), err
        parameter, detail = FAULTS[fault]
        # ("raises": the first parameter of the bucket not packed yet, here ``at``)
        expected = parameter if parameter is not None else at
        assert (err.source, err.bucket, err.parameter) == ("megatron", bucket, expected)
        rows = dict(hf_shapes())[at][0]
        assert detail.format(rows=rows, rows_less=rows - 1) in str(err), str(err)
        if fault == "raises":
            assert isinstance(err.__cause__, RuntimeError)
        for w, before in zip(workers, sent, strict=True):
            # the failed bucket (and any after it) reached no worker
            assert all(h.bucket < bucket for hs in w.handles[before:] for h in hs)
            held = await w.weight_version()
            if bucket == 0:  # no byte moved: the complete version stands
                assert held == 1
            if held == 1:
                assert holds(w, good)
            else:  # honest: part of version 2 was written
                assert held is None

        source_of["fn"] = per_bucket(to_megatron(full))
        await refit.push(3)
        assert all(holds(w, full) for w in workers)
        assert [await w.weight_version() for w in workers] == [3, 3]


async def test_a_stream_names_what_it_cannot_place() -> None:
    full = hf_tensors(seed=10)
    names = list(full)

    def stream(order: Sequence[str], extra: Sequence[str] = ()) -> Callable[[], Pairs]:
        def weights() -> Pairs:
            for name in order:
                yield name, full[name]
            for name in extra:
                yield name, torch.zeros(3)

        return weights

    late = [*names[1:6], names[0], *names[6:]]  # the first one comes late
    cases = [
        (stream(names, ["rotary.inv_freq"]), "rotary.inv_freq", "pass skip="),
        (stream([*names, names[3]]), names[3], "was yielded twice in this push"),
        (stream(names[:-1]), names[-1], "was never yielded"),
        (stream(late), names[1], "ahead of its bucket 1"),
    ]
    workers = fakes()
    for weights, parameter, detail in cases:
        source = ConvertingSource.from_stream(hf_specs(), weights, name="bridge")
        async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
            with pytest.raises(PushError) as info:
                await refit.push(1)
            err = info.value.cause
            assert isinstance(err, PackError)
            assert (err.source, err.parameter) == ("bridge", parameter)
            assert detail in str(err), str(err)

    # What arrives early is held, within lookahead_bytes, until its bucket comes.
    source = ConvertingSource.from_stream(hf_specs(), stream(late), lookahead_bytes=32 * KIB)
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
        await refit.push(1)
    assert all(holds(w, full) for w in workers)


# --- cancellation --------------------------------------------------------------------------


async def test_a_push_cancelled_inside_the_conversion_leaves_nothing_behind() -> None:
    full = hf_tensors(seed=11)
    entered, release = threading.Event(), threading.Event()
    closed: list[str] = []

    def weights() -> Pairs:
        try:
            for i, (name, tensor) in enumerate(full.items()):
                if i == 10 and not release.is_set():
                    entered.set()
                    release.wait(10)  # a collective that takes its time
                yield name, tensor
        finally:
            closed.append("closed")

    workers = fakes()
    source = ConvertingSource.from_stream(hf_specs(), weights)
    async with no_loop_errors():
        async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
            segments = set(own_segments())
            tasks = len(asyncio.all_tasks())
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(refit.push, 1)
                    assert await anyio.to_thread.run_sync(entered.wait, 10)
                    scope.cancel()
                    release.set()  # the thread finishes its bucket; the push is gone
            assert scope.cancelled_caught
            stats = refit.statistics()
            assert (stats.in_use, stats.waiters) == (0, 0)
            assert not refit.quarantined_slots()
            assert set(own_segments()) == segments
            assert len(asyncio.all_tasks()) == tasks
            assert closed == ["closed"]  # the generator was closed, not left suspended
            assert [await w.weight_version() for w in workers] == [None, None]

            await refit.push(2)
            assert all(holds(w, full) for w in workers)
    assert own_segments() == []


# The push ends after some 400-1700 scheduling points (as fast as the packing thread
# runs against the loop), and each point costs a cancelled and a whole push: 10-60 s
# here, past the module's 60 s on a loaded machine.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["per-bucket", "stream"])
async def test_cancel_at_every_scheduling_point(mode: str) -> None:
    full = hf_tensors(seed=12)
    shards = to_megatron(full)
    if mode == "stream":
        source = ConvertingSource.from_stream(hf_specs(), lambda: export_hf_weights(shards))
    else:
        source = ConvertingSource(hf_specs(), per_bucket(shards))
    workers = fakes()
    async with no_loop_errors():
        async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=BUDGET) as refit:
            await refit.push(1)
            segments = set(own_segments())
            tasks = len(asyncio.all_tasks())
            version, k = 1, 0
            while True:
                version += 1
                finished = False
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:

                        async def push(v: int = version) -> None:
                            nonlocal finished
                            await refit.push(v)
                            finished = True

                        tg.start_soon(push)
                        for _ in range(k):
                            await checkpoint()
                        scope.cancel()
                stats = refit.statistics()
                assert (stats.in_use, stats.waiters) == (0, 0), k
                assert not refit.quarantined_slots()
                assert set(own_segments()) == segments
                assert len(asyncio.all_tasks()) == tasks
                if finished:
                    break
                version += 1
                await refit.push(version)
                assert all(holds(w, full) for w in workers)
                k += 1
            assert k >= 10


async def test_a_conversion_that_gathers_is_driven_through_every_bucket_without_workers() -> None:
    """``gathers=True`` (a rank whose conversion all-gathers): every bucket is asked for,
    in plan order, from a source that serves no worker too."""
    from asyncrefit import ParamSpec

    specs = [ParamSpec(name=f"p{i}", shape=(64,), dtype="float32") for i in range(8)]
    asked: dict[str, list[list[str]]] = {"served": [], "idle": []}

    def feed(which: str) -> Callable[[Sequence[str]], Iterator[tuple[str, torch.Tensor]]]:
        def tensors(names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
            asked[which].append(list(names))
            for n in names:
                yield n, torch.full((64,), float(int(n[1:])))

        return tensors

    served = ConvertingSource(specs, feed("served"), devices=["cpu:0"], gathers=True)
    idle = ConvertingSource(specs, feed("idle"), devices=["cpu:1"], gathers=True)
    assert (await idle.describe()).gathers
    worker = FakeWorker(
        name="w", device=cpu_device(0), parameters={s.name: torch.zeros(64) for s in specs}
    )
    async with RefitCoordinator(
        trainer=[served, idle], workers=[worker], budget_bytes=1024, bucket_bytes=512
    ) as refit:
        await refit.push(1)
        assert refit.plan is not None and len(refit.plan.buckets) == 4
    assert asked["idle"] == asked["served"] == [[f"p{2 * b}", f"p{2 * b + 1}"] for b in range(4)]
    assert all(
        torch.equal(worker.parameters[f"p{i}"], torch.full((64,), float(i))) for i in range(8)
    )
