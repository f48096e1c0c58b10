"""The wire stack's shared pieces: the one error map, the one serve loop, the rank on them."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from asyncrefit import (
    IntegrityError,
    SourceDiedError,
    SourceRemoteError,
    SourceTimeoutError,
    WorkerIntegrityError,
    WorkerProtocolError,
    WorkerRemoteError,
    WorkerStaleWeightsError,
)
from asyncrefit._exceptions import StaleWeightsError
from asyncrefit._wire._channel import FrameChannel
from asyncrefit._wire._errors import (
    SOURCE,
    WORKER,
    ExceptionMapping,
    Lost,
    RemoteFailure,
    error_reply,
    map_exceptions,
    map_wire,
    protocol_reply,
    raise_for_error,
    raised_errors,
)
from asyncrefit._wire._messages import Done, ErrorReply, Shutdown, decode, encode
from asyncrefit._wire._mux import ChannelFailedError, RequestChannel
from asyncrefit._wire._refs import RefDecoder
from asyncrefit._wire._serve import Served, serve
from asyncrefit.trainer import RankServer, RankSource

pytestmark = pytest.mark.timeout(30)


# --- the error map ------------------------------------------------------------------------


def test_an_error_reply_carries_its_kind_as_data_and_compares_by_type_and_message() -> None:
    reply = error_reply(IntegrityError(3, 1, 2))
    assert reply.kind == "integrity"
    assert reply == ErrorReply(type="IntegrityError", message=str(IntegrityError(3, 1, 2)))
    assert error_reply(StaleWeightsError("l", "r")).kind == "stale_weights"
    assert error_reply(ValueError("x")).kind == "error"
    assert decode(encode(reply)).kind == "integrity"


def test_the_worker_side_picks_the_typed_error_by_kind_and_by_name_without_one() -> None:
    integrity = WORKER.from_reply("w", error_reply(IntegrityError(0, 1, 2)))
    assert type(integrity) is WorkerIntegrityError
    stale = WORKER.from_reply("w", error_reply(StaleWeightsError("l", "r")))
    assert type(stale) is WorkerStaleWeightsError
    # a kind the type's name alone would not give
    renamed = WORKER.from_reply("w", ErrorReply(type="X", message="m", kind="integrity"))
    assert type(renamed) is WorkerIntegrityError
    # a peer that sends the type's name only
    protocol = WORKER.from_reply("w", ErrorReply(type="ProtocolError", message="m"))
    assert type(protocol) is WorkerProtocolError and str(protocol) == "worker 'w': ProtocolError: m"
    plain = WORKER.from_reply("w", error_reply(ValueError("bad")))
    assert type(plain) is WorkerRemoteError and str(plain) == "worker 'w': ValueError: bad"
    source = SOURCE.from_reply("s", error_reply(IntegrityError(0, 1, 2)))
    assert type(source) is SourceRemoteError and source.remote_type == "IntegrityError"


def test_map_exceptions_takes_the_first_match_chains_it_and_lets_others_pass() -> None:
    mapping: ExceptionMapping = {
        KeyError: lambda exc: SourceDiedError("s", "key"),
        LookupError: lambda exc: SourceTimeoutError("s", "lookup"),
    }
    with pytest.raises(SourceDiedError) as info, map_exceptions(mapping):
        raise KeyError("k")
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(SourceTimeoutError), map_exceptions(mapping):
        raise IndexError("i")
    with pytest.raises(ValueError), map_exceptions(mapping):
        raise ValueError("v")


@pytest.mark.parametrize(
    ("failure", "how", "error"),
    [
        (ChannelFailedError(TimeoutError()), Lost.TIMEOUT, SourceTimeoutError),
        (TimeoutError(), Lost.TIMEOUT, SourceTimeoutError),
        (ChannelFailedError(anyio.EndOfStream()), Lost.DIED, SourceDiedError),
        (anyio.BrokenResourceError(), Lost.DIED, SourceDiedError),
    ],
)
async def test_map_wire_releases_a_lost_peer_before_its_typed_error(
    failure: BaseException, how: Lost, error: type[Exception]
) -> None:
    seen: list[Lost] = []

    async def lost(got: Lost, exc: BaseException) -> tuple[Lost, str]:
        seen.append(got)
        await anyio.lowlevel.checkpoint()
        return got, "gone for good"

    with pytest.raises(error, match="gone for good") as info:
        async with map_wire(SOURCE, "s", lost):
            raise failure
    assert seen == [how] and info.value.__cause__ is None
    with pytest.raises(SourceRemoteError, match="ValueError: no"):
        async with map_wire(SOURCE, lambda: "s", lost):
            raise_for_error(error_reply(ValueError("no")))
    with pytest.raises(RemoteFailure):
        raise_for_error(ErrorReply(type="T", message="m"))
    assert raise_for_error(Done()) == Done()


def test_raised_errors_pass_typed_and_named_ones_and_map_others_by_kind() -> None:
    mapping = raised_errors(WORKER, "w", passing=(TimeoutError,))
    typed = WorkerProtocolError("x", "m")
    with pytest.raises(WorkerProtocolError) as info, map_exceptions(mapping):
        raise typed
    assert info.value is typed
    with pytest.raises(TimeoutError), map_exceptions(mapping):
        raise TimeoutError
    with pytest.raises(WorkerIntegrityError) as integrity, map_exceptions(mapping):
        raise IntegrityError(1, 2, 3)
    assert isinstance(integrity.value.__cause__, IntegrityError)
    with pytest.raises(WorkerRemoteError, match=r"'w': ValueError: bad"), map_exceptions(mapping):
        raise ValueError("bad")
    protocol = WORKER.from_reply("w", protocol_reply("m"))
    assert type(protocol) is WorkerProtocolError


# --- the serve loop -----------------------------------------------------------------------


async def test_the_serve_loop_answers_in_order_until_told_and_reports_a_lost_peer() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    requests = RequestChannel(FrameChannel(a), send_timeout=5)
    channel = FrameChannel(b)
    handled: list[Any] = []

    async def handle(request: Any) -> Any:
        handled.append(request)
        return Done()

    results: list[Any] = []

    async def peer() -> None:
        results.append(
            await serve(
                channel,
                RefDecoder(),
                handle,
                until=lambda r: isinstance(r, Shutdown),
                send_timeout=5,
            )
        )
        results.append(
            await serve(channel, RefDecoder(), handle, until=lambda r: False, send_timeout=5)
        )

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer)
            replies: list[Any] = [None, None]

            async def ask(i: int, request: Any) -> None:
                replies[i] = await requests.request(request)

            async with anyio.create_task_group() as inner:
                inner.start_soon(ask, 0, Done())
                await anyio.sleep(0.01)
                inner.start_soon(ask, 1, Shutdown())
            assert replies == [Done(), Done()]
            await requests.aclose()
    finally:
        await channel.aclose()
    assert results == [(Shutdown(),), None]
    assert handled == [Done(), Shutdown()]


async def test_the_serve_loop_can_answer_an_unpicklable_reply_and_count() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    requests = RequestChannel(FrameChannel(a), send_timeout=5)
    channel = FrameChannel(b)
    served = Served()

    async def handle(request: Any) -> Any:
        return (lambda: None) if isinstance(request, Shutdown) else Done()

    async def peer() -> None:
        await serve(
            channel,
            RefDecoder(),
            handle,
            until=lambda r: False,
            send_timeout=5,
            encode_failures=True,
            served=served,
        )

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer)
            assert await requests.request(Done()) == Done()
            reply = await requests.request(Shutdown())
            assert isinstance(reply, ErrorReply) and reply.kind == "error"
            await requests.aclose()
    finally:
        await channel.aclose()
    assert served.requests == 2


# --- a rank on the shared stack ------------------------------------------------------------


class _SlowSource:
    """A trainer source whose exports take a while, counting how many overlap."""

    name = "slow"

    def __init__(self) -> None:
        self.running = 0
        self.most = 0

    async def describe(self) -> Any:
        raise ValueError("nothing to describe")

    async def export(self, bucket: Any, slot: int, devices: Sequence[Any]) -> tuple[Any, ...]:
        self.running += 1
        self.most = max(self.most, self.running)
        await anyio.sleep(0.02)
        self.running -= 1
        return (slot,)

    async def aclose(self) -> None:
        await anyio.lowlevel.checkpoint()


async def test_a_rank_source_overlaps_requests_the_rank_answers_in_order() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank.sock")
        source = _SlowSource()
        server = RankServer(source, path)  # type: ignore[arg-type]
        client = RankSource(path, timeout=10)
        pushes: list[Any] = []
        try:
            async with anyio.create_task_group() as tg:

                async def rank() -> None:
                    pushes.append(await server.serve_push())

                tg.start_soon(rank)
                got: dict[int, Any] = {}

                async def export(slot: int) -> None:
                    got[slot] = await client.export(None, slot, ())  # type: ignore[arg-type]

                async with anyio.create_task_group() as inner:
                    for slot in range(4):
                        inner.start_soon(export, slot)
                assert got == {slot: (slot,) for slot in range(4)}
                assert source.most == 1  # served one at a time
                assert client.name == "slow"  # from the greeting
                with pytest.raises(SourceRemoteError, match="ValueError: nothing to describe"):
                    await client.describe()
                await client.end_push(7, True)
        finally:
            await client.aclose()
            await server.aclose()
    assert pushes[0].version == 7 and pushes[0].ok and not pushes[0].closed
