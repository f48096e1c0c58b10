"""Refits into real Ray actors on a real local Ray cluster.

One cluster serves the module: ``ray.init(num_cpus=2)`` plus a second, zero-CPU node
(a second raylet on this machine, so node ids really differ). A pool of 3 trainer
actors and 34 zero-CPU inference actors is started once and reconfigured by each
test; tests that kill actors start their own victims. Cluster tests are ``slow``: the
first one waits ~1 minute for the pool on a 2-core machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import torch

ray = pytest.importorskip("ray")

from asyncrefit import (  # noqa: E402
    AsyncRefitError,
    DeviceId,
    LocalTrainer,
    ParameterMismatchError,
    PushError,
    RefitCoordinator,
    UnknownDeviceError,
    WorkerDiedError,
    cpu_device,
)
from asyncrefit._exceptions import one_error, primary_error  # noqa: E402
from asyncrefit.abc import RestoringWorker  # noqa: E402
from asyncrefit.planning import plan_buckets  # noqa: E402
from asyncrefit.ray import (  # noqa: E402
    AwaitableReturnedError,
    RayTrainerSource,
    RayWorker,
    RefitTrainerMixin,
    RefitWorkerMixin,
    SourceDiedError,
    as_source,
    as_workers,
)
from asyncrefit.transport.shm import list_segments  # noqa: E402

from .models import make_mlp  # noqa: E402
from .ray_actors import InferenceActor, TrainerActor  # noqa: E402

KIB = 1024
POOL = 32
Remote = Any  # a Ray actor handle (Ray has no type stubs)

# Generous but bounded: the first test that takes the pool waits for 36 actors to start.
pytestmark = pytest.mark.timeout(300)


def segments_of(pids: set[int]) -> list[str]:
    """asyncrefit segments under /dev/shm created by any of ``pids``."""
    return [s for s in list_segments() if int(s.split("-")[1]) in pids]


@dataclass
class Pool:
    node: str  # the head node, where the driver and most actors run
    other_node: str  # a second node of the same cluster (a second raylet on this machine)
    trainers: list[Remote]  # 2 trainer actors on the head node
    trainer_pids: set[int]
    actors: list[Remote]  # 32 inference actors on the head node
    other_trainer: Remote  # a trainer actor on the other node
    other_actors: list[Remote]  # 2 inference actors on the other node


def on_node(node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def add_node() -> Any:
    """Start a second, zero-CPU node (raylet and object store) in the driver's cluster."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams
    from ray._private.services import wait_for_node

    head = ray._private.worker.global_worker.node
    params = RayParams(
        num_cpus=0,
        num_gpus=0,
        object_store_memory=80 * 2**20,
        min_worker_port=0,
        max_worker_port=0,
        gcs_address=head.gcs_address,
        include_log_monitor=False,  # type: ignore[arg-type]  # one per machine is enough
        node_manager_port=0,
    )
    params.dashboard_agent_listen_port = None
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    wait_for_node(node.gcs_address, node.plasma_store_socket_name, 60)
    return node


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    """A local Ray cluster of two nodes, with trainer and inference actors, for the module.

    ``ray.init(num_cpus=2)`` starts the head node; a second node joins it. Everything
    starts before each test's leak check records the child processes, so the
    cluster's own processes are not counted as leaks; it is shut down at the end,
    after checking that no trainer left a shared-memory segment behind.
    """
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20)
    other = None
    try:
        other = add_node()
        head = ray.get_runtime_context().get_node_id()
        trainer_cls, actor_cls = ray.remote(TrainerActor), ray.remote(InferenceActor)
        here = {"num_cpus": 0, "scheduling_strategy": on_node(head)}
        there = {"num_cpus": 0, "scheduling_strategy": on_node(other.node_id)}
        trainers = [trainer_cls.options(**here).remote(make_mlp) for _ in "ab"]
        other_trainer = trainer_cls.options(**there).remote(make_mlp)
        actors = [actor_cls.options(**here).remote(make_mlp, "cpu:0") for _ in range(POOL)]
        other_actors = [actor_cls.options(**there).remote(make_mlp, "cpu:0") for _ in "ab"]
        pids = ray.get([t.pid.remote() for t in [*trainers, other_trainer]], timeout=240)
        ray.get([a.info.remote() for a in [*actors, *other_actors]], timeout=240)
        pool = Pool(
            node=head,
            other_node=other.node_id,
            trainers=trainers,
            trainer_pids=set(pids),
            actors=actors,
            other_trainer=other_trainer,
            other_actors=other_actors,
        )
        yield pool
        assert segments_of(pool.trainer_pids) == []
    finally:
        if other is not None:
            other.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        ray.shutdown()


async def configure(actors: list[Remote], devices: list[str], **kw: Any) -> list[RayWorker]:
    """Put actor ``i`` on ``devices[i]``; wrap them as workers named ``w<i>``."""
    async with anyio.create_task_group() as tg:
        for actor, device in zip(actors, devices, strict=True):
            tg.start_soon(_await, actor.configure.remote(device=device, **kw))
    return [RayWorker(a, name=f"w{i}") for i, a in enumerate(actors)]


async def _await(ref: Any) -> Any:
    return await ref


async def info(actors: list[Remote]) -> list[dict[str, Any]]:
    return [await a.info.remote() for a in actors]


async def end_gracefully(actors: list[Remote]) -> None:
    """End ``actors`` gracefully: each unlinks its segment; none is left after 30 s."""
    pids = {d["pid"] for d in await info(actors)}
    for actor in actors:
        actor.__ray_terminate__.remote()
    deadline = time.monotonic() + 30
    while segments_of(pids) and time.monotonic() < deadline:  # noqa: ASYNC110 - /dev/shm
        await anyio.sleep(0.1)
    assert segments_of(pids) == []


async def assert_hold(workers: list[RayWorker], trainer: Remote, version: int) -> None:
    want = await trainer.digests.remote()
    for w in workers:
        assert await w.parameter_digests() == want, w.name
        assert await w.weight_version() == version, w.name


# --- without a cluster ------------------------------------------------------------------


def test_importing_asyncrefit_does_not_import_ray() -> None:
    code = (
        "import sys, asyncrefit, asyncrefit.local, asyncrefit.transport; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_device_query_that_is_not_async_is_refused_at_class_definition() -> None:
    with pytest.raises(TypeError, match="report_device_id_async must be an `async def`"):

        class Sync(RefitWorkerMixin):
            def report_device_id_async(self) -> DeviceId:  # type: ignore[override]
                return DeviceId(node="n", device="cpu:0")

    with pytest.raises(TypeError, match="refit_load must be an `async def`"):

        class SyncLoad(RefitWorkerMixin):
            def refit_load(self, *args: Any) -> Any:
                return None


def test_adapters_pass_workers_through_and_refuse_anything_else() -> None:
    from .fakes import FakeWorker
    from .models import make_mlp as model

    fake = FakeWorker.like("fake", DeviceId(node="n", device="cpu:0"), model())
    assert as_workers([fake]) == [fake]
    with pytest.raises(TypeError, match="neither a Worker nor a Ray actor handle"):
        as_workers([object()])
    with pytest.raises(TypeError, match="neither a TrainerSource nor a Ray actor handle"):
        as_source(object())


# --- on the cluster ---------------------------------------------------------------------


@pytest.mark.slow
async def test_one_trainer_four_actors_two_devices_bitwise_and_versions(pool: Pool) -> None:
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)  # serves every device of its node
    actors = pool.actors[:4]
    devices = ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]
    workers = await configure(actors, devices)
    source = RayTrainerSource(trainer, name="trainer")
    async with RefitCoordinator(trainer=source, workers=workers, budget_bytes=64 * KIB) as refit:
        assert refit.devices == {
            w.name: DeviceId(node=pool.node, device=d)
            for w, d in zip(workers, devices, strict=True)
        }
        for version in (1, 2, 3):
            await trainer.step.remote(version)
            report = await refit.push(version)
            assert report.buckets > 1
            await assert_hold(workers, trainer, version)
            assert refit.version == version
            assert refit.versions() == dict.fromkeys((w.name for w in workers), version)
            # one handle per bucket, whichever device: the same bytes for every worker
            assert len(set(report.handle_bytes_per_worker.values())) == 1
        for details, device in zip(await info(actors), devices, strict=True):
            # every actor was sent only its own device's handles
            assert details["handle_devices"] == [DeviceId(node=pool.node, device=device)]
            assert details["warnings"] == []
        assert segments_of(pool.trainer_pids)  # slots exist while the coordinator is open
    assert segments_of(pool.trainer_pids) == []


@pytest.mark.slow
async def test_actors_with_shared_parameters_are_written_directly(pool: Pool) -> None:
    """Two actors export their parameters (``shared_parameters=True``): the trainer
    actor writes every bucket into them, one actor call per bucket for both, while a
    third actor of the same push is sent staged buckets."""
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)
    here = {"num_cpus": 0, "scheduling_strategy": on_node(pool.node)}
    direct = [
        ray.remote(InferenceActor).options(**here).remote(make_mlp, "cpu:0", True) for _ in range(2)
    ]
    try:
        workers = await configure([*direct, pool.actors[0]], ["cpu:0", "cpu:1", "cpu:2"])
        source = RayTrainerSource(trainer, name="trainer")
        async with RefitCoordinator(
            trainer=source, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            for version in (1, 2, 3):
                await trainer.step.remote(version)
                report = await refit.push(version)
                assert report.buckets > 2
                await assert_hold(workers, trainer, version)
                assert report.bytes_per_transport == {
                    "direct": 2 * report.bytes,
                    "shm": report.bytes,
                }
        details = await info(direct)
        assert all(d["handle_devices"] == [] for d in details)  # never sent a bucket
        assert all(d["warnings"] == [] for d in details)
    finally:
        await end_gracefully(direct)


@pytest.mark.slow
async def test_actors_begun_ahead_keep_their_version_when_the_plan_no_longer_holds(
    pool: Pool,
) -> None:
    """Two actors written directly by the trainer actor: a push begins them while it
    reads the trainer. A parameter changed shape: the push raises the plan's error, the
    begins are taken back (on the actors' streams) before any write, and both actors
    hold version 2, bitwise; version 3 goes through once the shape is back."""
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)
    here = {"num_cpus": 0, "scheduling_strategy": on_node(pool.node)}
    direct = [
        ray.remote(InferenceActor).options(**here).remote(make_mlp, "cpu:0", True) for _ in range(2)
    ]
    try:
        workers = await configure(direct, ["cpu:0", "cpu:1"])
        assert all(isinstance(w, RestoringWorker) for w in workers)
        source = RayTrainerSource(trainer, name="trainer")
        async with RefitCoordinator(
            trainer=source, workers=workers, budget_bytes=16 * KIB
        ) as refit:
            for version in (1, 2):  # the second begun ahead
                await trainer.step.remote(version)
                report = await refit.push(version)
                assert report.bytes_per_transport == {"direct": 2 * report.bytes}
            held = await trainer.digests.remote()
            await trainer.reshape_first_weight.remote(255)
            try:
                with pytest.raises(ParameterMismatchError):
                    await refit.push(3)
            finally:
                await trainer.reshape_first_weight.remote(None)
            for w in workers:
                assert await w.parameter_digests() == held, w.name
                assert await w.weight_version() == 2, w.name
            assert refit.versions() == {"w0": 2, "w1": 2}
            await trainer.step.remote(3)
            await refit.push(3)
            await assert_hold(workers, trainer, 3)
    finally:
        await end_gracefully(direct)


@pytest.mark.slow
async def test_an_actor_killed_with_shared_parameters_has_its_segment_swept(pool: Pool) -> None:
    """An actor whose parameters live in a ``/dev/shm`` segment it created is killed
    (``ray.kill``: no chance to unlink it): removing it from the coordinator finds it
    dead, and a task on its node removes the segment; the others carry on."""
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)
    here = {"num_cpus": 0, "scheduling_strategy": on_node(pool.node)}
    victim = ray.remote(InferenceActor).options(**here).remote(make_mlp, "cpu:0", True)
    victim_pid = (await victim.info.remote())["pid"]
    workers = await configure([victim, pool.actors[1]], ["cpu:0", "cpu:1"])
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=16 * KIB
    ) as refit:
        await trainer.step.remote(31)
        report = await refit.push(1)
        assert report.bytes_per_transport["direct"] == report.bytes  # the victim's
        assert segments_of({victim_pid})  # its parameters
        await anyio.to_thread.run_sync(ray.kill, victim)
        with anyio.fail_after(60):
            await refit.remove_worker("w0")
        assert segments_of({victim_pid}) == []
        await trainer.step.remote(32)
        await refit.push(2)
        await assert_hold(workers[1:], trainer, 2)


def test_an_actor_without_the_mixin_is_refused(pool: Pool) -> None:
    with pytest.raises(TypeError, match=r"must inherit asyncrefit\.ray\.RefitWorkerMixin"):
        RayWorker(pool.trainers[0])
    with pytest.raises(TypeError, match=r"must inherit asyncrefit\.ray\.RefitTrainerMixin"):
        RayTrainerSource(pool.actors[0])


@pytest.mark.slow
async def test_device_query_awaits_the_engine_on_the_actors_own_loop(pool: Pool) -> None:
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)
    actors = pool.actors[4:6]
    # The engine reports cpu:1 although the actor was created on cpu:0: the
    # engine's answer, awaited on the actor's loop, is what counts.
    workers = await configure(actors, ["cpu:1", "cpu:1"])
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=64 * KIB
    ) as refit:
        assert {d.device for d in refit.devices.values()} == {"cpu:1"}
        await trainer.step.remote(7)
        await refit.push(1)
        await assert_hold(workers, trainer, 1)
    for details in await info(actors):
        # the engine was awaited on the loop that serves the actor's async methods
        assert details["engine_threads"] == [details["loop_thread"]]
        assert details["warnings"] == []  # nothing left un-awaited in the actor


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["coroutine", "ref"])
async def test_an_awaitable_from_the_device_query_is_a_typed_error(
    pool: Pool, mistake: str
) -> None:
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)
    good, bad = pool.actors[6:8]
    workers = await configure([good, bad], ["cpu:0", "cpu:1"])
    await bad.configure.remote(device="cpu:1", device_query=mistake)
    before = await workers[0].weight_version()
    with pytest.raises(AwaitableReturnedError) as err:
        async with RefitCoordinator(
            trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=64 * KIB
        ):
            pytest.fail("entered")
    assert err.value.worker == "w1" and "report_device_id_async" in str(err.value)
    assert await workers[0].weight_version() == before  # nothing moved
    assert (await info([bad]))[0]["warnings"] == []  # the coroutine was closed, not leaked
    assert segments_of(pool.trainer_pids) == []


@pytest.mark.slow
async def test_handles_stay_on_their_node(pool: Pool) -> None:
    here, there = pool.trainers[0], pool.other_trainer
    await here.configure.remote(None)  # every device of the head node
    await there.configure.remote(None)  # every device of the other node
    pids = {pool.node: await here.pid.remote(), pool.other_node: await there.pid.remote()}
    actors = [*pool.actors[8:10], *pool.other_actors]
    nodes = [pool.node, pool.node, pool.other_node, pool.other_node]
    devices = ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]  # the same names on both nodes
    workers = await configure(actors, devices)

    # A worker on a node without a source is refused before anything moves.
    with pytest.raises(UnknownDeviceError) as err:
        async with RefitCoordinator(
            trainer=RayTrainerSource(here), workers=workers, budget_bytes=64 * KIB
        ):
            pytest.fail("entered")
    assert err.value.worker in ("w2", "w3")
    assert pool.other_node in str(err.value) and pool.node in str(err.value)

    # With a source on each node, each worker is served by the one on its node.
    sources = [RayTrainerSource(here, name="here"), RayTrainerSource(there, name="there")]
    async with RefitCoordinator(trainer=sources, workers=workers, budget_bytes=64 * KIB) as refit:
        assert [refit.devices[w.name] for w in workers] == [
            DeviceId(node=n, device=d) for n, d in zip(nodes, devices, strict=True)
        ]
        for version in (1, 2):
            for trainer in (here, there):
                await trainer.step.remote(version)
            await refit.push(version)
            await assert_hold(workers, here, version)
    for details, node, device in zip(await info(actors), nodes, devices, strict=True):
        assert details["handle_devices"] == [DeviceId(node=node, device=device)]
        assert details["segments"]
        assert all(s.startswith(f"asyncrefit-{pids[node]}-") for s in details["segments"])
    assert segments_of(pool.trainer_pids) == []


@pytest.mark.slow
async def test_each_worker_is_served_by_the_shard_on_its_own_device(pool: Pool) -> None:
    shards = pool.trainers
    await shards[0].configure.remote(["cpu:0"])
    await shards[1].configure.remote(["cpu:1"])
    pids = [await s.pid.remote() for s in shards]
    devices = ["cpu:0", "cpu:1", "cpu:1", "cpu:0"]
    actors = pool.actors[10:14]
    await configure(actors, devices)
    # plain actor handles, adapted (what the coordinator does with handles it is given)
    adapted = as_workers(actors, names=[f"w{i}" for i in range(4)])
    workers = [w for w in adapted if isinstance(w, RayWorker)]
    sources = [as_source(s, name=f"shard-{i}") for i, s in enumerate(shards)]
    assert len(workers) == 4 and all(isinstance(s, RayTrainerSource) for s in sources)
    assert len(sources) == 2
    # The coordinator takes the raw actor handles too, and wraps them itself.
    async with RefitCoordinator(trainer=shards, workers=actors, budget_bytes=64 * KIB) as refit:
        for version in (1, 2):
            for shard in shards:  # replicas take the same step (as DDP ranks do)
                await shard.step.remote(version)
            report = await refit.push(version)
            for shard in shards:
                await assert_hold(workers, shard, version)
            assert len(set(report.handle_bytes_per_worker.values())) == 1
    for details, device in zip(await info(actors), devices, strict=True):
        shard_pid = pids[int(device[-1])]
        assert details["segments"], "no handle seen"
        # every segment this actor opened was made by the shard on its own device
        assert all(s.startswith(f"asyncrefit-{shard_pid}-") for s in details["segments"])
        assert details["handle_devices"] == [DeviceId(node=pool.node, device=device)]
    assert segments_of(pool.trainer_pids) == []


@pytest.mark.slow
async def test_fan_out_handle_bytes_per_worker_do_not_grow(pool: Pool) -> None:
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)
    await trainer.step.remote(11)
    filtered: dict[int, set[int]] = {}
    broadcast: dict[int, set[int]] = {}
    for count in (16, 32):
        actors = pool.actors[:count]
        workers = await configure(actors, [f"cpu:{i:02d}" for i in range(count)])
        for broadcast_all, table in ((False, filtered), (True, broadcast)):
            async with RefitCoordinator(
                trainer=RayTrainerSource(trainer),
                workers=workers,
                budget_bytes=64 * KIB,
                broadcast_all_handles=broadcast_all,
            ) as refit:
                report = await refit.push(1)
            table[count] = set(report.handle_bytes_per_worker.values())
        await assert_hold(workers, trainer, 1)
    # filtered: one number for every worker, the same for 16 and for 32 workers
    assert len(filtered[16]) == 1 and filtered[16] == filtered[32]
    # the broadcast baseline grows with the number of workers (devices)
    assert min(broadcast[16]) > max(filtered[16])
    assert min(broadcast[32]) > max(broadcast[16])
    assert segments_of(pool.trainer_pids) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
async def test_actor_killed_mid_push(pool: Pool, how: str) -> None:
    trainer = pool.trainers[0]
    await trainer.configure.remote(None)
    victim_cls = ray.remote(InferenceActor).options(
        num_cpus=0, scheduling_strategy=on_node(pool.node)
    )
    victim = victim_cls.remote(make_mlp, "cpu:1")
    victim_pid = (await victim.info.remote())["pid"]
    survivors = await configure(pool.actors[14:16], ["cpu:0", "cpu:1"])
    await victim.configure.remote(device="cpu:1", hang_at=1)
    workers = [*survivors, RayWorker(victim, name="victim")]
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=64 * KIB, timeout=60
    ) as refit:
        killed_at: list[float] = []

        async def kill() -> None:
            await victim.wait_for_hang.remote()
            if how == "ray.kill":
                await anyio.to_thread.run_sync(ray.kill, victim)
            else:
                os.kill(victim_pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        await trainer.step.remote(21)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                with pytest.raises(PushError) as err:
                    await refit.push(1)
        noticed = time.monotonic() - killed_at[0]
        assert noticed < 15, f"the death was noticed after {noticed:.1f} s"
        assert isinstance(err.value.cause, WorkerDiedError)
        assert err.value.failed == "victim" and "victim" in str(err.value)
        assert set(err.value.incomplete) == {"w0", "w1", "victim"}
        for w in survivors:  # aborted: they claim no complete version
            assert await w.weight_version() is None
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        # the coordinator carries on with the survivors
        await refit.remove_worker("victim")
        await trainer.step.remote(22)
        await refit.push(2)
        await assert_hold(survivors, trainer, 2)
    assert segments_of(pool.trainer_pids | {victim_pid}) == []


@pytest.mark.slow
async def test_trainer_actor_killed_mid_push_its_segments_are_swept(pool: Pool) -> None:
    trainer_cls = ray.remote(TrainerActor).options(
        num_cpus=0, scheduling_strategy=on_node(pool.node)
    )
    trainer = trainer_cls.remote(make_mlp)
    trainer_pid = await trainer.pid.remote()
    workers = await configure(pool.actors[16:18], ["cpu:0", "cpu:1"])
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer, name="doomed"), workers=workers, budget_bytes=64 * KIB
    ) as refit:
        await refit.push(1)
        assert segments_of({trainer_pid})  # its staging slots
        await trainer.hang_export_at.remote(1)

        async def kill() -> None:
            await trainer.wait_for_hang.remote()
            await anyio.to_thread.run_sync(ray.kill, trainer)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                with pytest.raises(PushError) as err:
                    await refit.push(2)
        cause = err.value.cause
        assert isinstance(cause, SourceDiedError)
        assert cause.source == "doomed" and "doomed" in str(err.value)
        assert set(err.value.incomplete) == {"w0", "w1"}
        for w in workers:  # bucket 0 of version 2 was written: no complete version
            assert await w.weight_version() is None
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        # the next push names the dead source before touching any worker (the
        # coordinator raises it from the group its sources were described in)
        with anyio.fail_after(30), pytest.raises((SourceDiedError, BaseExceptionGroup)) as dead:
            await refit.push(3)
        again = primary_error(dead.value)
        assert isinstance(again, SourceDiedError) and again.source == "doomed"
    # closing found the actor dead and swept its segments on its node
    assert segments_of({trainer_pid}) == []


# --- bucket order on the worker side (no cluster needed) ---------------------------------


class _PlainWorker(RefitWorkerMixin):
    """The mixin on a plain object: its methods are awaited directly, in any order."""

    def __init__(self) -> None:
        self.model = make_mlp()
        self.init_refit(self.model, device=cpu_device(0))


async def test_loads_are_taken_in_bucket_order_whatever_order_they_arrive_in() -> None:
    """Ray may run an actor's calls in any order; a broadcast must be received in order."""
    source_model = make_mlp()
    trainer = LocalTrainer(source_model)
    await trainer.describe()
    plan = plan_buckets(trainer.specs(), 16 * KIB)
    assert len(plan.buckets) >= 3
    await trainer.prepare(plan, len(plan.buckets), plan.max_bucket_bytes)
    worker = _PlainWorker()
    try:
        handles = [await trainer.export(b, b.index, [cpu_device(0)]) for b in plan.buckets]
        done: list[int] = []

        async def load(i: int) -> None:
            await worker.refit_load(1, i, handles[i])
            done.append(i)

        await worker.refit_begin(1)
        async with anyio.create_task_group() as tg:
            for i in reversed(range(len(plan.buckets))):  # last bucket first
                tg.start_soon(load, i)
                await anyio.wait_all_tasks_blocked()
        assert done == list(range(len(plan.buckets)))
        await worker.refit_commit(1, len(plan.buckets))
        assert await worker.refit_weight_version() == 1

        # an abort releases a load still waiting for its turn, with a typed error
        await worker.refit_begin(2)
        with pytest.raises(AsyncRefitError, match="aborted"), one_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.refit_load, 2, 1, handles[1])
                await anyio.wait_all_tasks_blocked()
                await worker.refit_abort(2)
    finally:
        await worker.refit_release_handles()
        await trainer.aclose()


# --- the trainer's description, once per change (no cluster needed) ---------------------


class _PlainTrainer(RefitTrainerMixin):
    """The mixin on a plain object (its node named: no cluster to ask)."""

    def __init__(self) -> None:
        self.model = make_mlp()
        self.init_refit_source(self.model, node="node-0")


class _InProcessHandle:
    """An actor handle whose ``method.remote(...)`` is the call itself, awaited here (as
    a Ray handle's result is): the source's calls and their replies are seen."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self.replies: list[Any] = []

    def __getattr__(self, method: str) -> Any:
        call = getattr(self._actor, method)
        replies = self.replies

        class Method:
            @staticmethod
            async def remote(*args: Any) -> Any:
                reply = await call(*args)
                replies.append(reply)
                return reply

        return Method


async def test_an_unchanged_description_is_sent_once() -> None:
    """The actor sends its description when it changed, else only its token; the
    source answers the same object then (the coordinator's plan stays current by
    identity), and a new parameter shape is described and sent again."""
    trainer = _PlainTrainer()
    handle = _InProcessHandle(trainer)
    source = RayTrainerSource(handle, name="trainer")
    try:
        first = await source.describe()
        assert first.name == "trainer" and handle.replies[-1][1] is not None
        for _ in range(3):
            assert await source.describe() is first
            assert handle.replies[-1][1] is None  # the token alone came back
        # another source of the same actor holds no token: it is sent the description
        other = RayTrainerSource(handle, name="other")
        assert (await other.describe()).name == "other"
        assert handle.replies[-1][1] is not None
        assert await source.describe() is first  # the first one's token still holds
        # a parameter replaced by one of another shape: described anew, and sent
        first_layer: Any = trainer.model.get_submodule("0")
        first_layer.weight = torch.nn.Parameter(torch.zeros(128, 64))
        changed = await source.describe()
        assert changed is not first and handle.replies[-1][1] is not None
        specs = {s.name: s.shape for s in changed.specs}
        assert specs["0.weight"] == (128, 64)
        assert await source.describe() is changed
    finally:
        await trainer.refit_source.aclose()
