"""Many requests in flight over one channel: pipelined sends, replies by id, handoffs."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest

from asyncrefit._wire._channel import FrameChannel
from asyncrefit._wire._messages import decode, encode
from asyncrefit._wire._mux import ChannelFailedError, RequestChannel

pytestmark = pytest.mark.timeout(20)


class Peer:
    """The other end, driven by the test: reads requests, answers when told."""

    def __init__(self, channel: FrameChannel) -> None:
        self.channel = channel

    async def read(self) -> tuple[int, Any]:
        request_id, request = decode(await self.channel.receive())
        return request_id, request

    async def answer(self, request_id: int, reply: Any) -> None:
        await self.channel.send(encode((request_id, reply)), within=5)


def pair() -> tuple[RequestChannel, Peer]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return RequestChannel(FrameChannel(a), send_timeout=5), Peer(FrameChannel(b))


async def test_later_requests_go_out_before_earlier_ones_are_answered() -> None:
    requests, peer = pair()
    got: dict[str, Any] = {}
    try:
        async with anyio.create_task_group() as tg:

            async def call(what: str) -> None:
                got[what] = await requests.request(what)

            tg.start_soon(call, "first")
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(call, "second")
            # Both requests reach the peer before it answers either: no round trip
            # between them.
            (id1, r1), (id2, r2) = await peer.read(), await peer.read()
            assert (r1, r2) == ("first", "second")
            await peer.answer(id2, "answer to second")  # out of order, matched by id
            await peer.answer(id1, "answer to first")
        assert got == {"first": "answer to first", "second": "answer to second"}
    finally:
        await requests.aclose()
        await peer.channel.aclose()


async def test_a_reader_cancelled_hands_reading_to_the_next_caller() -> None:
    requests, peer = pair()
    got: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            first = anyio.CancelScope()

            async def cancelled() -> None:
                with first:
                    await requests.request("dropped")

            tg.start_soon(cancelled)
            await anyio.wait_all_tasks_blocked()  # the first caller reads now

            async def second() -> None:
                got.append(await requests.request("kept"))

            tg.start_soon(second)
            id1, _ = await peer.read()
            id2, _ = await peer.read()
            first.cancel()  # the reader goes; the second caller must take over
            await anyio.wait_all_tasks_blocked()
            await peer.answer(id1, "late reply, dropped")
            await peer.answer(id2, "reply")
        assert got == ["reply"]
        # The channel still works after the dropped reply.
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: requests.request("third"))
            id3, _ = await peer.read()
            await peer.answer(id3, "third reply")
    finally:
        await requests.aclose()
        await peer.channel.aclose()


async def test_a_closed_peer_fails_every_waiting_and_later_call() -> None:
    requests, peer = pair()
    errors: list[BaseException] = []
    try:
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                try:
                    await requests.request("x")
                except ChannelFailedError as exc:
                    errors.append(exc)

            for _ in range(3):
                tg.start_soon(call)
            for _ in range(3):
                await peer.read()
            await peer.channel.aclose()
        assert len(errors) == 3
        assert isinstance(requests.failed, anyio.EndOfStream)
        with pytest.raises(ChannelFailedError):
            await requests.request("after")
    finally:
        await requests.aclose()
