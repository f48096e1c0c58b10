"""A sharded trainer on Ray: one trainer actor per FSDP2 rank, refitting Ray workers.

One local cluster serves the module (``ray.init(num_cpus=2)``): two trainer actors
form their own gloo group (``init_trainer_group``) and each shards a small
transformer with ``fully_shard`` (fp32 master weights, row counts two ranks split
unevenly); three inference actors hold it in bf16. Every push follows real optimizer
steps run on both ranks at once, and every worker must then hold, bitwise, the
trainer's full state gathered by both ranks and cast to bf16. Rank 0 serves ``cpu:0``
and rank 1 ``cpu:1``: with every worker on ``cpu:0``, rank 1 serves none, yet must
gather every bucket. A last test kills a rank's actor in the middle of a push.

The tests without a cluster check the trainer mixin's bucket order and its choice of
source on plain objects.
"""

from __future__ import annotations

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
    LocalTrainer,
    PushError,
    RefitCoordinator,
    cpu_device,
)
from asyncrefit._exceptions import one_error  # noqa: E402
from asyncrefit.planning import plan_buckets  # noqa: E402
from asyncrefit.ray import (  # noqa: E402
    RayTrainerSource,
    RayWorker,
    RefitTrainerMixin,
    SourceDiedError,
    destroy_trainer_group,
    init_trainer_group,
)
from asyncrefit.trainer import DTensorSource  # noqa: E402
from asyncrefit.transport.shm import list_segments  # noqa: E402

from .models import make_mlp  # noqa: E402
from .ray_actors import InferenceActor, ShardedTrainerActor  # noqa: E402
from .sharded import make_transformer_bf16  # noqa: E402

KIB = 1024
GATHER_TIMEOUT = 10.0
Remote = Any  # a Ray actor handle

# Generous but bounded: the first cluster test waits for five actors to import torch.
pytestmark = pytest.mark.timeout(300)


def segments_of(pids: set[int]) -> list[str]:
    return [s for s in list_segments() if int(s.split("-")[1]) in pids]


async def each(refs: list[Any]) -> list[Any]:
    """Await every ``ObjectRef`` of ``refs`` concurrently (a collective on every rank)."""
    results: list[Any] = [None] * len(refs)

    async def one(i: int) -> None:
        results[i] = await refs[i]

    with one_error():
        async with anyio.create_task_group() as tg:
            for i in range(len(refs)):
                tg.start_soon(one, i)
    return results


async def start_ranks(world: int = 2) -> tuple[list[Remote], list[int]]:
    """``world`` trainer actors in a group of their own, rank ``r`` serving ``cpu:<r>``."""
    ranks = [ray.remote(ShardedTrainerActor).options(num_cpus=0).remote() for _ in range(world)]
    pids = await each([r.pid.remote() for r in ranks])
    group = await init_trainer_group(ranks, backend="gloo", group_timeout=60)
    assert group.world_size == world and group.port > 0
    gathers = await each(
        [r.setup.remote([f"cpu:{i}"], GATHER_TIMEOUT) for i, r in enumerate(ranks)]
    )
    assert gathers == [True] * world  # DTensor parameters: a rank's source, found alone
    return ranks, pids


@dataclass
class Cluster:
    ranks: list[Remote]  # two FSDP2 trainer actors, one process group
    rank_pids: set[int]
    actors: list[Remote]  # three inference actors holding the model in bf16


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """The module's cluster, its two ranks and three inference actors; shut down at the end.

    Everything starts before each test's leak check records the child processes.
    """
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20)
    try:
        actor_cls = ray.remote(InferenceActor).options(num_cpus=0)
        actors = [actor_cls.remote(make_transformer_bf16, "cpu:0") for _ in range(3)]
        ranks, pids = anyio.run(start_ranks)
        ray.get([a.info.remote() for a in actors], timeout=240)
        yield Cluster(ranks=ranks, rank_pids=set(pids), actors=actors)
        anyio.run(destroy_trainer_group, ranks)
        assert segments_of(set(pids)) == []
    finally:
        ray.shutdown()


async def configure(actors: list[Remote], devices: list[str]) -> list[RayWorker]:
    await each([a.configure.remote(device=d) for a, d in zip(actors, devices, strict=True)])
    return [RayWorker(a, name=f"w{i}") for i, a in enumerate(actors)]


def bf16_bytes() -> int:
    return sum(p.numel() * 2 for p in make_transformer_bf16().parameters())


# --- on the cluster ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices",
    [["cpu:0", "cpu:1", "cpu:1"], ["cpu:0", "cpu:0", "cpu:0"]],
    ids=["both-ranks-serve", "rank-1-serves-none"],
)
async def test_fsdp2_rank_actors_push_their_gathered_state_cast_to_bf16(
    cluster: Cluster, devices: list[str]
) -> None:
    ranks = cluster.ranks
    workers = await configure(cluster.actors, devices)
    await each([r.clear_export_log.remote() for r in ranks])
    sources = [RayTrainerSource(r, name=f"rank-{i}") for i, r in enumerate(ranks)]
    async with RefitCoordinator(
        trainer=sources, workers=workers, budget_bytes=64 * KIB, timeout=60, verify=True
    ) as refit:
        assert refit.plan is not None
        buckets = len(refit.plan.buckets)
        assert buckets > 2
        for version in (1, 2, 3):
            seed = 10 * len(set(devices)) + version
            losses = await each([r.train_step.remote(seed) for r in ranks])
            assert losses[0] == losses[1]  # one model, trained by both ranks together
            report = await refit.push(version)
            assert report.bytes == bf16_bytes()
            expected, also = await each([r.gathered_digests.remote() for r in ranks])
            assert expected == also
            for w in workers:
                assert await w.parameter_digests() == expected, (w.name, version)
                assert await w.weight_version() == version
        assert segments_of(cluster.rank_pids)  # each rank's slots, while open
    assert segments_of(cluster.rank_pids) == []
    served = {r: sum(d == f"cpu:{r}" for d in devices) > 0 for r in range(2)}
    for rank, log in enumerate(await each([r.export_log.remote() for r in ranks])):
        # every rank exported every bucket of every push, in plan order, without error
        assert [b for b, *_ in log] == list(range(buckets)) * 3, rank
        assert all(error is None for *_, error in log), log
        # a rank that serves no worker is exported with no device (it only gathers)
        assert {n for _, n, _, _ in log} == ({1} if served[rank] else {0}), (rank, devices)


@pytest.mark.slow
async def test_a_group_is_formed_once_per_actor(cluster: Cluster) -> None:
    with pytest.raises(AsyncRefitError, match="already have a default process group"):
        await init_trainer_group(cluster.ranks, backend="gloo", group_timeout=10)
    # refused before anyone joined: the ranks still push
    workers = await configure(cluster.actors[:1], ["cpu:1"])
    async with RefitCoordinator(
        trainer=[RayTrainerSource(r) for r in cluster.ranks], workers=workers, budget_bytes=64 * KIB
    ) as refit:
        await refit.push(1)
        expected, _ = await each([r.gathered_digests.remote() for r in cluster.ranks])
        assert await workers[0].parameter_digests() == expected


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow
async def test_a_rank_actor_killed_mid_push_fails_it_and_nothing_is_left(
    cluster: Cluster,
) -> None:
    ranks, pids = await start_ranks()  # a pair of its own, in a group of its own
    survivor, victim = ranks
    try:
        workers = await configure(cluster.actors[:2], ["cpu:0", "cpu:1"])
        sources = [RayTrainerSource(r, name=f"rank-{i}") for i, r in enumerate(ranks)]
        async with RefitCoordinator(
            trainer=sources, workers=workers, budget_bytes=64 * KIB, timeout=30
        ) as refit:
            await each([r.train_step.remote(1) for r in ranks])
            await refit.push(1)
            assert segments_of({pids[1]})  # the victim's staging slots
            await victim.hang_export_at.remote(1)
            await survivor.clear_export_log.remote()
            killed_at: list[float] = []

            async def kill() -> None:
                await victim.wait_for_hang.remote()
                await anyio.sleep(0.5)  # rank 0 is in bucket 1's gather by now
                await anyio.to_thread.run_sync(ray.kill, victim)
                killed_at.append(time.monotonic())

            start = time.monotonic()
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill)
                    with pytest.raises(PushError) as err:
                        await refit.push(2)
            assert time.monotonic() - start < 30  # within the coordinator's timeout
            assert time.monotonic() - killed_at[0] < GATHER_TIMEOUT + 5
            cause = err.value.cause
            assert isinstance(cause, SourceDiedError), repr(cause)
            assert cause.source == "rank-1"
            assert set(err.value.incomplete) == {"w0", "w1"}
            for w in workers:
                assert await w.weight_version() is None  # aborted mid-way
            # the survivor's gather of bucket 1 returned, failed, within its timeout
            log = await survivor.export_log.remote()
            assert [b for b, *_ in log] == [0, 1], log
            _, _, seconds, error = log[-1]
            assert error is not None and "PackError" in error, log
            assert seconds < GATHER_TIMEOUT + 2, log
            assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        # closing swept the dead rank's segments on its node and freed the survivor's
        assert segments_of(set(pids)) == []
    finally:
        for r in ranks:
            ray.kill(r)
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:  # noqa: ASYNC110
        await anyio.sleep(0.1)  # another process's exit: nothing to wait on but /proc
    assert all(_gone(p) for p in pids), pids
    assert segments_of(set(pids)) == []


# --- without a cluster: the mixin on plain objects ---------------------------------------


class _Recording(LocalTrainer):
    """Records the order its buckets are packed in."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, node=cpu_device(0).node)
        self.packed: list[int] = []

    def _pack_locked(self, bucket: Any, slot: int) -> int | None:
        self.packed.append(bucket.index)
        return super()._pack_locked(bucket, slot)


class _PlainTrainer(RefitTrainerMixin):
    """The mixin on a plain object: its methods are awaited directly, in any order."""

    def __init__(self) -> None:
        self.model = make_mlp()
        self.recording = _Recording(self.model)
        self._refit_source_ = self.recording


async def test_exports_run_in_bucket_order_whatever_order_they_arrive_in() -> None:
    """Ray may run an actor's calls in any order; a rank must gather in plan order."""
    trainer = _PlainTrainer()
    source = trainer.refit_source
    await trainer.refit_source_describe()
    plan = plan_buckets(source.specs(), 16 * KIB)
    n = len(plan.buckets)
    assert n >= 3
    await source.prepare(plan, n, plan.max_bucket_bytes)
    try:
        done: list[int] = []

        async def export(i: int) -> None:
            await trainer.refit_source_export(plan.buckets[i], i, [cpu_device(0)])
            done.append(i)

        async with anyio.create_task_group() as tg:
            for i in reversed(range(n)):  # the last bucket first
                tg.start_soon(export, i)
                await anyio.wait_all_tasks_blocked()
        assert trainer.recording.packed == list(range(n)) and done == list(range(n))

        # a new push (describe) releases an export still waiting, with a typed error
        await trainer.refit_source_describe()
        with pytest.raises(AsyncRefitError, match="new one began"), one_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer.refit_source_export, plan.buckets[1], 1, [])
                await anyio.wait_all_tasks_blocked()
                await trainer.refit_source_describe()
        # and that push runs from bucket 0; an export with no device still packs
        assert await trainer.refit_source_export(plan.buckets[0], 0, []) == ()
        assert trainer.recording.packed[-1] == 0
    finally:
        await trainer.refit_source_close()


class _Chooser(RefitTrainerMixin):
    def __init__(self, parameters: Any, **kwargs: Any) -> None:
        self.init_refit_source(parameters, node="n", **kwargs)


async def test_the_source_is_chosen_by_the_parameters_or_by_sharded() -> None:
    model = make_mlp()
    plain = _Chooser(model).refit_source
    assert type(plain) is LocalTrainer and not (await plain.describe()).gathers
    forced = _Chooser(model, sharded=True, gather_timeout=5).refit_source
    assert isinstance(forced, DTensorSource) and (await forced.describe()).gathers
    with pytest.raises(ValueError, match="gather_timeout applies to a sharded"):
        _Chooser(model, gather_timeout=5)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        params = {"w": distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])}
        found = _Chooser(params).refit_source
        assert isinstance(found, DTensorSource) and found.name == "rank-0"
        assert isinstance(_Chooser(lambda: params).refit_source, DTensorSource)
        with pytest.raises(ValueError, match="some parameters are DTensors"):
            _Chooser(params, sharded=False)
    finally:
        dist.destroy_process_group()
