"""The request path's fast ways: the compact codec of a push's messages, and the
multiplexer that makes a wake-up event only for a caller that has to sleep."""

from __future__ import annotations

import pickle
import random
import socket
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrefit._wire._channel import FrameChannel
from asyncrefit._wire._messages import (
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    Done,
    ErrorReply,
    GetVersion,
    LoadBucket,
    VersionReply,
    decode,
    encode,
)
from asyncrefit._wire._mux import ChannelFailedError, RequestChannel

pytestmark = pytest.mark.timeout(30)

# --- the codec ---------------------------------------------------------------------------

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
ANY_INT = st.one_of(INT64, st.integers(min_value=-(2**80), max_value=2**80))
ACK_SECONDS = st.one_of(st.floats(allow_nan=False), st.integers(min_value=0, max_value=10))

MESSAGES = st.one_of(
    st.builds(Done),
    st.builds(GetVersion),
    st.builds(BeginUpdate, version=ANY_INT, direct=st.one_of(st.booleans(), st.integers(0, 1))),
    st.builds(CommitUpdate, version=ANY_INT, buckets=ANY_INT),
    st.builds(AbortUpdate, version=ANY_INT, unwritten=st.one_of(st.booleans(), st.integers(0, 1))),
    st.builds(VersionReply, version=st.one_of(st.none(), ANY_INT)),
    st.builds(BucketAck, bucket=ANY_INT, nbytes=ANY_INT, seconds=ACK_SECONDS, copied=st.binary()),
)


def same(a: object, b: object) -> bool:
    """Equal, of the same type, and so every field (``True`` is not ``1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        assert isinstance(b, tuple)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    fields = getattr(type(a), "__dataclass_fields__", None)
    if fields is None:
        return a == b
    return all(same(getattr(a, name), getattr(b, name)) for name in fields)


@given(request_id=ANY_INT, message=MESSAGES)
def test_every_message_a_push_sends_comes_back_as_it_went(request_id: int, message: Any) -> None:
    assert same(decode(encode((request_id, message))), (request_id, message))


def test_a_push_message_goes_compact_and_anything_else_as_a_pickle() -> None:
    compact = encode((5, BeginUpdate(version=3, direct=True)))
    assert compact[0] != 0x80 and len(compact) < 20
    assert len(encode((5, Done()))) < 10
    assert encode((5, BucketAck(bucket=0, nbytes=1, seconds=0.5, copied=b"t"))).endswith(b"t")
    # Not compact: a field beyond 64 bits, a field of another type, another message,
    # a request id that is not an int, a message on its own.
    for other in (
        (5, BeginUpdate(version=1 << 64)),
        (5, BucketAck(bucket=0, nbytes=1, seconds=1)),
        (5, ErrorReply(type="ValueError", message="x")),
        (5, LoadBucket(version=1, bucket=0, handles=())),
        ("5", Done()),
        (5, Done(), 6),
        Done(),
        "text",
    ):
        data = encode(other)
        assert data[0] == 0x80
        assert same(decode(data), other)


def test_a_malformed_compact_frame_raises_an_unpickling_error() -> None:
    good = encode((5, CommitUpdate(version=3, buckets=8)))
    for bad in (good[:-1], good + b"\x00", good[:1]):
        with pytest.raises(pickle.UnpicklingError):
            decode(bad)
    with pytest.raises(pickle.UnpicklingError):
        decode(b"\x7f not a frame")
    with pytest.raises(EOFError):
        decode(b"")


# --- the multiplexer ---------------------------------------------------------------------


class Peer:
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


def idle(requests: RequestChannel) -> bool:
    """Nothing left behind: no caller, no stored reply, no reader."""
    return not requests._waiting and not requests._replies and not requests._reading


async def test_requests_one_at_a_time_make_no_wake_up_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests, peer = pair()
    made: list[anyio.Event] = []
    event = anyio.Event

    def counted() -> anyio.Event:
        made.append(event())
        return made[-1]

    try:
        async with anyio.create_task_group() as tg:

            async def echo() -> None:
                while True:
                    request_id, request = await peer.read()
                    await peer.answer(request_id, ("answer", request))

            tg.start_soon(echo)
            monkeypatch.setattr(anyio, "Event", counted)
            for i in range(20):
                assert await requests.request(i) == ("answer", i)
            monkeypatch.undo()
            tg.cancel_scope.cancel()
        assert made == []
        assert idle(requests)
    finally:
        await requests.aclose()
        await peer.channel.aclose()


async def test_a_caller_woken_to_read_and_cancelled_before_it_ran_hands_reading_on() -> None:
    requests, peer = pair()
    got: dict[str, Any] = {}
    try:
        async with anyio.create_task_group() as tg:
            second = anyio.CancelScope()
            first_done = anyio.Event()

            async def first() -> None:
                got["first"] = await requests.request("first")
                # The first caller handed reading to the second, which has not run yet:
                # cancelled now, it must hand reading to the third on its way out.
                second.cancel()
                first_done.set()

            async def call_second() -> None:
                with second:
                    got["second"] = await requests.request("second")

            async def third() -> None:
                got["third"] = await requests.request("third")

            for call in (first, call_second, third):
                tg.start_soon(call)
                await anyio.wait_all_tasks_blocked()
            ids = [(await peer.read())[0] for _ in range(3)]
            await peer.answer(ids[0], "to first")
            await first_done.wait()
            await peer.answer(ids[1], "to second, dropped")
            await peer.answer(ids[2], "to third")
        assert got == {"first": "to first", "third": "to third"}
        assert idle(requests)
    finally:
        await requests.aclose()
        await peer.channel.aclose()


async def test_replies_in_any_order_with_callers_cancelled_anywhere_reach_their_callers() -> None:
    requests, peer = pair()
    rng = random.Random(20261207)
    got: dict[int, Any] = {}
    scopes: list[anyio.CancelScope] = []
    inbox: list[tuple[int, Any]] = []
    try:
        async with anyio.create_task_group() as peer_tasks:

            async def read() -> None:
                while True:
                    inbox.append(await peer.read())

            async def answer() -> None:
                while True:
                    await anyio.lowlevel.checkpoint()
                    if inbox and rng.random() < 0.4:
                        request_id, (_, i) = inbox.pop(rng.randrange(len(inbox)))
                        await peer.answer(request_id, ("answer", i))

            peer_tasks.start_soon(read)
            peer_tasks.start_soon(answer)

            async with anyio.create_task_group() as callers:

                async def call(i: int) -> None:
                    with scopes[i]:
                        got[i] = await requests.request(("request", i))

                for i in range(300):
                    scopes.append(anyio.CancelScope())
                    callers.start_soon(call, i)
                    for _ in range(rng.randrange(3)):
                        await anyio.lowlevel.checkpoint()
                    if rng.random() < 0.3:
                        scopes[rng.randrange(i + 1)].cancel()
            peer_tasks.cancel_scope.cancel()
        assert all(reply == ("answer", i) for i, reply in got.items())
        assert all(i in got for i, scope in enumerate(scopes) if not scope.cancel_called)
        assert len(got) > 100
        assert idle(requests)
        # Still usable: the late replies to cancelled callers were dropped.
        async with anyio.create_task_group() as tg:
            tg.start_soon(requests.request, "again")
            request_id, _ = await peer.read()
            await peer.answer(request_id, "again answered")
        assert idle(requests)
    finally:
        await requests.aclose()
        await peer.channel.aclose()


async def test_a_peer_gone_wakes_the_reader_and_every_sleeping_caller() -> None:
    requests, peer = pair()
    errors: list[ChannelFailedError] = []
    try:
        async with anyio.create_task_group() as tg:

            async def call(i: int) -> None:
                try:
                    await requests.request(i)
                except ChannelFailedError as exc:
                    errors.append(exc)

            for i in range(4):
                tg.start_soon(call, i)
            for _ in range(4):
                await peer.read()
            await anyio.wait_all_tasks_blocked()
            assert sum(e is not None for e in requests._waiting.values()) == 3  # asleep
            await peer.channel.aclose()
        assert len(errors) == 4
        assert all(isinstance(e.cause, anyio.EndOfStream) for e in errors)
        assert idle(requests)
    finally:
        await requests.aclose()
