"""Tensors larger than a bucket go in parts (rows), where every receiver takes them so.

The plan cuts such a tensor into rows that fill buckets; a worker's parameter sink
writes each part into its rows; a receiver that takes a tensor only whole (vLLM's
reload) keeps the typed error, naming the tensor and the worker.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrefit import (
    BudgetTooSmallError,
    ParameterMismatchError,
    ParamSpec,
    RefitCoordinator,
    TransportError,
    cpu_device,
)
from asyncrefit._core._plan import TensorEntry
from asyncrefit._worker._layout import Declared
from asyncrefit.local import spawn_local_workers
from asyncrefit.planning import plan_buckets
from asyncrefit.trainer import ConvertingSource
from asyncrefit.transport import Handle

from .fakes import FakeWorker
from .helpers import assert_hold, own_segments, step
from .models import make_mlp

pytestmark = pytest.mark.timeout(120)

KIB = 1024


def make_wide_embedding() -> torch.nn.Module:
    """An embedding of 512 x 128 float32 (256 KiB) beside small tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(512, 128), torch.nn.Linear(128, 16))


# --- the plan ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=6),
    bucket_bytes=st.integers(8, 600),
    split=st.sets(st.integers(0, 5)),
)
def test_parts_cover_every_row_once_in_buckets_no_larger_than_asked(
    shapes: list[tuple[int, int]], bucket_bytes: int, split: set[int]
) -> None:
    specs = [ParamSpec(name=f"p{i}", shape=s, dtype="float32") for i, s in enumerate(shapes)]
    splittable = {f"p{i}" for i in split}
    plan = plan_buckets(specs, bucket_bytes, alignment=16, splittable=splittable)
    rows: dict[str, list[tuple[int, int]]] = {}
    for bucket in plan.buckets:
        for e in bucket.entries:
            assert e.nbytes == math.prod(e.shape) * 4
            if e.part is not None:
                assert e.name in splittable
                assert bucket.nbytes <= bucket_bytes  # a part never overflows its bucket
                assert e.shape[1:] == plan.specs[e.name].shape[1:]
            rows.setdefault(e.name, []).append(e.part or (0, plan.specs[e.name].shape[0]))
    for spec in specs:
        got = rows[spec.name]
        assert got[0][0] == 0 and got[-1][1] == spec.shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
        whole = spec.nbytes <= bucket_bytes or spec.name not in splittable
        if whole or spec.shape[1] * 4 > bucket_bytes:
            assert len(got) == 1  # fits, may not be split, or one row is too large
    assert plan.specs == {s.name: s for s in specs}


def test_a_part_fills_what_is_left_of_a_bucket() -> None:
    specs = [
        ParamSpec(name="small", shape=(10,), dtype="float32"),  # 40 bytes
        ParamSpec(name="big", shape=(100, 4), dtype="float32"),  # 1600 bytes, rows of 16
        ParamSpec(name="tail", shape=(3,), dtype="float32"),
    ]
    plan = plan_buckets(specs, 512, alignment=64, splittable={"big"})
    entries = [(b.index, e.label, e.offset) for b in plan.buckets for e in b.entries]
    assert entries[:2] == [(0, "small", 0), (0, "big[0:28]", 64)]  # 64 + 28 * 16 = 512
    assert [label for _, label, _ in entries[2:5]] == ["big[28:60]", "big[60:92]", "big[92:100]"]
    assert entries[5][:2] == (3, "tail")  # shares the last part's bucket (big[92:100])
    assert plan.split == frozenset({"big"})


# --- the worker's check of a part --------------------------------------------------------


def handle(*entries: TensorEntry) -> Handle:
    return Handle(
        device=cpu_device(0),
        bucket=3,
        nbytes=max(e.offset + e.nbytes for e in entries),
        entries=entries,
    )


def part(name: str, rows: tuple[int, int], shape: tuple[int, ...]) -> TensorEntry:
    return TensorEntry(
        name=name, offset=0, nbytes=math.prod(shape) * 4, shape=shape, dtype="float32", part=rows
    )


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        (part("w", (0, 2), (2, 4)), "takes it only whole"),
        (part("p", (3, 9), (6, 4)), "is not those rows"),  # past the 8 rows
        (part("p", (2, 4), (2, 5)), "is not those rows"),  # another row shape
        (part("p", (4, 2), (2, 4)), "is not those rows"),  # backwards
    ],
)
def test_a_worker_refuses_a_part_it_cannot_take(entry: TensorEntry, problem: str) -> None:
    declared = Declared(
        specs={
            "w": ParamSpec(name="w", shape=(8, 4), dtype="float32"),
            "p": ParamSpec(name="p", shape=(8, 4), dtype="float32", parts=True),
        }
    )
    declared.check(handle(part("p", (2, 6), (4, 4))))  # rows 2:6 of p: fine
    with pytest.raises(TransportError, match=problem):
        declared.check(handle(entry))


# --- pushes ------------------------------------------------------------------------------


async def test_a_tensor_larger_than_the_budget_goes_in_parts_to_processes() -> None:
    model = make_wide_embedding()
    budget = 64 * KIB  # the embedding is 256 KiB
    async with spawn_local_workers(make_wide_embedding, 2) as workers:
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=budget, verify=True
        ) as refit:
            assert refit.plan is not None and refit.plan.split == {"0.weight"}
            for version in (1, 2, 3):
                step(model, version)
                report = await refit.push(version)
                await assert_hold(workers, model, version)
                assert report.peak_budget_bytes <= budget
                assert report.bytes == sum(p.nbytes for p in model.parameters())
    assert own_segments() == []


async def test_a_worker_that_takes_a_tensor_only_whole_is_named() -> None:
    model = make_mlp()  # 0.weight is 64 KiB
    workers = [
        FakeWorker.like("parts", cpu_device(0), model),
        FakeWorker.like("whole", cpu_device(1), model, whole=True),
    ]
    with pytest.raises(BudgetTooSmallError, match="worker 'whole' takes only whole") as info:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=32 * KIB):
            pass
    assert "0.weight" in info.value.what
    assert all(w.calls == [] for w in workers)


async def test_a_whole_only_worker_cannot_join_a_plan_in_parts() -> None:
    model = make_mlp()
    worker = FakeWorker.like("w0", cpu_device(0), model)
    async with RefitCoordinator(trainer=model, workers=[worker], budget_bytes=32 * KIB) as refit:
        await refit.push(1)
        late = FakeWorker.like("late", cpu_device(1), model, whole=True)
        with pytest.raises(ParameterMismatchError, match="sent in parts") as info:
            await refit.add_worker(late)
        assert info.value.worker == "late"
        step(model, 2)
        await refit.push(2)  # the others go on
        assert worker.equals(model)


async def test_a_source_that_yields_whole_tensors_is_not_split() -> None:
    """A ConvertingSource is asked for whole tensors by name: no parts, the typed error."""
    model = make_mlp()
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype="float32") for n, t in tensors.items()]
    source = ConvertingSource(specs, lambda names: ((n, tensors[n]) for n in names))
    worker = FakeWorker.like("w0", cpu_device(0), model)
    with pytest.raises(BudgetTooSmallError):
        async with RefitCoordinator(trainer=source, workers=[worker], budget_bytes=32 * KIB):
            pass
