"""The collective transport over gloo: one trainer process broadcasting to worker processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrefit import (
    DeviceId,
    LocalTrainer,
    PushError,
    RefitCoordinator,
    TransportError,
    WorkerDiedError,
    WorkerRemoteError,
)
from asyncrefit.local import spawn_local_workers
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults
from asyncrefit.trainer import CollectiveTrainer
from asyncrefit.transport._base import make_importer
from asyncrefit.transport.collective import (
    CollectiveHandle,
    CollectiveImporter,
    local_address_towards,
)

from .helpers import assert_hold, digests, own_segments, step
from .models import make_mlp

KIB = 1024
#: Generous: this machine may be loaded, and a timeout that fires early fails a test.
TIMEOUT = 30.0


def far(i: int) -> DeviceId:
    """A device on a node that shares no memory with the trainer (as discovery reports it)."""
    return DeviceId(node="far-node", device=f"cpu:{i}")


def test_collective_importer_is_registered_and_refuses_other_handles() -> None:
    importer = make_importer("collective")
    assert isinstance(importer, CollectiveImporter)
    handle = CollectiveHandle(
        device=far(0),
        bucket=0,
        nbytes=8,
        entries=(),
        host="127.0.0.1",
        port=1,
        session="s",
        generation=1,
        rank=1,
        world_size=2,
    )
    assert handle.kind == "collective"
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert local_address_towards("localhost") == "127.0.0.1"
    importer.close()


async def test_broadcast_is_bitwise_equal_over_repeated_pushes() -> None:
    model = make_mlp()
    trainer = CollectiveTrainer(model, timeout=TIMEOUT)
    async with spawn_local_workers(make_mlp, 3, devices=[far(i) for i in range(3)]) as workers:
        async with RefitCoordinator(
            # 0.weight (64 KiB) goes in parts: two slots of 16 KiB
            trainer=trainer,
            workers=workers,
            budget_bytes=32 * KIB,
            bucket_bytes=16 * KIB,
        ) as refit:
            assert refit.plan is not None and len(refit.plan.buckets) > 2
            assert trainer.address[0] == "127.0.0.1" and trainer.address[1] > 0
            for version in (1, 2, 3):
                step(model, version)
                report = await refit.push(version)
                await assert_hold(workers, model, version)
                assert report.bytes_per_transport == {"collective": 3 * report.bytes}
                assert report.slots == 2  # packing of k+1 overlaps sending k
                assert report.peak_budget_bytes <= 32 * KIB
            assert trainer.generation == 1  # one group, formed once, kept across pushes
    assert own_segments() == []


@pytest.mark.parametrize(
    "fault",
    [
        WorkerFaults(kill_at_bucket=1),  # SIGKILL after receiving, half-way through copying
        WorkerFaults(crash_at_bucket=1),  # exits before joining the bucket's broadcast
    ],
    ids=["killed", "crashed"],
)
async def test_a_worker_dying_mid_broadcast_fails_the_push_and_the_group_reforms(
    fault: WorkerFaults,
) -> None:
    model = make_mlp()
    trainer = CollectiveTrainer(model, timeout=TIMEOUT)
    faults = {"worker-1": fault}
    async with spawn_with_faults(
        make_mlp, 3, devices=[far(i) for i in range(3)], faults=faults
    ) as workers:
        async with RefitCoordinator(
            trainer=trainer,
            workers=workers,
            budget_bytes=128 * KIB,
            bucket_bytes=16 * KIB,
            cleanup_timeout=TIMEOUT,
        ) as refit:
            step(model, 1)
            start = time.perf_counter()
            with pytest.raises(PushError) as info:
                await refit.push(1)
            # Bounded: the survivors' receives fail when the group is torn down, well
            # before their own timeouts.
            assert time.perf_counter() - start < TIMEOUT / 2
            assert isinstance(info.value.cause, WorkerDiedError)
            assert info.value.failed == "worker-1"
            assert set(info.value.incomplete) == {"worker-0", "worker-1", "worker-2"}
            assert not refit.quarantined_slots()

            await refit.remove_worker("worker-1")
            survivors = [workers[0], workers[2]]
            step(model, 2)
            report = await refit.push(2)
            assert trainer.generation == 2  # re-formed without the dead rank
            assert report.bytes_per_transport == {"collective": 2 * report.bytes}
            await assert_hold(survivors, model, 2)
            step(model, 3)
            await refit.push(3)
            await assert_hold(survivors, model, 3)
            assert trainer.generation == 2


async def test_a_receiver_that_never_joins_is_a_typed_error_not_a_hang() -> None:
    model = make_mlp()
    trainer = CollectiveTrainer(model, timeout=3.0)
    faults = {"worker-2": WorkerFaults(hang_at_bucket=0)}
    async with spawn_with_faults(
        make_mlp, 3, devices=[far(i) for i in range(3)], faults=faults
    ) as workers:
        async with RefitCoordinator(
            trainer=trainer,
            workers=workers,
            budget_bytes=128 * KIB,
            bucket_bytes=16 * KIB,
            timeout=TIMEOUT,  # longer than the transport's: the transport reports first
            cleanup_timeout=5.0,  # the receivers that joined confirm their aborts
        ) as refit:
            start = time.perf_counter()
            with pytest.raises(PushError) as info:
                await refit.push(1)
            assert time.perf_counter() - start < TIMEOUT
            cause = info.value.cause
            # The root's formation times out, and so do the receivers that did join:
            # whichever is reported first, the error names the transport.
            assert isinstance(cause, TransportError) or (
                isinstance(cause, WorkerRemoteError) and cause.remote_type == "TransportError"
            ), cause

            await workers[2].kill()
            await refit.remove_worker("worker-2")
            step(model, 2)
            await refit.push(2)
            await assert_hold(workers[:2], model, 2)


async def test_mixed_push_serves_near_workers_by_shm_and_far_ones_by_broadcast() -> None:
    model = make_mlp()
    collective = CollectiveTrainer(model, timeout=TIMEOUT)
    async with (
        spawn_local_workers(make_mlp, 2, names=["near-0", "near-1"]) as near,
        spawn_local_workers(
            make_mlp, 2, names=["far-0", "far-1"], devices=[far(0), far(1)]
        ) as remote,
    ):
        async with RefitCoordinator(
            # Colocated sources first: each worker goes to the first source serving it.
            trainer=[LocalTrainer(model), collective],
            workers=[*near, *remote],
            budget_bytes=128 * KIB,
            bucket_bytes=16 * KIB,
            verify=True,  # every worker re-checks each bucket's CRC, whatever its transport
        ) as refit:
            for version in (1, 2):
                step(model, version)
                report = await refit.push(version)
                assert report.bytes_per_transport == {
                    "shm": 2 * report.bytes,
                    "collective": 2 * report.bytes,
                }
                await assert_hold([*near, *remote], model, version)
            assert collective.generation == 1
    assert own_segments() == []


# --- Ray: actors that report another node join the broadcast through their handles ----


@pytest.fixture(scope="module")
def ray_actors() -> Iterator[list[Any]]:
    """A one-node local Ray cluster with 3 inference actors that pretend to be elsewhere.

    Started before each test's leak check records the child processes (as in
    ``test_ray.py``) and shut down at the end of the module.
    """
    ray = pytest.importorskip("ray")
    from .ray_actors import InferenceActor

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20)
    try:
        cls = ray.remote(InferenceActor)
        actors = [cls.options(num_cpus=0).remote(make_mlp, f"cpu:{i}") for i in range(3)]
        ray.get([a.info.remote() for a in actors], timeout=240)
        yield actors
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_ray_actors_on_another_node_receive_the_broadcast(ray_actors: list[Any]) -> None:
    from asyncrefit.ray import RayWorker

    model = make_mlp()
    # The handles carry the store's address to the actors through Ray; with real nodes,
    # host is the trainer node's IP (ray.util.get_node_ip_address()).
    collective = CollectiveTrainer(model, host="127.0.0.1", timeout=TIMEOUT)
    for actor in ray_actors:
        await actor.configure.remote(node="far-node")
    workers = [RayWorker(a, name=f"ray-{i}") for i, a in enumerate(ray_actors)]
    async with RefitCoordinator(
        trainer=[LocalTrainer(model), collective],
        workers=workers,
        budget_bytes=128 * KIB,
        bucket_bytes=16 * KIB,
    ) as refit:
        assert {d.node for d in refit.devices.values()} == {"far-node"}
        for version in (1, 2):
            step(model, version)
            report = await refit.push(version)
            assert report.bytes_per_transport == {"collective": 3 * report.bytes}
            want = digests(model)
            for w in workers:
                assert await w.parameter_digests() == want, w.name
                assert await w.weight_version() == version, w.name
