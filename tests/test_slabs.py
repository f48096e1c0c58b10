"""The slab layout the zero-copy trainers share, on the CPU.

``SlabLayout``, ``refresh_action`` and ``bind`` are tested as they are. The CUDA
trainer's own code (layout, generations, refresh, handles, close) runs here on slabs
in CPU memory: only the allocation, which shares CUDA memory by IPC, is replaced, and
the three CUDA calls it makes around it (``is_available``, the device's UUID, the
current stream) answer as a GPU would, recording what was asked of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrefit import (
    ClosedError,
    DeviceId,
    PackError,
    ParamSpec,
    SharedParameterTrainer,
    TransportError,
)
from asyncrefit._checksum import checksum
from asyncrefit._core._plan import Bucket, Plan, TensorEntry
from asyncrefit._dtypes import torch_dtype
from asyncrefit.planning import plan_buckets
from asyncrefit.trainer import CudaSharedParameterTrainer, _cuda_shared
from asyncrefit.trainer._local import entry_view
from asyncrefit.trainer._slabs import Refresh, SlabLayout, SlabSpec, bind, refresh_action
from asyncrefit.transport.cuda_ipc import CudaIpcHandle
from asyncrefit.transport.shm import ShmHandle

from .helpers import own_segments

KIB = 1024
GPU = DeviceId(node="node-a", device="GPU-00000000-0000-0000-0000-00000000abcd")


def entry(name: str = "w", nbytes: int = 16) -> TensorEntry:
    return TensorEntry(name=name, offset=0, nbytes=nbytes, shape=(nbytes // 4,), dtype="float32")


# SlabLayout: a pure value of the plan.


def test_layout_has_one_slab_per_bucket_with_the_buckets_entries() -> None:
    specs = [ParamSpec(name=f"p{i}", shape=(256,), dtype="float32") for i in range(5)]
    plan = plan_buckets(specs, 2 * KIB)  # two 1 KiB tensors a bucket
    layout = SlabLayout.of(plan)
    assert layout.fingerprint == plan.fingerprint
    assert [s.index for s in layout.slabs] == [0, 1, 2]
    assert [s.entries for s in layout.slabs] == [b.entries for b in plan.buckets]
    assert [s.nbytes for s in layout.slabs] == [b.nbytes for b in plan.buckets]
    assert layout.nbytes == sum(b.nbytes for b in plan.buckets)
    assert layout == SlabLayout.of(plan_buckets(specs, 2 * KIB))  # depends on the plan only
    with pytest.raises(AttributeError):
        layout.fingerprint = "other"  # type: ignore[misc]


def test_a_bucket_of_empty_tensors_gets_a_slab_of_one_byte() -> None:
    specs = [ParamSpec(name="empty", shape=(0, 4), dtype="float32")]
    plan = plan_buckets(specs, KIB)
    assert plan.buckets[0].nbytes == 0
    assert SlabLayout.of(plan).slabs == (
        SlabSpec(index=0, nbytes=1, entries=plan.buckets[0].entries),
    )


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(min_value=0, max_value=9), max_size=3).map(tuple),
        min_size=1,
        max_size=8,
    ),
    dtypes=st.lists(st.sampled_from(["float32", "bfloat16", "float16", "int64", "uint8"])),
    bucket_bytes=st.integers(min_value=1, max_value=1024),
)
def test_every_parameter_has_a_place_of_its_own_in_its_slab(
    shapes: list[tuple[int, ...]], dtypes: list[str], bucket_bytes: int
) -> None:
    specs = [
        ParamSpec(name=f"p{i}", shape=s, dtype=dtypes[i % len(dtypes)] if dtypes else "float32")
        for i, s in enumerate(shapes)
    ]
    layout = SlabLayout.of(plan_buckets(specs, bucket_bytes))
    placed = [e.name for s in layout.slabs for e in s.entries]
    assert placed == [s.name for s in specs]
    for slab in layout.slabs:
        base = torch.zeros(slab.nbytes, dtype=torch.uint8)
        for i, e in enumerate(slab.entries):
            view = entry_view(base, e).view(e.shape)  # fits, aligned for its dtype
            assert view.dtype == torch_dtype(e.dtype) and view.numel() == math.prod(e.shape)
            view.reshape(-1).view(torch.uint8).fill_(i + 1)  # through the view
        # No two places overlap: each entry's bytes hold its own mark.
        for i, e in enumerate(slab.entries):
            assert bool((base[e.offset : e.offset + e.nbytes] == i + 1).all())


# refresh_action: what a push does with one parameter.


@pytest.mark.parametrize(
    ("nbytes", "pointer", "address", "action"),
    [
        (16, 1000, 1000, Refresh.KEEP),  # lives in its slab
        (0, 1000, 2000, Refresh.KEEP),  # holds no bytes: nothing to copy
        (0, 1000, None, Refresh.KEEP),
        (16, 1000, None, Refresh.COPY),  # keeps its own memory (strided, cast)
        (16, 3000, 1000, Refresh.RELOCATE),  # lived in its slab, replaced since
    ],
)
def test_refresh_action(nbytes: int, pointer: int, address: int | None, action: Refresh) -> None:
    assert refresh_action(entry(nbytes=nbytes), pointer, address) is action


# bind: copy in, and re-point where the parameter can live in its slab.


def test_bind_repoints_a_row_major_parameter_of_the_engines_dtype() -> None:
    base = torch.zeros(64, dtype=torch.uint8)
    view = base[:48].view(torch.float32).view(3, 4)
    param = torch.nn.Parameter(torch.randn(3, 4))
    value = param.detach().clone()
    with torch.no_grad():
        address = bind(view, param)
    assert address == view.data_ptr() == param.data_ptr()
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert torch.equal(view, value) and param.stride() == (4, 1)
    with torch.no_grad():
        param.mul_(2)  # an optimizer step writes the slab
    assert torch.equal(view, 2 * value)
    param.sum().backward()  # type: ignore[no-untyped-call]
    assert param.grad is not None and torch.equal(param.grad, torch.ones(3, 4))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(4, 3).t(), id="transposed"),
        pytest.param(lambda: torch.randn(3, 4, dtype=torch.float64), id="cast"),
    ],
)
def test_bind_copies_a_parameter_that_cannot_live_in_its_slab(make: Any) -> None:
    view = torch.zeros(48, dtype=torch.uint8).view(torch.float32).view(3, 4)
    tensor: torch.Tensor = make()
    pointer, strides = tensor.data_ptr(), tensor.stride()
    with torch.no_grad():
        assert bind(view, tensor) is None
    assert tensor.data_ptr() == pointer and tensor.stride() == strides  # its own memory
    assert torch.equal(view, tensor.to(torch.float32))  # its value, row-major, cast


# The CUDA trainer's logic over slabs in CPU memory.


@dataclass
class Event:
    """An interprocess event: what it was recorded on."""

    recorded: list[Any] = field(default_factory=list)

    def record(self, stream: Any) -> None:
        self.recorded.append(stream)


@dataclass
class Stream:
    index: int
    synchronized: int = 0

    def synchronize(self) -> None:
        self.synchronized += 1


class HostSlabTrainer(CudaSharedParameterTrainer):
    """The CUDA trainer, its slabs allocated in CPU memory (``fail_at``: an OOM there)."""

    def __init__(self, parameters: Mapping[str, torch.Tensor], fail_at: int | None = None) -> None:
        super().__init__(parameters, device=0, node=GPU.node, name="gpu-trainer")
        self.allocated: list[int] = []
        self.fail_at = fail_at

    def _allocate(self, spec: SlabSpec) -> _cuda_shared._Slab:
        if spec.index == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        self.allocated.append(spec.index)
        tensor = torch.empty(spec.nbytes, dtype=torch.uint8)
        return _cuda_shared._Slab(tensor, b"ipc%d" % spec.index, spec.nbytes, 0, Event(), b"ev")


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, Stream]]:
    """A GPU as the CUDA trainer asks about it: there, named ``GPU``, with streams."""
    made: dict[int, Stream] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_cuda_shared, "cuda_device", lambda index, node=None: GPU)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: made.setdefault(i, Stream(i)))
    yield made


def params_of(n: int = 6) -> dict[str, torch.Tensor]:
    return {f"p{i}": torch.randn(256) for i in range(n)}  # 1 KiB each


def in_slab(tensor: torch.Tensor, trainer: HostSlabTrainer) -> bool:
    for slab in trainer._slabs.values():
        lo = slab.tensor.data_ptr()
        if lo <= tensor.data_ptr() < lo + slab.tensor.numel():
            return True
    return False


def slab_value(trainer: Any, bucket: Bucket, name: str) -> torch.Tensor:
    """What the slab of ``bucket`` holds as parameter ``name``."""
    (e,) = (e for e in bucket.entries if e.name == name)
    return entry_view(trainer._slabs[bucket.index].tensor, e).view(e.shape)


async def prepared(trainer: HostSlabTrainer, bucket_bytes: int = 2 * KIB) -> Plan:
    plan = plan_buckets(trainer.specs(), bucket_bytes)
    await trainer.prepare(plan, 1, plan.max_bucket_bytes, checksum=True)
    return plan


async def test_cuda_trainer_lays_out_once_and_exports_its_slabs(
    streams: dict[int, Stream],
) -> None:
    params = params_of()
    values = {n: t.clone() for n, t in params.items()}
    trainer = HostSlabTrainer(params)
    plan = await prepared(trainer)
    assert trainer.allocated == [0, 1, 2] and trainer._generation == 1
    assert all(in_slab(t, trainer) for t in params.values())
    assert all(torch.equal(params[n], v) for n, v in values.items())  # values unchanged
    await prepared(trainer)  # the same parameter set: nothing is laid out again
    assert trainer.allocated == [0, 1, 2] and trainer._generation == 1

    bucket = plan.buckets[1]
    (handle,) = await trainer.export(bucket, 0, [GPU])
    assert isinstance(handle, CudaIpcHandle)
    slab = trainer._slabs[1]
    assert (handle.device, handle.bucket, handle.slot, handle.generation) == (GPU, 1, 1, 1)
    assert handle.ordered and handle.ipc_handle == b"ipc1" and handle.entries == bucket.entries
    assert handle.checksum == checksum(
        slab.tensor[e.offset : e.offset + e.nbytes] for e in bucket.entries
    )
    assert slab.event.recorded == [streams[0]]  # on the trainer's stream, after the refresh

    await trainer.aclose()
    assert streams[0].synchronized == 1 and trainer._slabs == {}
    await prepared(trainer)  # prepared again after a close: new slabs, a new generation
    assert trainer.allocated == [0, 1, 2] * 2 and trainer._generation == 2
    await trainer.aclose()


async def test_cuda_trainer_serves_only_its_own_gpu(streams: dict[int, Stream]) -> None:
    trainer = HostSlabTrainer(params_of())
    with pytest.raises(ClosedError, match="has no slabs"):
        await trainer.export(plan_buckets(trainer.specs(), 2 * KIB).buckets[0], 0, [GPU])
    plan = await prepared(trainer)
    other = DeviceId(node=GPU.node, device="GPU-ffffffff-0000-0000-0000-000000000000")
    with pytest.raises(TransportError, match="cannot serve device"):
        await trainer.export(plan.buckets[0], 0, [GPU, other])
    assert trainer._slabs[0].event.recorded == []  # refused before refreshing anything
    await trainer.aclose()
    with pytest.raises(ClosedError):
        await trainer.export(plan.buckets[0], 0, [GPU])


async def test_cuda_trainer_refresh_copies_back_replaced_and_copies_strided_parameters(
    streams: dict[int, Stream],
) -> None:
    params = params_of(2)
    params["t"] = torch.randn(16, 16).t()  # 1 KiB, not row-major
    trainer = HostSlabTrainer(params)
    (bucket,) = (await prepared(trainer, 4 * KIB)).buckets
    assert in_slab(params["p0"], trainer) and not in_slab(params["t"], trainer)
    with torch.no_grad():
        params["p0"].add_(1)  # in place: already in the slab
        params["t"].add_(1)  # in its own memory: copied at the export
        replaced = torch.full((256,), 7.0)
        params["p1"].data = replaced  # the training loop replaced it
    assert not in_slab(params["p1"], trainer)
    await trainer.export(bucket, 0, [GPU])
    assert trainer.relocated == 1
    assert in_slab(params["p1"], trainer) and torch.equal(params["p1"], replaced)
    for name, t in params.items():
        assert torch.equal(slab_value(trainer, bucket, name), t), name
    await trainer.export(bucket, 0, [GPU])
    assert trainer.relocated == 1  # back in place: not counted again
    await trainer.aclose()


async def test_a_failed_cuda_layout_names_the_gpu_and_keeps_the_generation(
    streams: dict[int, Stream],
) -> None:
    params = params_of()
    values = {n: t.clone() for n, t in params.items()}
    pointers = {n: t.data_ptr() for n, t in params.items()}
    trainer = HostSlabTrainer(params, fail_at=2)
    with pytest.raises(TransportError, match=r"'gpu-trainer' in slabs on cuda:0.*simulated"):
        await prepared(trainer)
    assert trainer.allocated == [0, 1] and trainer._generation == 0 and trainer._slabs == {}
    # It failed before placing anything: every parameter keeps its memory and value.
    assert {n: t.data_ptr() for n, t in params.items()} == pointers
    assert all(torch.equal(params[n], v) for n, v in values.items())
    trainer.fail_at = None
    await prepared(trainer)  # the next layout succeeds: the first generation
    assert trainer._generation == 1 and all(in_slab(t, trainer) for t in params.values())
    await trainer.aclose()


async def test_a_cuda_layout_names_a_parameter_on_another_device(
    streams: dict[int, Stream],
) -> None:
    params = params_of(4)
    params["p3"] = torch.empty(256, device="meta")
    values = {n: t.clone() for n, t in params.items() if n != "p3"}
    pointers = {n: params[n].data_ptr() for n in values}
    trainer = HostSlabTrainer(params)
    with pytest.raises(PackError) as info:  # a PackError, not a TransportError
        await prepared(trainer)
    assert (info.value.source, info.value.bucket, info.value.parameter) == ("gpu-trainer", 1, "p3")
    assert "is on meta, not cpu" in str(info.value)
    assert trainer._generation == 0 and trainer._slabs == {}
    # The parameters placed before it moved into the new slabs, their values unchanged.
    assert all(params[n].data_ptr() != pointers[n] for n in values)
    assert all(torch.equal(params[n], v) for n, v in values.items())


# The shared-memory trainer's own part: segments, named afresh at every layout.


async def test_shared_trainer_lays_out_anew_only_for_a_new_parameter_set() -> None:
    params = params_of(4)
    trainer = SharedParameterTrainer(params)
    plan = plan_buckets(trainer.specs(), 2 * KIB)
    await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    first = set(own_segments())
    assert len(first) == 2
    await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    assert set(own_segments()) == first  # the same parameter set: the same segments
    params["p4"] = torch.randn(256)
    plan = plan_buckets(trainer.specs(), 2 * KIB)
    await trainer.prepare(plan, 1, plan.max_bucket_bytes)
    now = set(own_segments())
    assert len(now) == 3 and not now & first  # the old ones unlinked, new names
    (handle,) = await trainer.export(plan.buckets[2], 0, [DeviceId(node="n", device="cpu:0")])
    assert isinstance(handle, ShmHandle) and handle.segment in now
    await trainer.aclose()
    assert own_segments() == []


async def test_shared_trainer_lays_out_anew_when_only_the_buckets_change() -> None:
    """The same parameters cut into other buckets need slabs of the new sizes."""
    params = params_of(4)  # four 1 KiB tensors
    trainer = SharedParameterTrainer(params)
    small = plan_buckets(trainer.specs(), 1 * KIB)
    await trainer.prepare(small, 1, small.max_bucket_bytes)
    assert len(own_segments()) == 4
    large = plan_buckets(trainer.specs(), 4 * KIB)
    assert large.fingerprint == small.fingerprint and len(large.buckets) == 1
    await trainer.prepare(large, 1, large.max_bucket_bytes)
    (segment,) = own_segments()
    (handle,) = await trainer.export(large.buckets[0], 0, [DeviceId(node="n", device="cpu:0")])
    assert isinstance(handle, ShmHandle) and handle.segment == segment
    assert os.stat(f"/dev/shm/{segment}").st_size >= large.buckets[0].nbytes
    for entry in large.buckets[0].entries:
        assert torch.equal(slab_value(trainer, large.buckets[0], entry.name), params[entry.name])
    await trainer.aclose()
    assert own_segments() == []
