"""Handles by reference on a connection: both tables stay in step, stay bounded, and
the worker gets back the very objects it decoded first."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrefit import LocalTrainer, RefitCoordinator, WorkerRemoteError, cpu_device
from asyncrefit._core._plan import TensorEntry
from asyncrefit._wire._messages import BeginUpdate, GetVersion, LoadBucket, decode, encode
from asyncrefit._wire._refs import RefDecoder, RefEncoder, UnknownHandleError
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import spawn_local_workers
from asyncrefit.transport.shm import ShmHandle

from .models import make_mlp

pytestmark = pytest.mark.timeout(120)

DEVICE = cpu_device(0)


def shm(bucket: int, segment: str, checksum: int | None = None) -> ShmHandle:
    entries = (TensorEntry(name=f"p{bucket}", offset=0, nbytes=64, shape=(16,), dtype="float32"),)
    return ShmHandle(
        device=DEVICE, bucket=bucket, nbytes=64, entries=entries, segment=segment, checksum=checksum
    )


def through(encoder: RefEncoder, decoder: RefDecoder, request_id: int, request: object) -> object:
    """``request`` as the peer gets it: encoded, over the wire (bytes), decoded."""
    got_id, got = decoder.decode(encoder.encode(request_id, request))
    assert got_id == request_id
    return got


def test_a_handle_goes_in_full_once_then_by_number() -> None:
    encoder, decoder = RefEncoder(), RefDecoder()
    handle = shm(0, "seg-0")
    first = LoadBucket(version=1, bucket=0, handles=(handle,))
    data = encoder.encode(1, first)
    assert decode(data) == (1, 1, 0, (0,), (handle,))  # in full, as number 0
    got_id, got = decoder.decode(data)
    assert got_id == 1 and got == first and got.handles[0] is not handle  # a decoded copy
    again = LoadBucket(version=2, bucket=0, handles=(handle,))
    data = encoder.encode(2, again)
    assert decode(data) == (2, 2, 0, (0,), ())  # by number only
    assert len(data) < 40 < 250 < len(encode((2, again)))  # a few bytes, not the handle
    _, got2 = decoder.decode(data)
    assert got2 == again and got2.handles[0] is got.handles[0]  # the same object
    # An equal handle that is another object goes in full again (identity, not value).
    twin = shm(0, "seg-0")
    assert decode(encoder.encode(3, LoadBucket(version=2, bucket=0, handles=(twin,)))) == (
        3,
        2,
        0,
        (1,),
        (twin,),
    )


def test_a_request_that_fails_to_encode_changes_no_table() -> None:
    encoder = RefEncoder()

    class Unpicklable(ShmHandle):
        def __reduce__(self) -> tuple[Any, ...]:
            raise pickle.PicklingError("no")

    bad = Unpicklable(device=DEVICE, bucket=0, nbytes=64, entries=(), segment="s")
    with pytest.raises(pickle.PicklingError):
        encoder.encode(1, LoadBucket(version=1, bucket=0, handles=(bad,)))
    assert len(encoder) == 0
    decoder = RefDecoder()
    handle = shm(0, "s")
    got = through(encoder, decoder, 2, LoadBucket(version=1, bucket=0, handles=(handle,)))
    assert isinstance(got, LoadBucket) and got.handles == (handle,)


def test_an_unknown_number_is_a_lookup_error_naming_it() -> None:
    with pytest.raises(UnknownHandleError, match="bucket 3 of version 7 names handle 5") as caught:
        RefDecoder().decode(encode((11, 7, 3, (5,), ())))
    assert caught.value.request_id == 11


# One push: which of a pool of handles each bucket's load names (and whether a handle
# is replaced by an equal new object, as a checksum change or a new slot does).
pushes = st.lists(
    st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=0, max_size=8),
    min_size=1,
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(pushes)
def test_both_tables_stay_in_step_and_hold_only_the_last_two_pushes(
    plan: list[list[tuple[int, bool]]],
) -> None:
    encoder, decoder = RefEncoder(), RefDecoder()
    pool = [shm(i, f"seg-{i}") for i in range(6)]
    decoded: dict[int, tuple[ShmHandle, object, int]] = {}  # id -> (sent, decoded, push)
    request_id = 0
    used: list[set[int]] = []
    for version, loads in enumerate(plan, start=1):
        request_id += 1
        begin = BeginUpdate(version=version)
        assert through(encoder, decoder, request_id, begin) == begin
        this: set[int] = set()
        for bucket, (i, replaced) in enumerate(loads):
            if replaced:
                pool[i] = shm(i, f"seg-{i}", checksum=version)
            handle = pool[i]
            request_id += 1
            load = LoadBucket(version=version, bucket=bucket, handles=(handle,))
            got = through(encoder, decoder, request_id, load)
            assert isinstance(got, LoadBucket) and got == load
            peer = got.handles[0]
            # A handle used in this push or the one before comes back as the object
            # the peer decoded then; an older one went in full again.
            last = decoded.get(id(handle))
            if last is not None and last[0] is handle and last[2] >= version - 1:
                assert peer is last[1]
            decoded[id(handle)] = (handle, peer, version)
            this.add(id(handle))
        used.append(this)
        # Other requests pass through untouched.
        request_id += 1
        assert through(encoder, decoder, request_id, GetVersion()) == GetVersion()
        # Bounded: only the handles of this push and the one before are kept.
        assert len(decoder) == len(encoder) <= len(set().union(*used[-2:]))


async def test_local_workers_take_loads_by_reference_across_pushes() -> None:
    model = make_mlp()
    async with (
        spawn_local_workers(make_mlp, 2) as workers,
        RefitCoordinator(
            trainer=LocalTrainer(model), workers=workers, budget_bytes=64 * 1024
        ) as refit,
    ):
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            report = await refit.push(version=version)
            assert report.version == version
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        for w in workers:
            assert await w.weight_version() == 3
            got = await w.parameter_digests()
            assert got == {n: tensor_digest(t) for n, t in want.items()}


async def test_a_worker_answers_an_unknown_reference_with_an_error() -> None:
    async with spawn_local_workers(make_mlp, 1) as workers:
        worker = workers[0]
        # A sender out of step: it believes the worker knows this handle as number 99.
        handle = shm(0, "seg-0")
        worker._requests._refs._now[id(handle)] = (handle, 99)
        with pytest.raises(WorkerRemoteError, match="names handle 99, which this connection"):
            await worker.load_bucket(1, 0, (handle,))
        assert await worker.weight_version() is None  # the worker still serves
