"""The CUDA IPC transport: real refits from a trainer to worker processes on one GPU.

The tests marked ``gpu`` need a CUDA GPU and are skipped without one; run them on a GPU
machine with ``python -m pytest -m gpu tests/test_cuda_ipc.py``. The others check what
needs no GPU: which local index has a UUID, and that a handle for a GPU this process
does not see is refused before anything is written.
"""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
import torch

from asyncrefit import (
    DeviceId,
    LocalTrainer,
    ParameterReceiver,
    ParamSpec,
    PushError,
    RefitCoordinator,
    TransportError,
    WorkerDiedError,
    local_node_id,
)
from asyncrefit._cuda import cuda_device, cuda_index, index_of_uuid, normalize_uuid
from asyncrefit.local import spawn_local_workers
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults
from asyncrefit.planning import plan_buckets
from asyncrefit.transport import make_importer
from asyncrefit.transport.cuda_ipc import CudaIpcExporter, CudaIpcHandle, CudaIpcImporter

from .gpu_models import MEDIUM_BYTES, make_gpu_medium, make_gpu_mixed, make_gpu_mlp
from .helpers import assert_hold, step

MIB = 2**20
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (run with -m gpu on a GPU machine)"
)
UUID = "3f1b6c2a-0d4e-4f7a-9b1c-2e3d4c5b6a79"  # the form torch reports
OTHER = "GPU-00000000-0000-0000-0000-000000000000"


# --- no GPU needed ----------------------------------------------------------------------


def test_uuid_forms_of_torch_and_nvml_name_the_same_gpu() -> None:
    assert normalize_uuid(UUID) == normalize_uuid("GPU-" + UUID.upper()) == "GPU-" + UUID
    assert normalize_uuid("MIG-ABC") == "MIG-abc"


def test_local_index_is_found_by_uuid_not_by_position() -> None:
    # the producer saw this GPU as its index 0; here it is index 2
    visible = ["GPU-aaaa", "GPU-bbbb", UUID]
    assert index_of_uuid("GPU-" + UUID, visible) == 2
    with pytest.raises(TransportError, match=r"not visible.*0: GPU-aaaa"):
        index_of_uuid(OTHER, visible)
    with pytest.raises(TransportError, match=r"visible: none"):
        index_of_uuid(OTHER, [])


def test_importing_the_transport_does_not_initialize_cuda() -> None:
    code = (
        "import torch, asyncrefit, asyncrefit.transport.cuda_ipc\n"
        "from asyncrefit.transport import make_importer\n"
        "make_importer('cuda_ipc')\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_handle_for_an_unseen_gpu_is_refused_before_any_write() -> None:
    param = torch.zeros(16)
    plan = plan_buckets([ParamSpec(name="w", shape=(16,), dtype="float32")], 1 << 20)
    bucket = plan.buckets[0]
    device = DeviceId(node=local_node_id(), device=OTHER)
    handle = CudaIpcHandle(
        device=device,
        bucket=0,
        nbytes=bucket.nbytes,
        entries=bucket.entries,
        owner="1-abcd",
        slot=0,
        generation=1,
        ipc_handle=bytes(64),
        storage_bytes=512,
        storage_offset=0,
        event_handle=bytes(64),
    )
    assert isinstance(make_importer("cuda_ipc"), CudaIpcImporter)
    receiver = ParameterReceiver({"w": param}, device)
    receiver.begin(1)
    with pytest.raises(TransportError, match="not visible"):
        receiver.load(1, 0, (handle,))
    assert receiver.state.dirty is False  # nothing was written
    receiver.close()


@pytest.mark.skipif(HAS_CUDA, reason="checks the error without CUDA")
def test_exporter_without_cuda_raises_a_transport_error() -> None:
    with pytest.raises(TransportError, match="needs CUDA"):
        CudaIpcExporter()


# --- on the GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_device_id_is_the_gpu_uuid() -> None:
    dev = cuda_device(0)
    assert dev.node == local_node_id()
    assert dev.device == normalize_uuid(str(torch.cuda.get_device_properties(0).uuid))
    assert dev.device.startswith(("GPU-", "MIG-"))
    assert cuda_index(dev.device) == 0


@pytest.mark.gpu
@needs_gpu
def test_exporter_refuses_other_gpus_and_frees_its_slots() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    exporter = CudaIpcExporter(0)
    bucket = plan_buckets([ParamSpec(name="w", shape=(MIB,), dtype="uint8")], 4 * MIB).buckets[0]
    try:
        exporter.allocate(2, 4 * MIB)
        assert torch.cuda.memory_reserved() >= reserved + 8 * MIB
        exporter.buffer(1)[:MIB].fill_(7)
        exporter.seal(1)
        handle = exporter.handle(1, bucket, exporter.device_id)
        assert handle.kind == "cuda_ipc" and handle.slot == 1 and handle.storage_bytes >= 4 * MIB
        with pytest.raises(TransportError, match="cannot serve device"):
            exporter.handle(1, bucket, DeviceId(node=local_node_id(), device=OTHER))
        exporter.allocate(2, 4 * MIB)  # same size: kept
        assert exporter.handle(1, bucket, exporter.device_id) == handle
    finally:
        exporter.close()
        exporter.close()  # idempotent
    assert torch.cuda.memory_reserved() == reserved


@pytest.mark.gpu
@needs_gpu
async def test_refit_into_two_gpu_workers_is_bitwise_equal_over_pushes() -> None:
    model = make_gpu_mixed()
    exporter = CudaIpcExporter(0)
    dev = exporter.device_id
    async with spawn_local_workers(make_gpu_mixed, 2, devices=[dev, dev]) as workers:
        trainer = LocalTrainer(model, exporter=exporter, devices=[dev])
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=256 * 1024
        ) as refit:
            assert set(refit.devices.values()) == {dev}
            sizes = []
            for version in (1, 2, 3, 4):
                step(model, version)
                report = await refit.push(version)
                await assert_hold(workers, model, version)
                assert report.buckets > 2 and report.slots == 2
                a, b = report.handle_bytes_per_worker.values()
                assert a == b  # each worker is sent its own device's handle, once
                sizes.append(a)
            assert len(set(sizes)) == 1  # the same slots, the same handles, every push
    assert exporter.slot_bytes == 0  # the coordinator closed the exporter


@pytest.mark.gpu
@needs_gpu
async def test_workers_ack_before_their_copies_ran_and_the_repack_waits_on_the_gpu() -> None:
    """Ordered handles: each worker's copies run late on its GPU (its stream spins
    before them), it acks once they are enqueued, and the trainer packs the next bucket
    into the slot at once: only the trainer's stream waiting for the workers' "copied"
    events keeps the repack from overwriting a bucket not yet copied."""
    model = make_gpu_mixed()
    exporter = CudaIpcExporter(0, device_ordering=True)
    dev = exporter.device_id
    late = WorkerFaults(gpu_delay_cycles=20_000_000)  # ~10 ms of spinning per bucket
    async with spawn_with_faults(
        make_gpu_mixed, 2, devices=[dev, dev], faults={"worker-0": late, "worker-1": late}
    ) as workers:
        trainer = LocalTrainer(model, exporter=exporter, devices=[dev])
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=256 * 1024
        ) as refit:
            for version in (1, 2, 3):
                step(model, version)
                report = await refit.push(version)
                assert report.buckets > 2 and report.slots == 2
                await assert_hold(workers, model, version)
        assert exporter.ordered  # the coordinator passed the tokens: handles were ordered


@pytest.mark.gpu
@needs_gpu
async def test_forward_pass_in_the_worker_matches_the_trainer() -> None:
    model = make_gpu_mlp()
    exporter = CudaIpcExporter(0, host_sync=True)  # seal also waits on the host
    dev = exporter.device_id
    async with spawn_local_workers(make_gpu_mlp, 1, devices=[dev]) as workers:
        trainer = LocalTrainer(model, exporter=exporter, devices=[dev])
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=4 * MIB
        ) as refit:
            step(model, 1)
            await refit.push(1)
            x = torch.randn(8, 256)
            with torch.no_grad():
                want = model(x)
            # the parameters are compared bit for bit elsewhere; a GEMM in another
            # process may pick another algorithm, so compare outputs closely
            torch.testing.assert_close(await workers[0].forward(x), want)


@pytest.mark.gpu
@needs_gpu
async def test_worker_killed_mid_push_then_gpu_memory_returns_to_baseline() -> None:
    bucket = 16 * MIB
    model = make_gpu_medium()
    step(model, 0)  # load the kernels the test uses before taking the baseline
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()
    free_before = torch.cuda.mem_get_info()[0]

    exporter = CudaIpcExporter(0)
    dev = exporter.device_id
    faults = {"worker-1": WorkerFaults(crash_at_bucket=3)}
    async with spawn_with_faults(make_gpu_medium, 2, devices=[dev, dev], faults=faults) as workers:
        trainer = LocalTrainer(model, exporter=exporter, devices=[dev])
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=2 * bucket, bucket_bytes=bucket
        ) as refit:
            assert refit.plan is not None and len(refit.plan.buckets) == MEDIUM_BYTES // bucket
            step(model, 1)
            with anyio.fail_after(60), pytest.raises(PushError) as info:
                await refit.push(1)
            err = info.value
            assert isinstance(err.cause, WorkerDiedError)
            assert err.failed == "worker-1" and "worker-1" in str(err)
            assert not workers[1].alive
            assert await workers[0].weight_version() is None  # aborted, not a mix
            assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
            await refit.remove_worker("worker-1")
            step(model, 2)
            await refit.push(2)
            await assert_hold([workers[0]], model, 2)
            # The last reader dies too, holding both slots mapped: it never releases
            # them, and the trainer must still get its memory back.
            await workers[0].kill()
        assert exporter.slot_bytes == 0
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() <= reserved_before

    # every worker is gone: the whole GPU is back where it was (the driver frees a
    # dead process's memory asynchronously, so allow it a moment)
    tolerance = bucket // 2  # less than one slot
    free_after = torch.cuda.mem_get_info()[0]
    for _ in range(75):  # at most 15 s
        if free_after >= free_before - tolerance:
            break
        await anyio.sleep(0.2)
        free_after = torch.cuda.mem_get_info()[0]
    assert free_after >= free_before - tolerance, (free_before - free_after) / MIB


@pytest.mark.gpu
@needs_gpu
async def test_zero_copy_slabs_refit_bitwise_while_the_trainer_trains_in_place() -> None:
    from asyncrefit.trainer import CudaSharedParameterTrainer

    model = make_gpu_mixed()
    trainer = CudaSharedParameterTrainer(model, device=0)
    dev = trainer.device_id
    async with spawn_local_workers(make_gpu_mixed, 2, devices=[dev, dev]) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=256 * 1024
        ) as refit:
            for version in (1, 2, 3):
                step(model, version)  # in place: the slabs change under the parameters
                report = await refit.push(version)
                assert report.buckets > 2
                await assert_hold(workers, model, version)
            assert trainer.relocated == 0
            e = dict(model.named_parameters())["e"]
            e.data = e.data.clone() + 1  # replaced: copied back into its slab at the push
            await refit.push(4)
            await assert_hold(workers, model, 4)
            assert trainer.relocated == 1
