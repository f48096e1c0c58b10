"""The Ray backend's streaming path: one actor call per worker for all its pushes.

A cluster of one node (``ray.init(num_cpus=2)``) serves the module, with one trainer
actor and a few inference actors that record the Ray task of every refit call they
serve (so the tests count actor calls in the actor) and can be made to copy one
bucket slowly (a load to cancel, or to kill the actor in). Tests that kill actors
start their own victims. Cluster tests are ``slow``.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

ray = pytest.importorskip("ray")

from asyncrefit import PushError, RefitCoordinator, WorkerDiedError  # noqa: E402
from asyncrefit._wire._channel import FrameChannel, TcpListener, connect_tcp  # noqa: E402
from asyncrefit.ray import RayTrainerSource, RayWorker  # noqa: E402
from asyncrefit.ray._stream import StreamCall  # noqa: E402
from asyncrefit.transport import Handle  # noqa: E402
from asyncrefit.transport.shm import list_segments  # noqa: E402

from .models import make_mlp  # noqa: E402
from .ray_actors import InferenceActor, TrainerActor  # noqa: E402

KIB = 1024
ACTORS = 4
Remote = Any  # a Ray actor handle

pytestmark = pytest.mark.timeout(240)


class CountingActor(InferenceActor):
    """An inference actor that records which Ray task served each refit call.

    Every ``refit_*`` entry point notes ``ray.get_runtime_context().get_task_id()``:
    the calls a stream serves through ``refit_load`` & co. run inside the one
    ``refit_stream`` task, per-call requests each in their own. ``slow(bucket, s)``
    makes the copy of ``bucket`` take ``s`` more seconds (in the copying thread, with
    the lock held, as a large copy would).
    """

    def __init__(self, factory: Callable[[], Any], device: str) -> None:
        super().__init__(factory, device)
        self.known: set[str] = set()
        self.tasks: list[str] = []
        self.slow_bucket: int | None = None
        self.slow_s = 0.0
        self.copying: anyio.Event | None = None
        receiver = self.refit_receiver
        plain_load = receiver.load

        def load(version: int, bucket: int, handles: tuple[Handle, ...]) -> Any:
            if bucket == self.slow_bucket:
                if self.copying is not None:
                    anyio.from_thread.run_sync(self.copying.set)
                time.sleep(self.slow_s)
            return plain_load(version, bucket, handles)

        receiver.load = load  # type: ignore[method-assign]

    def _seen(self, method: str) -> None:
        task = str(ray.get_runtime_context().get_task_id())
        if task not in self.known:  # a task is counted once, by its first method
            self.known.add(task)
            self.tasks.append(method)

    async def refit_stream(self, host: str, port: int, token: bytes) -> int:
        self._seen("refit_stream")
        return await super().refit_stream(host, port, token)

    async def refit_begin(self, version: int) -> None:
        self._seen("refit_begin")
        await super().refit_begin(version)

    async def refit_load(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> Any:
        self._seen("refit_load")
        return await super().refit_load(version, bucket, handles)

    async def refit_commit(self, version: int, buckets: int) -> None:
        self._seen("refit_commit")
        await super().refit_commit(version, buckets)

    async def refit_abort(self, version: int) -> None:
        self._seen("refit_abort")
        await super().refit_abort(version)

    async def take_tasks(self) -> list[str]:
        """The method that opened each Ray task seen since the last call, in order."""
        await anyio.lowlevel.checkpoint()
        seen, self.tasks = self.tasks, []
        return seen

    async def slow(self, bucket: int | None, seconds: float = 0.0) -> None:
        await anyio.lowlevel.checkpoint()
        self.slow_bucket, self.slow_s = bucket, seconds
        self.copying = anyio.Event()

    async def wait_copying(self) -> None:
        """Returns once the slow bucket's copy began."""
        assert self.copying is not None
        await self.copying.wait()


@dataclass
class Cluster:
    node: str
    trainer: Remote
    trainer_pid: int
    actors: list[Remote]


def on_node(node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A one-node Ray cluster with a trainer and ``ACTORS`` counting inference actors."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20)
    try:
        node = ray.get_runtime_context().get_node_id()
        here = {"num_cpus": 0, "scheduling_strategy": on_node(node)}
        trainer = ray.remote(TrainerActor).options(**here).remote(make_mlp)
        actor_cls = ray.remote(CountingActor).options(**here)
        actors = [actor_cls.remote(make_mlp, f"cpu:{i % 2}") for i in range(ACTORS)]
        pid = ray.get(trainer.pid.remote(), timeout=180)
        ray.get([a.info.remote() for a in actors], timeout=180)
        yield Cluster(node=node, trainer=trainer, trainer_pid=pid, actors=actors)
        assert [s for s in list_segments() if f"-{pid}-" in s] == []
    finally:
        ray.shutdown()


def workers_of(actors: list[Remote], *, stream: bool = True) -> list[RayWorker]:
    return [RayWorker(a, name=f"w{i}", stream=stream) for i, a in enumerate(actors)]


async def assert_hold(workers: list[RayWorker], trainer: Remote, version: int) -> None:
    want = await trainer.digests.remote()
    for w in workers:
        assert await w.parameter_digests() == want, w.name
        assert await w.weight_version() == version, w.name


async def take_tasks(actors: list[Remote]) -> list[list[str]]:
    return [await a.take_tasks.remote() for a in actors]


# --- without a cluster ------------------------------------------------------------------


class _PendingRef:
    """Stands in for an ObjectRef whose call has not finished (``future()`` only)."""

    def __init__(self) -> None:
        self.result: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future[Any]:
        return self.result


@pytest.mark.timeout(30)
async def test_tcp_listener_and_connect_carry_frames() -> None:
    listener = TcpListener("127.0.0.1")
    try:
        host, port = listener.address
        client = await connect_tcp(host, port)
        server = FrameChannel(await listener.accept_socket())
        try:
            await client.send(b"x" * 100_000, within=5)
            assert await server.receive() == b"x" * 100_000
            await server.send(b"ack", within=5)
            assert await client.receive() == b"ack"
            await client.aclose()
            with pytest.raises(anyio.EndOfStream):
                await server.receive()
        finally:
            await client.aclose()
            await server.aclose()
    finally:
        await listener.aclose()
    with pytest.raises(OSError):
        await connect_tcp(host, port)  # nobody listens there any more


@pytest.mark.timeout(30)
async def test_a_connection_without_the_token_is_dropped_and_the_actors_is_taken() -> None:
    listener = TcpListener("127.0.0.1")
    ref = _PendingRef()
    call = StreamCall("w", ref)
    token = b"t" * 16
    host, port = listener.address
    try:
        stranger = await connect_tcp(host, port)
        actor = await connect_tcp(host, port)
        try:
            await stranger.send(b"guess" * 4, within=5)
            await actor.send(token, within=5)
            with anyio.fail_after(10):
                await call._accept(listener, token)
            with pytest.raises(anyio.EndOfStream):  # dropped, never answered
                await stranger.receive()

            async def begin() -> None:
                # the call's end wakes a request waiting on the stream: typed, not hung
                with pytest.raises(Exception, match="gone"):
                    await call.begin(7)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(begin)
                    assert await actor.receive()  # the actor's connection is the one kept
                    ref.result.set_exception(ConnectionError("gone"))
            assert not call.usable
        finally:
            await stranger.aclose()
            await actor.aclose()
    finally:
        await call.close()
        await listener.aclose()


# --- on the cluster ---------------------------------------------------------------------


@pytest.mark.slow
async def test_a_push_over_the_stream_is_bitwise_right(cluster: Cluster) -> None:
    trainer = cluster.trainer
    await trainer.configure.remote(None)
    actors = cluster.actors
    for a in actors:
        await a.slow.remote(None)
    workers = workers_of(actors)
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=64 * KIB
    ) as refit:
        for version in (1, 2, 3):
            await trainer.step.remote(version)
            report = await refit.push(version)
            assert report.buckets > 1
            await assert_hold(workers, trainer, version)
    for details, i in zip([await a.info.remote() for a in actors], range(ACTORS), strict=True):
        assert [d.device for d in details["handle_devices"]] == [f"cpu:{i % 2}"]  # filtered
        assert details["warnings"] == []
    # the old path, on the same actors, after the stream: the same bytes
    workers = workers_of(actors, stream=False)
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=64 * KIB
    ) as refit:
        await trainer.step.remote(4)
        await refit.push(4)
        await assert_hold(workers, trainer, 4)


async def two_quiet_actors(cluster: Cluster) -> tuple[Remote, list[Remote]]:
    """The cluster's trainer, reset, and its first two actors with no delay and no task log."""
    await cluster.trainer.configure.remote(None)
    actors = cluster.actors[:2]
    for a in actors:
        await a.slow.remote(None)
    await take_tasks(actors)
    return cluster.trainer, actors


@pytest.mark.slow
async def test_actor_calls_per_push_are_constant_in_the_bucket_count(cluster: Cluster) -> None:
    trainer, actors = await two_quiet_actors(cluster)
    calls: dict[tuple[bool, int], list[list[str]]] = {}
    for stream in (True, False):
        for bucket_bytes in (256 * KIB, 64 * KIB):  # fewer and more buckets
            workers = workers_of(actors, stream=stream)
            async with RefitCoordinator(
                trainer=RayTrainerSource(trainer),
                workers=workers,
                budget_bytes=512 * KIB,
                bucket_bytes=bucket_bytes,
            ) as refit:
                await refit.push(1)  # warm-up
                first = await take_tasks(actors)
                report = await refit.push(2)
                calls[stream, report.buckets] = await take_tasks(actors)
                await assert_hold(workers, trainer, 2)
                if stream:  # the one call, made by the first push, serves every push
                    assert first == [["refit_stream"]] * 2
    counts = sorted({b for _, b in calls})
    assert len(counts) == 2 and counts[0] < counts[1], counts
    for buckets in counts:
        # streaming: no actor call at all after the first push, whatever the bucket count
        assert calls[True, buckets] == [[]] * 2
        # per call: begin, one per bucket, commit (the counter does count calls; Ray
        # may start an actor's calls in any order)
        want = sorted(["refit_begin", *["refit_load"] * buckets, "refit_commit"])
        assert [sorted(c) for c in calls[False, buckets]] == [want] * 2


@pytest.mark.slow
async def test_a_load_cancelled_mid_stream_leaves_the_worker_aborted_and_the_next_push_works(
    cluster: Cluster,
) -> None:
    trainer = cluster.trainer
    await trainer.configure.remote(None)
    actors = cluster.actors[:2]
    slow = actors[1]
    workers = workers_of(actors)
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer),
        workers=workers,
        budget_bytes=128 * KIB,
        bucket_bytes=64 * KIB,
        timeout=60,
    ) as refit:
        await trainer.step.remote(31)
        await refit.push(1)
        await slow.slow.remote(1, 1.0)  # the copy of bucket 1 takes a second
        await take_tasks(actors)
        await trainer.step.remote(32)
        cancelled_at = 0.0
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:

                async def push() -> None:
                    await refit.push(2)
                    pytest.fail("the push was not cancelled")

                tg.start_soon(push)
                await slow.wait_copying.remote()
                cancelled_at = time.monotonic()
                tg.cancel_scope.cancel()
        # the abort was confirmed only once the copy in progress had finished
        assert time.monotonic() - cancelled_at > 0.5
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        assert await workers[1].weight_version() is None  # bucket 0 of 2 was written
        assert refit.versions()["w1"] is None
        # the abort went on the stream, behind the copy: no call of its own
        assert (await take_tasks([slow]))[0] == []
        await slow.slow.remote(None)
        await trainer.step.remote(33)
        await refit.push(3)
        await assert_hold(workers, trainer, 3)
        assert (await take_tasks([slow]))[0] == []  # the same stream serves it
        assert (await slow.info.remote())["warnings"] == []


@pytest.mark.slow
async def test_a_push_cancelled_at_any_moment_leaves_nothing_half_done(cluster: Cluster) -> None:
    trainer = cluster.trainer
    await trainer.configure.remote(None)
    actors = cluster.actors[2:4]
    for a in actors:
        await a.slow.remote(None)
    workers = workers_of(actors)
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer),
        workers=workers,
        budget_bytes=128 * KIB,
        bucket_bytes=64 * KIB,
        timeout=60,
    ) as refit:
        await refit.push(1)
        started = time.monotonic()
        await refit.push(2)
        whole = time.monotonic() - started
        version = 2
        for step in range(12):  # from before the begin to after the commit
            version += 1
            with anyio.move_on_after(whole * step / 8):
                await refit.push(version)
            assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
            version += 1
            await trainer.step.remote(version)
            with anyio.fail_after(60):
                await refit.push(version)
            await assert_hold(workers, trainer, version)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
async def test_an_actor_killed_mid_stream_is_a_worker_died_error(
    cluster: Cluster, how: str
) -> None:
    trainer = cluster.trainer
    await trainer.configure.remote(None)
    victim_cls = ray.remote(CountingActor).options(
        num_cpus=0, scheduling_strategy=on_node(cluster.node)
    )
    victim = victim_cls.remote(make_mlp, "cpu:1")
    victim_pid = (await victim.info.remote())["pid"]
    await victim.slow.remote(1, 30.0)  # killed while it copies bucket 1
    survivor = cluster.actors[0]
    await survivor.slow.remote(None)
    workers = [RayWorker(survivor, name="w0"), RayWorker(victim, name="victim")]
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer),
        workers=workers,
        budget_bytes=128 * KIB,
        bucket_bytes=64 * KIB,
        timeout=60,
    ) as refit:
        killed_at: list[float] = []

        async def kill() -> None:
            await victim.wait_copying.remote()
            if how == "ray.kill":
                await anyio.to_thread.run_sync(ray.kill, victim)
            else:
                os.kill(victim_pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        await trainer.step.remote(41)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                with pytest.raises(PushError) as err:
                    await refit.push(1)
        noticed = time.monotonic() - killed_at[0]
        assert noticed < 15, f"the death was noticed after {noticed:.1f} s"
        assert isinstance(err.value.cause, WorkerDiedError)
        assert err.value.failed == "victim"
        assert await workers[0].weight_version() is None  # aborted
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        await refit.remove_worker("victim")
        await trainer.step.remote(42)
        await refit.push(2)
        await assert_hold(workers[:1], trainer, 2)
    assert [s for s in list_segments() if f"-{victim_pid}-" in s] == []


def test_the_stream_connects_to_the_address_ray_reports(cluster: Cluster) -> None:
    from asyncrefit.ray._stream import driver_host

    host = driver_host()
    assert host == ray.util.get_node_ip_address()
    listener = socket.create_server((host, 0))  # the address can be listened on
    listener.close()


@pytest.mark.slow
async def test_a_stream_lost_between_pushes_is_opened_anew(cluster: Cluster) -> None:
    trainer, actors = await two_quiet_actors(cluster)
    workers = workers_of(actors)
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=64 * KIB, timeout=60
    ) as refit:
        await trainer.step.remote(51)
        await refit.push(1)
        assert await take_tasks(actors) == [["refit_stream"]] * 2
        # w0's connection fails while nobody uses it, as a network failure would
        stream = workers[0]._stream
        assert stream is not None and stream._sock is not None
        stream._sock.shutdown(socket.SHUT_RDWR)
        await trainer.step.remote(52)
        with anyio.fail_after(60):
            await refit.push(2)
        await assert_hold(workers, trainer, 2)
        # w0 got a new stream call; w1 kept its own
        assert await take_tasks(actors) == [["refit_stream"], []]
        assert (await actors[0].info.remote())["warnings"] == []


@pytest.mark.slow
async def test_an_actor_killed_between_pushes_is_a_worker_died_error(cluster: Cluster) -> None:
    trainer = cluster.trainer
    await trainer.configure.remote(None)
    victim = (
        ray.remote(CountingActor)
        .options(num_cpus=0, scheduling_strategy=on_node(cluster.node))
        .remote(make_mlp, "cpu:1")
    )
    survivor = cluster.actors[0]
    await survivor.slow.remote(None)
    workers = [RayWorker(survivor, name="w0"), RayWorker(victim, name="victim")]
    async with RefitCoordinator(
        trainer=RayTrainerSource(trainer), workers=workers, budget_bytes=64 * KIB, timeout=60
    ) as refit:
        await trainer.step.remote(61)
        await refit.push(1)
        await anyio.to_thread.run_sync(ray.kill, victim)
        started = time.monotonic()
        with anyio.fail_after(60), pytest.raises(PushError) as err:
            await refit.push(2)
        assert time.monotonic() - started < 15
        assert isinstance(err.value.cause, WorkerDiedError)
        assert err.value.failed == "victim"
        assert await workers[0].weight_version() == 1  # given up again, still at 1
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        await refit.remove_worker("victim")
        await trainer.step.remote(62)
        await refit.push(3)
        await assert_hold(workers[:1], trainer, 3)
