"""The records that cross a process at every bucket pickle as their fields, exactly."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from asyncrefit import DeviceId
from asyncrefit._wire._messages import LoadBucket
from asyncrefit._wire._pickling import FastPickle
from asyncrefit.abc import BucketAck
from asyncrefit.planning import TensorEntry
from asyncrefit.transport import Handle
from asyncrefit.transport.collective import CollectiveHandle
from asyncrefit.transport.cuda_ipc import CudaIpcHandle
from asyncrefit.transport.shm import ShmHandle

pytestmark = pytest.mark.timeout(30)

DEVICE = DeviceId(node="node-1", device="GPU-1234")
ENTRIES = (
    TensorEntry(name="a.weight", offset=0, nbytes=64, dtype="bfloat16", shape=(4, 8)),
    TensorEntry(name="b", offset=64, nbytes=4, dtype="float32", shape=()),
)


def _records() -> list[object]:
    handles: list[Handle] = [
        ShmHandle(device=DEVICE, bucket=3, nbytes=68, entries=ENTRIES, segment="asyncrefit-1-ab-0"),
        ShmHandle(device=DEVICE, bucket=3, nbytes=68, entries=ENTRIES, segment="s", checksum=7),
    ]
    common: dict[str, Any] = {"device": DEVICE, "bucket": 1, "nbytes": 68, "entries": ENTRIES}
    handles.append(
        CudaIpcHandle(
            **common,
            owner="trainer-1",
            slot=1,
            generation=2,
            ipc_handle=b"\x01\x02",
            storage_bytes=4096,
            storage_offset=0,
            event_handle=b"\x03",
            ordered=True,
        )
    )
    handles.append(
        CollectiveHandle(
            **common,
            host="127.0.0.1",
            port=29500,
            session="s",
            generation=1,
            rank=1,
            world_size=2,
        )
    )
    return [
        DEVICE,
        *ENTRIES,
        *handles,
        LoadBucket(version=9, bucket=3, handles=tuple(handles[:2])),
        BucketAck(bucket=3, nbytes=68, seconds=0.25, copied=b"tok"),
    ]


@pytest.mark.parametrize("record", _records(), ids=lambda r: type(r).__name__)
def test_a_record_round_trips_equal_hashable_and_frozen(record: object) -> None:
    assert isinstance(record, FastPickle)
    back = pickle.loads(pickle.dumps(record, protocol=5))
    assert type(back) is type(record) and back == record and hash(back) == hash(record)
    assert dataclasses.astuple(back) == dataclasses.astuple(record)  # type: ignore[call-overload]
    first = dataclasses.fields(back)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(back, first, None)


def test_it_reduces_to_its_class_and_its_field_values() -> None:
    """Nothing but (class, values): no per-object field lookup is pickled along."""
    record = ShmHandle(device=DEVICE, bucket=3, nbytes=68, entries=ENTRIES, segment="s")
    reduced = record.__reduce__()
    assert reduced[1][0] is ShmHandle
    assert reduced[1][1] == tuple(getattr(record, f.name) for f in dataclasses.fields(record))
