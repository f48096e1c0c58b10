"""The collective transport's NCCL buffers live on the trainer's and the worker's own GPU.

Transport threads are fresh threads, whose current CUDA device is ``cuda:0`` whatever
the training loop selected; every NCCL buffer (the trainer's slots, the group's probe,
a worker's receive buffer) is placed on an explicit device instead. The tests without
a GPU record where the transport allocates and which device its threads select; the
``gpu`` tests run the same paths on real GPUs (``python -m pytest -m gpu
tests/test_collective_devices.py``; the two-GPU one needs two).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from asyncrefit import DeviceId, TransportError
from asyncrefit._cuda import cuda_device
from asyncrefit.planning import plan_buckets
from asyncrefit.trainer import CollectiveTrainer
from asyncrefit.transport import collective
from asyncrefit.transport.collective import CollectiveHandle, CollectiveImporter

CUDA1 = torch.device("cuda", 1)
UUID1 = "GPU-11111111-2222-3333-4444-555555555555"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(
    GPUS < 1, reason="needs a CUDA GPU (run with -m gpu on a GPU machine)"
)
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs (run with -m gpu)")


@dataclass
class Recorded:
    allocated: list[torch.device] = field(default_factory=list)
    entered: list[torch.device] = field(default_factory=list)
    synchronized: list[torch.device] = field(default_factory=list)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    """Where the transport allocates, which device its threads enter, what it syncs."""
    rec = Recorded()

    def empty(size: int, device: torch.device) -> torch.Tensor:
        rec.allocated.append(device)
        return torch.zeros(size, dtype=torch.uint8)  # stands in for the CUDA buffer

    @contextmanager
    def on_device(device: torch.device) -> Iterator[None]:
        rec.entered.append(device)
        yield

    monkeypatch.setattr(collective, "_empty", empty)
    monkeypatch.setattr(collective, "_on_device", on_device)
    monkeypatch.setattr(collective, "_synchronize", rec.synchronized.append)
    return rec


def nccl_handle(device: DeviceId, nbytes: int = 64) -> CollectiveHandle:
    return CollectiveHandle(
        device=device,
        bucket=3,
        nbytes=nbytes,
        entries=(),
        host="127.0.0.1",
        port=1,
        session="s",
        generation=1,
        rank=1,
        world_size=2,
        backend="nccl",
    )


# --- no GPU needed ------------------------------------------------------------------------


async def test_nccl_slots_are_allocated_on_the_trainers_device(recorded: Recorded) -> None:
    trainer = CollectiveTrainer({"w": torch.zeros(4)}, backend="nccl", device="cuda:1")
    assert trainer.device == CUDA1
    root = trainer._root
    try:
        # A fresh thread, as prepare's: its current device would be cuda:0.
        await anyio.to_thread.run_sync(root.allocate, 2, 1000)
        root.seal(1)
    finally:
        root.close()
    assert recorded.allocated == [CUDA1, CUDA1]
    assert recorded.entered and set(recorded.entered) == {CUDA1}
    assert recorded.synchronized == [CUDA1]


def test_gloo_slots_stay_on_the_cpu() -> None:
    trainer = CollectiveTrainer({"w": torch.zeros(4)})
    assert trainer.device == torch.device("cpu")
    with pytest.raises(ValueError, match="gloo"):
        CollectiveTrainer({"w": torch.zeros(4)}, device="cuda:0")


def test_nccl_needs_a_cuda_device() -> None:
    with pytest.raises(TransportError, match="CUDA device"):
        CollectiveTrainer({"w": torch.zeros(4)}, backend="nccl", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(TransportError, match="needs CUDA"):
            CollectiveTrainer({"w": torch.zeros(4)}, backend="nccl")


def test_the_nccl_probe_is_on_the_groups_device(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[torch.Tensor] = []

    class FakeNCCL:
        class Options:
            _timeout: Any = None

        def __init__(self, store: object, rank: int, size: int, options: object) -> None:
            pass

    fake = SimpleNamespace(PrefixStore=lambda prefix, store: store, ProcessGroupNCCL=FakeNCCL)
    monkeypatch.setattr(collective, "_dist", lambda: fake)
    monkeypatch.setattr(collective, "_broadcast", lambda group, t, backend: sent.append(t))
    collective._new_group("nccl", object(), "s/gen1", 1, 2, "127.0.0.1", 5.0, CUDA1)
    assert recorded.allocated == [CUDA1]
    assert len(sent) == 1


async def test_nccl_receive_buffer_is_on_the_handles_gpu(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker sees the GPU of the handle's UUID as its cuda:1.
    monkeypatch.setattr(collective, "cuda_index", {UUID1: 1}.__getitem__)
    handle = nccl_handle(DeviceId(node="n", device=UUID1))
    importer = CollectiveImporter()
    monkeypatch.setattr(importer, "_join", lambda h: object())

    def broadcast(group: object, tensor: torch.Tensor, backend: str) -> None:
        collective._write_trailer(tensor, handle.nbytes, handle.bucket, handle.generation)

    monkeypatch.setattr(collective, "_broadcast", broadcast)

    def receive() -> None:  # a fresh thread, as the receiver's load
        buffer = importer.open(handle)
        assert buffer.numel() == handle.nbytes
        importer.finish(handle)

    try:
        await anyio.to_thread.run_sync(receive)
    finally:
        importer.close()
    assert recorded.allocated == [CUDA1]
    assert recorded.entered and set(recorded.entered) == {CUDA1}
    assert recorded.synchronized == [CUDA1]


# --- GPUs ---------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
async def test_nccl_root_runs_on_its_own_gpu_from_fresh_threads() -> None:
    # The last GPU: on a machine with several, not the cuda:0 of a fresh thread.
    device = torch.device("cuda", GPUS - 1)
    params = {"w": torch.randn(1000, device=device)}
    trainer = CollectiveTrainer(params, backend="nccl", device=device, timeout=60.0)
    root = trainer._root
    plan = plan_buckets(trainer.specs(), 1 << 20)
    others = [i for i in range(GPUS) if i != device.index]
    before = {i: torch.cuda.memory_allocated(i) for i in others}
    try:
        await anyio.to_thread.run_sync(root.allocate, 2, plan.max_bucket_bytes)
        assert {root.buffer(i).device for i in range(2)} == {device}
        root.form([])  # no receivers: a group of the root alone, probe included
        await anyio.to_thread.run_sync(root.send, 0, plan.buckets[0])
        assert {i: torch.cuda.memory_allocated(i) for i in others} == before
    finally:
        await anyio.to_thread.run_sync(root.close)


@pytest.mark.gpu
@needs_two_gpus
async def test_nccl_broadcast_from_cuda1_to_cuda0_in_fresh_threads() -> None:
    # Both ranks in this process, each in a fresh thread (whose current device is
    # cuda:0): were both on cuda:0, NCCL would refuse the group (duplicate GPU).
    src = torch.device("cuda", 1)
    params = {"w": torch.randn(1000, device=src)}
    trainer = CollectiveTrainer(params, backend="nccl", device=src, timeout=60.0)
    root = trainer._root
    bucket = plan_buckets(trainer.specs(), 1 << 20).buckets[0]
    receiver = cuda_device(0)
    importer = CollectiveImporter()
    received: list[torch.Tensor] = []

    def receive() -> None:
        buffer = importer.open(root.handle(0, bucket, receiver))
        received.append(buffer[: bucket.nbytes].clone())
        importer.finish(root.handle(0, bucket, receiver))

    try:
        await anyio.to_thread.run_sync(root.allocate, 1, bucket.nbytes)
        root.buffer(0)[: bucket.nbytes].view(torch.float32).copy_(params["w"])
        root.seal(0)
        root.form([receiver])
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, root.send, 0, bucket)
            tg.start_soon(anyio.to_thread.run_sync, receive)
    finally:
        importer.close()
        await anyio.to_thread.run_sync(root.close)
    (got,) = received
    assert got.device == torch.device("cuda", 0)
    assert torch.equal(got.view(torch.float32).cpu(), params["w"].cpu())
