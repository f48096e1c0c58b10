"""The coordinator's rank channels against the worker's blocking end; no vLLM.

:class:`~asyncrefit.vllm._channels.RankChannels` (non-blocking, uvloop-safe frame
channels) must speak the frames of :class:`~asyncrefit.vllm._wire.BlockingChannel`, the
end vLLM's worker processes use: each rank, in a thread, connects, greets, and answers
the request its trigger names, skipping the requests of cancelled exchanges; and serves
its control channel from a thread of its own, with no trigger.
"""

from __future__ import annotations

import os
import threading

import anyio
import pytest

from asyncrefit import WorkerDiedError, cpu_device
from asyncrefit._core._plan import TensorEntry
from asyncrefit._wire._messages import Done, GetVersion, LoadBucket, VersionReply
from asyncrefit.transport import ShmHandle
from asyncrefit.vllm._channels import RankChannels
from asyncrefit.vllm._wire import BlockingChannel, ControlHello, pack
from asyncrefit.vllm._wire import RankHello as Hello

pytestmark = pytest.mark.timeout(20)


class Rank:
    """One worker's blocking end, served from a thread on each trigger."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.channel: BlockingChannel | None = None
        self.skipped: list[int] = []
        self.got: list[object] = []

        self.control: BlockingChannel | None = None
        self.thread: threading.Thread | None = None
        self.controlled: list[object] = []
        self.hold = threading.Event()  # set: control requests are answered at once
        self.hold.set()

    def connect(self, path: str) -> None:
        self.channel = BlockingChannel(path, timeout=5.0)
        self.channel.send(0, Hello(rank=self.rank, pid=os.getpid()))
        self.control = BlockingChannel(path, timeout=5.0)
        self.control.send(0, ControlHello(rank=self.rank, pid=os.getpid()))
        self.control.wait_forever()
        self.thread = threading.Thread(target=self._serve_control, args=(self.control,))
        self.thread.start()

    def _serve_control(self, control: BlockingChannel) -> None:
        """Answer every control request as it comes (a version: 10 + the rank)."""
        try:
            while True:
                request_id, request = control.receive()
                self.controlled.append(request)
                self.hold.wait(5.0)
                control.send(request_id, VersionReply(version=10 + self.rank))
        except (ConnectionError, OSError):
            pass

    def close(self) -> None:
        for channel in (self.channel, self.control):
            if channel is not None:
                channel.close()
        if self.thread is not None:
            self.thread.join(5.0)
            assert not self.thread.is_alive()

    def serve(self, request_id: int) -> None:
        assert self.channel is not None
        while True:
            got, request = self.channel.receive()
            if got == request_id:
                break
            self.skipped.append(got)
        self.got.append(request)
        if isinstance(request, LoadBucket):
            self.channel.send(request_id, Done())
        else:
            assert isinstance(request, GetVersion)
            self.channel.send(request_id, VersionReply(version=self.rank))


async def test_rank_channels_speak_the_workers_frames() -> None:
    ranks = [Rank(1), Rank(0)]  # connect out of order: matched by greeting
    channels = RankChannels("e", 2, lambda r: f"e/rank-{r}")

    async def start(path: str) -> None:
        for rank in ranks:
            await anyio.to_thread.run_sync(rank.connect, path)

    async def trigger(request_id: int) -> None:
        async with anyio.create_task_group() as tg:
            for rank in ranks:
                tg.start_soon(anyio.to_thread.run_sync, rank.serve, request_id)

    async def never(request_id: int) -> None:
        await anyio.sleep_forever()

    try:
        with anyio.fail_after(10):
            await channels.open(start)
        assert channels.connected
        with anyio.move_on_after(0.1):  # cancelled: its frames stay unread until skipped
            await channels.exchange(dict.fromkeys(range(2), GetVersion()), never, lambda i: (i,))
        replies = await channels.exchange(
            dict.fromkeys(range(2), GetVersion()), trigger, lambda i: (i,)
        )
        assert replies == {0: VersionReply(version=0), 1: VersionReply(version=1)}
        assert [rank.skipped for rank in ranks] == [[1], [1]]
        stats = channels.statistics(0)
        assert stats.frames == 2
        assert stats.bytes == 2 * len(pack(2, GetVersion()))
        assert stats.trigger_bytes > 0
    finally:
        await channels.aclose()
        for rank in ranks:
            rank.close()
    assert channels.dead == "closed" and not channels.connected


async def test_a_rank_that_closes_its_channel_kills_the_channels() -> None:
    rank = Rank(0)
    channels = RankChannels("e", 1, lambda r: f"e/rank-{r}")

    async def start(path: str) -> None:
        await anyio.to_thread.run_sync(rank.connect, path)

    async def hang_up(request_id: int) -> None:
        assert rank.channel is not None
        rank.channel.close()

    try:
        await channels.open(start)
        with pytest.raises(WorkerDiedError, match="rank 0 closed its channel") as info:
            await channels.exchange({0: GetVersion()}, hang_up, lambda i: (i,))
        assert info.value.worker == "e/rank-0"
        with pytest.raises(WorkerDiedError, match="rank 0 closed its channel") as later:
            await channels.exchange({0: GetVersion()}, hang_up, lambda i: (i,))
        assert later.value.worker == "e"
    finally:
        await channels.aclose()
        rank.close()


async def test_a_handle_the_channel_carried_goes_by_reference() -> None:
    """The second load naming the same handle object sends its number, not the handle,
    and the worker's end resolves it to the very object it decoded the first time."""
    rank = Rank(0)
    channels = RankChannels("e", 1, lambda r: f"e/rank-{r}")
    entries = tuple(
        TensorEntry(
            name=f"layers.{i}.weight", offset=64 * i, nbytes=64, shape=(16,), dtype="float32"
        )
        for i in range(8)
    )
    handle = ShmHandle(
        device=cpu_device(0), bucket=0, nbytes=512, entries=entries, segment="asyncrefit-x"
    )

    async def start(path: str) -> None:
        await anyio.to_thread.run_sync(rank.connect, path)

    async def trigger(request_id: int) -> None:
        await anyio.to_thread.run_sync(rank.serve, request_id)

    try:
        await channels.open(start)
        sizes = []
        for bucket in (0, 1):
            load = LoadBucket(version=1, bucket=bucket, handles=(handle,))
            assert await channels.exchange({0: load}, trigger, lambda i: (i,)) == {0: Done()}
            sizes.append(channels.statistics(0).last_load_bytes)
        first, second = rank.got
        assert isinstance(first, LoadBucket) and isinstance(second, LoadBucket)
        assert first.handles == (handle,) and second.handles[0] is first.handles[0]
        assert second.bucket == 1
        assert sizes[1] < sizes[0] and sizes[1] < len(pack(1, load))
    finally:
        await channels.aclose()
        rank.close()


async def test_the_control_channels_are_served_without_a_trigger() -> None:
    """Each rank's control thread answers as frames arrive (no engine RPC); the late
    reply of a cancelled control exchange is dropped; the other channel is untouched."""
    ranks = [Rank(0), Rank(1)]
    channels = RankChannels("e", 2, lambda r: f"e/rank-{r}")

    async def start(path: str) -> None:
        for rank in ranks:
            await anyio.to_thread.run_sync(rank.connect, path)

    try:
        await channels.open(start)
        ranks[1].hold.clear()
        with anyio.move_on_after(0.2):  # rank 1 answers only after the cancellation
            await channels.control(dict.fromkeys(range(2), GetVersion()))
        ranks[1].hold.set()
        replies = await channels.control(dict.fromkeys(range(2), GetVersion()))
        assert replies == {0: VersionReply(version=10), 1: VersionReply(version=11)}
        assert [len(rank.controlled) for rank in ranks] == [2, 2]
        assert [rank.got for rank in ranks] == [[], []]  # nothing on the other channel
    finally:
        await channels.aclose()
        for rank in ranks:
            rank.close()


async def test_a_rank_that_closes_its_control_channel_kills_the_channels() -> None:
    rank = Rank(0)
    channels = RankChannels("e", 1, lambda r: f"e/rank-{r}")

    async def start(path: str) -> None:
        await anyio.to_thread.run_sync(rank.connect, path)

    try:
        await channels.open(start)
        assert rank.control is not None
        rank.control.close()  # its thread ends
        with pytest.raises(WorkerDiedError, match="rank 0") as info:
            await channels.control({0: GetVersion()})
        assert info.value.worker == "e/rank-0"
        assert not channels.connected
    finally:
        await channels.aclose()
        rank.close()
