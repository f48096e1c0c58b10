"""Opt-in integrity checks: a checksum per bucket, re-computed by every worker."""

from __future__ import annotations

import pytest
import torch

from asyncrefit import (
    PushError,
    RefitCoordinator,
    SharedParameterTrainer,
    WorkerIntegrityError,
    checksum,
    cpu_device,
)
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import spawn_local_workers
from asyncrefit.transport import Handle, SharedMemoryImporter

from .fakes import FakeWorker
from .models import make_mixed, make_mlp

KIB = 1024


class CorruptingImporter(SharedMemoryImporter):
    """Hands out a copy of the buffer with one byte flipped: corruption in transit."""

    def open(self, handle: Handle) -> torch.Tensor:
        damaged = super().open(handle).clone()
        last = handle.entries[-1]
        damaged[last.offset + last.nbytes // 2] ^= 0x10
        return damaged


def test_checksum_is_over_bytes_in_order() -> None:
    a = torch.arange(10, dtype=torch.float32)
    b = torch.tensor([1.5, -0.0], dtype=torch.bfloat16)
    assert checksum([a, b]) == checksum([a.clone(), b.clone()])
    assert checksum([a, b]) != checksum([b, a])
    assert checksum([torch.tensor([0.0])]) != checksum([torch.tensor([-0.0])])
    assert checksum([a, torch.empty(0, 3)]) == checksum([a])
    assert checksum([a.view(2, 5).t()]) == checksum([a.view(2, 5).t().contiguous()])


async def test_verified_push_passes_and_carries_checksums() -> None:
    model = make_mixed()
    workers = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=8 * KIB, verify=True
    ) as refit:
        await refit.push(1)
    assert all(w.equals(model) for w in workers)
    assert all(h.checksum is not None for w in workers for hs in w.handles for h in hs)


async def test_unverified_push_sends_no_checksum() -> None:
    model = make_mlp()
    workers = [FakeWorker.like("w0", cpu_device(0), model)]
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
    assert all(h.checksum is None for hs in workers[0].handles for h in hs)


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_corruption_is_a_typed_error_naming_the_worker(zero_copy: bool) -> None:
    model = make_mlp()
    good = FakeWorker.like("good", cpu_device(0), model)
    bad = FakeWorker.like("bad", cpu_device(1), model)
    bad.importers = {"shm": CorruptingImporter()}
    bad.__post_init__()
    trainer = SharedParameterTrainer(model) if zero_copy else model
    async with RefitCoordinator(
        trainer=trainer, workers=[good, bad], budget_bytes=64 * KIB, verify=True
    ) as refit:
        with pytest.raises(PushError) as info:
            await refit.push(1)
        err = info.value
        assert isinstance(err.cause, WorkerIntegrityError)
        assert err.failed == "bad" and "checksum" in str(err)
        assert await bad.weight_version() is None
        assert refit.statistics().in_use == 0


async def test_corruption_goes_unnoticed_without_verify() -> None:
    """The control: the same damage passes silently when nobody checks."""
    model = make_mlp()
    bad = FakeWorker.like("bad", cpu_device(1), model)
    bad.importers = {"shm": CorruptingImporter()}
    bad.__post_init__()
    async with RefitCoordinator(trainer=model, workers=[bad], budget_bytes=64 * KIB) as refit:
        await refit.push(1)
    assert not bad.equals(model)


async def test_verified_push_into_processes() -> None:
    model = make_mixed()
    async with spawn_local_workers(make_mixed, 2) as workers:
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=8 * KIB, verify=True
        ) as refit:
            await refit.push(1)
            want = {n: tensor_digest(p) for n, p in model.named_parameters()}
            for w in workers:
                assert await w.parameter_digests() == want
