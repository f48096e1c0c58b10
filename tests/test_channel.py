"""The framed channel: whole frames, cancel-safe reads, bounded sends, clean close."""

from __future__ import annotations

import socket

import anyio
import pytest

from asyncrefit._wire._channel import FrameChannel, frame

pytestmark = pytest.mark.timeout(20)


def pair() -> tuple[FrameChannel, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return FrameChannel(a), b


async def test_a_frame_split_across_reads_and_a_cancel_arrives_whole() -> None:
    channel, peer = pair()
    try:
        data = frame(b"x" * 1000) + frame(b"second")
        peer.sendall(data[:5])
        with anyio.move_on_after(0.05) as scope:
            await channel.receive()  # only part of the header is there
        assert scope.cancelled_caught
        peer.sendall(data[5:600])
        with anyio.move_on_after(0.05):
            await channel.receive()  # part of the payload
        peer.sendall(data[600:])
        assert await channel.receive() == b"x" * 1000
        assert await channel.receive() == b"second"
    finally:
        await channel.aclose()
        peer.close()


async def test_send_delivers_one_frame_even_when_cancelled() -> None:
    channel, peer = pair()
    try:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await channel.send(b"payload", within=5)
        peer.setblocking(True)
        assert peer.recv(100) == frame(b"payload")
    finally:
        await channel.aclose()
        peer.close()


async def test_a_send_the_peer_never_reads_times_out_and_closes_the_channel() -> None:
    channel, peer = pair()
    try:
        with pytest.raises(TimeoutError):
            await channel.send(b"z" * (64 << 20), within=0.2)
        assert channel.closed
    finally:
        await channel.aclose()
        peer.close()


async def test_peer_close_is_end_of_stream_and_aclose_wakes_a_reader() -> None:
    channel, peer = pair()
    peer.close()
    with pytest.raises(anyio.EndOfStream):
        await channel.receive()
    await channel.aclose()

    channel, peer = pair()
    errors: list[BaseException] = []

    async def reader() -> None:
        try:
            await channel.receive()
        except anyio.ClosedResourceError as exc:
            errors.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.sleep(0.05)
            await channel.aclose()
        assert len(errors) == 1
    finally:
        peer.close()
