"""One framed channel per rank of a vLLM engine, and the exchanges over them.

Owns the coordinator's end of every rank's connection (see :mod:`._wire` for the
worker's end): the Unix socket the ranks connect to, matching each connection to its
rank by its greeting (a :class:`~asyncrefit._wire._messages.Hello` of role
``"vllm-rank"``), and :meth:`RankChannels.exchange`, which writes each rank's
request on that rank's channel, sends the engine one trigger RPC carrying only the
request id, and gathers each rank's reply from its channel; and
:meth:`RankChannels.control`, the same over each rank's control channel (greeted
``"vllm-control"``), which a thread of the worker serves with no trigger. It also counts what each
channel carried (:class:`ChannelStatistics`).

The channels are :class:`asyncrefit._wire._channel.FrameChannel`\\ s: they wait with
:func:`anyio.wait_readable` / :func:`anyio.wait_writable` and do the non-blocking reads
and writes themselves, so cancelling a read is safe on uvloop (which vLLM's
``AsyncLLM`` runs on). Their frames are the worker's (:mod:`._wire`): an 8-byte length, then
``(request id, message)`` in the one codec (:mod:`asyncrefit._wire._messages`), a
load's handles by reference (a :class:`~asyncrefit._wire._refs.RefEncoder` per rank).

Resources: :meth:`RankChannels.open` creates a private directory holding the socket,
listens only until every rank connected, and closes the listener on every path;
:meth:`RankChannels.aclose` closes every channel and removes the directory.

Errors and cancellation: one exchange at a time, so frames stay in order. A frame is
sent whole even when the caller is cancelled (shielded, bounded by a send timeout); a
channel that broke or whose send timed out marks the link dead
(:class:`~asyncrefit.WorkerDiedError` / :class:`~asyncrefit.WorkerTimeoutError` naming
the rank, through the WORKER side of the one error map, :mod:`asyncrefit._wire._errors`,
and every later exchange raises :class:`~asyncrefit.WorkerDiedError`). A read cancelled
half-way loses nothing; the late reply of a cancelled exchange is recognised by its
request id and dropped. The trigger's and the reads' failures come back as the
primary error of their task group.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from .._exceptions import (
    WorkerDiedError,
    WorkerRemoteError,
    primary_error,
)
from .._wire._channel import HEADER, FrameChannel, UnixListener
from .._wire._errors import WORKER, ExceptionMapping, map_exceptions
from .._wire._messages import Hello, LoadBucket, Reply, encode
from .._wire._refs import RefEncoder
from ._wire import RankRequest, unpack

_SEND_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelStatistics:
    """What one vLLM worker received through its asyncrefit channel, in bytes as sent.

    ``load_bytes`` and ``last_load_bytes`` count the frames carrying buckets (all of
    them, and the last one): the bytes of handles a worker receives, framing included.
    A handle the channel carried before goes by its number (see
    :mod:`asyncrefit._wire._refs`), so a push whose slots are unchanged sends a few
    dozen bytes per bucket; the report's ``handle_bytes_per_worker`` counts every
    handle in full.
    ``trigger_bytes`` is the pickled size of the arguments of the last RPC that told
    the worker to read its channel; vLLM sends the same trigger to every worker.
    """

    frames: int
    bytes: int
    load_frames: int
    load_bytes: int
    last_load_bytes: int
    trigger_bytes: int


@dataclass(slots=True)
class _Tally:
    frames: int = 0
    bytes: int = 0
    load_frames: int = 0
    load_bytes: int = 0
    last_load_bytes: int = 0
    trigger_bytes: int = 0

    def freeze(self) -> ChannelStatistics:
        return ChannelStatistics(
            frames=self.frames,
            bytes=self.bytes,
            load_frames=self.load_frames,
            load_bytes=self.load_bytes,
            last_load_bytes=self.last_load_bytes,
            trigger_bytes=self.trigger_bytes,
        )


class RankChannels:
    """The channels to every rank of one engine named ``name``.

    ``worker_name(rank)`` names a rank in errors; the engine's own failures (a rank
    whose channel is dead, a bad greeting) name ``name``.
    """

    def __init__(self, name: str, world: int, worker_name: Callable[[int], str]) -> None:
        self.name = name
        self.world = world
        self._worker_name = worker_name
        self._channels: dict[int, FrameChannel] = {}
        # Per rank, the table of handles its channel carried (see _wire._refs).
        self._refs: dict[int, RefEncoder] = {}
        # Per rank, its control channel (served by a thread of the worker, no trigger).
        self._control: dict[int, FrameChannel] = {}
        self._control_refs: dict[int, RefEncoder] = {}
        self._tally = [_Tally() for _ in range(world)]
        self._lock = anyio.Lock()  # one exchange at a time: frames stay in order
        self._control_lock = anyio.Lock()
        self._next_id = 0
        self._next_control_id = 0
        self._dir: str | None = None
        #: Why the channels cannot be used any more (``None`` while they can).
        self.dead: str | None = None

    @property
    def connected(self) -> bool:
        """Every rank connected, and no channel failed."""
        return (
            self.dead is None
            and len(self._channels) == self.world
            and len(self._control) == self.world
        )

    def statistics(self, rank: int) -> ChannelStatistics:
        return self._tally[rank].freeze()

    # --- lifecycle ----------------------------------------------------------------

    async def open(self, start: Callable[[str], Coroutine[Any, Any, None]]) -> None:
        """Listen on a fresh socket, call ``start(path)`` (which has every rank connect
        to it twice: its channel and its control channel) meanwhile, and match the
        connections to ranks.

        The caller bounds it; ``start``'s failures and a bad greeting come back as the
        task group's (an ``ExceptionGroup``).
        """
        self._dir = tempfile.mkdtemp(prefix="asyncrefit-vllm-")
        path = os.path.join(self._dir, "channel.sock")
        listener = UnixListener(path)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(start, path)
                for _ in range(2 * self.world):
                    await self._accept(await listener.accept())
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _accept(self, channel: FrameChannel) -> None:
        try:
            _, hello = unpack(await channel.receive())
        except BaseException:
            with anyio.CancelScope(shield=True):
                await channel.aclose()
            raise
        if (
            not isinstance(hello, Hello)
            or hello.role not in ("vllm-rank", "vllm-control")
            or not 0 <= hello.rank < self.world
        ):
            await channel.aclose()
            raise WorkerRemoteError(self.name, "ProtocolError", f"unexpected greeting {hello!r}")
        control = hello.role == "vllm-control"
        table = self._control if control else self._channels
        if hello.rank in table:
            await channel.aclose()
            raise WorkerRemoteError(self.name, "ProtocolError", f"rank {hello.rank} twice")
        table[hello.rank] = channel
        (self._control_refs if control else self._refs)[hello.rank] = RefEncoder()

    async def aclose(self) -> None:
        """Close every channel and remove the socket's directory; idempotent."""
        with anyio.CancelScope(shield=True):
            for channel in (*self._channels.values(), *self._control.values()):
                await channel.aclose()
            self._channels.clear()
            self._control.clear()
            self._refs.clear()
            self._control_refs.clear()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
            if self.dead is None:
                self.dead = "closed"

    # --- one exchange: frames on every rank's channel, one trigger ------------------

    def _lost(
        self, rank: int, error: Callable[[str, str], Exception], why: str
    ) -> Callable[[BaseException], Exception]:
        """The translation of a failure of ``rank``'s channel: it marks the channels dead
        (``why``) and names the rank."""

        def lost(exc: BaseException) -> Exception:
            self.dead = why
            return error(self._worker_name(rank), why)

        return lost

    async def _send(
        self, rank: int, request_id: int, request: RankRequest, control: bool = False
    ) -> None:
        # Encoded with no await before the send starts (a frame the table counted is
        # a frame on the wire; a channel that fails mid-frame is never used again).
        refs = self._control_refs if control else self._refs
        payload = refs[rank].encode(request_id, request)
        channel = (self._control if control else self._channels)[rank]
        # A frame cut in half would corrupt the channel: the channel finishes sending it
        # even when cancelled (frames are small), but not forever.
        broke = self._lost(rank, WORKER.died, f"rank {rank}'s channel broke")
        with map_exceptions(
            {
                TimeoutError: self._lost(rank, WORKER.timeout, f"sending to rank {rank} timed out"),
                anyio.BrokenResourceError: broke,
                anyio.ClosedResourceError: broke,
                OSError: broke,
            },
            chain=False,
        ):
            await channel.send(payload, within=_SEND_TIMEOUT)
        size = HEADER + len(payload)  # as sent: the length prefix included
        tally = self._tally[rank]
        tally.frames += 1
        tally.bytes += size
        if isinstance(request, LoadBucket):
            tally.load_frames += 1
            tally.load_bytes += size
            tally.last_load_bytes = size

    async def _receive(
        self, rank: int, request_id: int, replies: dict[int, Reply], control: bool = False
    ) -> None:
        channel = (self._control if control else self._channels)[rank]
        closed = self._lost(rank, WORKER.died, f"rank {rank} closed its channel")
        lost: ExceptionMapping = {
            anyio.EndOfStream: closed,
            anyio.BrokenResourceError: closed,
            anyio.ClosedResourceError: closed,
        }
        while True:
            with map_exceptions(lost, chain=False):
                payload = await channel.receive()
            got, reply = unpack(payload)
            if got == request_id:
                replies[rank] = reply
                return
            if got > request_id:
                raise WorkerRemoteError(
                    self._worker_name(rank), "ProtocolError", f"reply {got} before {request_id}"
                )
            # else: the late reply to a request whose caller was cancelled: drop it

    async def exchange(
        self,
        requests: Mapping[int, RankRequest],
        trigger: Callable[[int], Coroutine[Any, Any, None]],
        carried: Callable[[int], object],
    ) -> dict[int, Reply]:
        """Write each rank's request on its channel, ``trigger(request_id)`` them all,
        gather the replies.

        ``carried(request_id)`` is what vLLM carries to every worker for the trigger
        (counted as ``trigger_bytes``).
        """
        async with self._lock:
            self._next_id += 1
            request_id = self._next_id
            return await self._exchange(requests, request_id, False, trigger, carried)

    async def control(self, requests: Mapping[int, RankRequest]) -> dict[int, Reply]:
        """Write each rank's request on its control channel and gather the replies:
        no engine RPC (a thread of each worker serves its control channel).

        Failures as :meth:`exchange`'s: a channel that broke marks the channels dead,
        naming the rank. The caller bounds the wait.
        """
        async with self._control_lock:
            self._next_control_id += 1
            request_id = self._next_control_id
            return await self._exchange(requests, request_id, True)

    async def _exchange(
        self,
        requests: Mapping[int, RankRequest],
        request_id: int,
        control: bool,
        trigger: Callable[[int], Coroutine[Any, Any, None]] | None = None,
        carried: Callable[[int], object] | None = None,
    ) -> dict[int, Reply]:
        """One exchange under its channels' lock: the frames, the trigger if any, the
        replies; a failure raised as the task group's primary error."""
        if self.dead is not None:
            raise WorkerDiedError(self.name, self.dead)
        for rank, request in requests.items():
            await self._send(rank, request_id, request, control)
        if carried is not None:
            trigger_bytes = len(encode(carried(request_id)))
            for tally in self._tally:
                tally.trigger_bytes = trigger_bytes
        replies: dict[int, Reply] = {}
        try:
            async with anyio.create_task_group() as tg:
                if trigger is not None:
                    tg.start_soon(trigger, request_id)
                for rank in requests:
                    tg.start_soon(self._receive, rank, request_id, replies, control)
        except BaseExceptionGroup as group:
            primary = primary_error(group)
            if primary is None:
                raise
            raise primary from None
        return replies
