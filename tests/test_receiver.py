"""The worker side: VersionState and ParameterReceiver over real shared memory."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import pytest
import torch

from asyncrefit import DeviceId, ParameterReceiver, ParamSpec, TransportError, cpu_device
from asyncrefit._core._plan import Bucket
from asyncrefit._exceptions import UpdateStateError
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.abc import BucketAck
from asyncrefit.planning import Plan, VersionState, plan_buckets, validate_worker
from asyncrefit.transport import Importer, SharedMemoryExporter, SharedMemoryImporter, make_importer
from asyncrefit.transport._base import Handle, dtype_name, torch_dtype

DEV = cpu_device(0, node="node-a")
OTHER = cpu_device(1, node="node-a")
ELSEWHERE = cpu_device(0, node="node-b")

# --- VersionState --------------------------------------------------------------------


def test_version_state_begin_load_commit() -> None:
    s = VersionState()
    assert (s.complete, s.pending) == (None, None)
    s.begin(1)
    assert (s.complete, s.pending) == (None, 1)
    s.loading(1, 0)
    s.loading(1, 1)
    s.commit(1, 2)
    assert (s.complete, s.pending, s.dirty, s.loaded) == (1, None, False, set())


def test_version_state_abort_after_load_leaves_nothing_complete() -> None:
    s = VersionState()
    s.begin(1)
    s.loading(1, 0)
    s.commit(1, 1)
    s.begin(2)
    assert s.complete == 1  # nothing written yet
    s.loading(2, 0)
    assert s.complete is None  # a mix of 1 and 2 from here on
    s.abort(2)
    assert (s.complete, s.pending) == (None, None)


def test_version_state_direct_begin_taken_back_unwritten_keeps_previous() -> None:
    """A direct version counts as written from its begin; only the coordinator's word
    that no byte was written (before the abort) gives the previous version back."""
    s = VersionState()
    s.begin(1, direct=True)
    s.commit(1, 3)
    s.begin(2, direct=True)
    assert (s.complete, s.written(2)) == (None, True)
    s.unwritten(3)  # another version: nothing changes
    assert (s.complete, s.written(2)) == (None, True)
    s.unwritten(2)
    assert (s.complete, s.written(2)) == (1, False)
    s.abort(2)
    assert (s.complete, s.pending) == (1, None)
    # Aborted without that word: written, nothing complete.
    s.begin(3, direct=True)
    s.abort(3)
    assert (s.complete, s.pending) == (None, None)
    # Taken back from no complete version: still none.
    s.begin(4, direct=True)
    s.unwritten(4)
    s.abort(4)
    assert s.complete is None


def test_version_state_unwritten_does_not_apply_to_a_staged_version() -> None:
    s = VersionState()
    s.begin(1)
    s.loading(1, 0)
    s.commit(1, 1)
    s.begin(2)
    s.loading(2, 0)
    s.unwritten(2)  # the worker knows itself what it loaded
    s.abort(2)
    assert s.complete is None


def test_version_state_abort_before_load_keeps_previous() -> None:
    s = VersionState()
    s.begin(1)
    s.loading(1, 0)
    s.commit(1, 1)
    s.begin(2)
    s.abort(2)
    assert (s.complete, s.pending) == (1, None)
    s.abort(2)  # idempotent
    s.abort(7)  # not the pending version: nothing happens
    assert (s.complete, s.pending) == (1, None)


def test_version_state_abort_of_other_version_keeps_pending() -> None:
    s = VersionState()
    s.begin(3)
    s.loading(3, 0)
    s.abort(2)
    assert (s.pending, s.dirty) == (3, True)


def test_version_state_begin_over_dirty_pending_aborts_it() -> None:
    s = VersionState()
    s.begin(1)
    s.loading(1, 0)
    s.commit(1, 1)
    s.begin(2)
    s.loading(2, 0)
    s.begin(3)  # 2 was half written
    assert (s.complete, s.pending, s.loaded) == (None, 3, set())
    with pytest.raises(UpdateStateError):
        s.loading(2, 1)


def test_version_state_commit_with_missing_buckets_raises() -> None:
    s = VersionState()
    s.begin(1)
    s.loading(1, 0)
    s.loading(1, 2)
    with pytest.raises(UpdateStateError, match="2 of 3 buckets"):
        s.commit(1, 3)
    assert (s.complete, s.pending) == (None, 1)
    s.loading(1, 2)  # the same bucket twice still counts once
    with pytest.raises(UpdateStateError):
        s.commit(1, 3)
    s.loading(1, 1)
    s.commit(1, 3)
    assert s.complete == 1


@pytest.mark.parametrize("pending", [None, 4])
def test_version_state_load_or_commit_of_other_version_raises(pending: int | None) -> None:
    s = VersionState()
    if pending is not None:
        s.begin(pending)
    with pytest.raises(UpdateStateError, match="version 5"):
        s.loading(5, 0)
    with pytest.raises(UpdateStateError):
        s.commit(5, 0)
    assert (s.complete, s.pending, s.dirty) == (None, pending, False)


def test_version_state_after_commit_nothing_pending() -> None:
    s = VersionState()
    s.begin(1)
    s.commit(1, 0)
    with pytest.raises(UpdateStateError, match="receiving nothing"):
        s.loading(1, 0)
    assert s.complete == 1


# --- tensors ---------------------------------------------------------------------------


def from_bits(fmt: str, dtype: torch.dtype, values: Sequence[int]) -> torch.Tensor:
    data = bytearray(struct.pack(f"<{len(values)}{fmt}", *values))
    return torch.frombuffer(data, dtype=dtype).clone()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of random *bytes*: NaNs with payloads, infinities, denormals, -0.0."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = itemsize
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def make_source(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "f32_special": from_bits(
            "I",
            torch.float32,
            [
                0x7FC00000,
                0xFFC00000,
                0x7F800001,
                0x7FBFFFFF,
                0x7F800000,
                0xFF800000,
                0x80000000,
                0x00000001,
                0x3F800000 + seed,
            ],
        ),
        "bf16_special": from_bits(
            "H", torch.bfloat16, [0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, seed]
        ),
        "f16_special": from_bits(
            "H", torch.float16, [0x7E00, 0xFE01, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001 + seed]
        ),
        "f64_special": from_bits(
            "Q",
            torch.float64,
            [0x7FF8000000000001, 0xFFF0000000000001, 0x7FF0000000000000, 0x8000000000000000, seed],
        ),
        "f32": random_tensor((33, 7), torch.float32, seed),
        "bf16": random_tensor((1000,), torch.bfloat16, seed + 1),
        "f16": random_tensor((5, 5), torch.float16, seed + 2),
        "f64": random_tensor((3, 2), torch.float64, seed + 3),
        "empty": torch.empty(0, 4),
        "i8": random_tensor((17,), torch.int8, seed + 4),
        "c64": random_tensor((4,), torch.complex64, seed + 5),
        "flags": torch.tensor([True, False, seed % 2 == 0]),
        "scalar": random_tensor((), torch.float32, seed + 6),
    }


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[ParamSpec]:
    return [
        ParamSpec(name=n, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
        for n, t in tensors.items()
    ]


def destination_like(source: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Worker parameters: same shapes and dtypes, different bytes."""
    return {
        n: random_tensor(tuple(t.shape), t.dtype, 1000 + i) if t.dtype != torch.bool else ~t.clone()
        for i, (n, t) in enumerate(source.items())
    }


def pack(
    exporter: SharedMemoryExporter, slot: int, bucket: Bucket, tensors: Mapping[str, torch.Tensor]
) -> None:
    """What LocalTrainer._pack does."""
    buffer = exporter.buffer(slot)
    with torch.no_grad():
        for e in bucket.entries:
            dst = buffer[e.offset : e.offset + e.nbytes]
            dst.view(torch_dtype(e.dtype)).view(e.shape).copy_(tensors[e.name])
    exporter.seal(slot)


def push(
    receiver: ParameterReceiver,
    exporter: SharedMemoryExporter,
    plan: Plan,
    source: Mapping[str, torch.Tensor],
    version: int,
    devices: Sequence[DeviceId] = (OTHER, DEV, ELSEWHERE),
) -> list[BucketAck]:
    receiver.begin(version)
    acks = []
    for bucket in plan.buckets:
        slot = bucket.index % 2
        pack(exporter, slot, bucket, source)
        handles = tuple(exporter.handle(slot, bucket, d) for d in devices)
        acks.append(receiver.load(version, bucket.index, handles))
    receiver.commit(version, len(plan.buckets))
    return acks


@pytest.fixture
def importer() -> Iterator[SharedMemoryImporter]:
    imp = SharedMemoryImporter()
    try:
        yield imp
    finally:
        imp.close()


def snapshot(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in params.items()}


def assert_unchanged(
    params: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]
) -> None:
    for n, t in params.items():
        assert same_bits(t, before[n]), f"{n} was written"


# --- ParameterReceiver: the happy path --------------------------------------------------


def test_push_arrives_bit_exact(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    source = make_source()
    params = destination_like(source)
    for n in source:
        if source[n].numel():
            assert not same_bits(params[n], source[n]), n
    plan = plan_buckets(specs_of(source), 1024)
    assert len(plan.buckets) >= 3
    exporter.allocate(2, plan.max_bucket_bytes)
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        validate_worker(plan.specs, "w0", receiver.specs())
        acks = push(receiver, exporter, plan, source, version=1)
        assert receiver.version == 1
        assert [a.bucket for a in acks] == [b.index for b in plan.buckets]
        assert [a.nbytes for a in acks] == [b.payload_bytes for b in plan.buckets]
        assert all(a.seconds >= 0 for a in acks)
        for n, t in source.items():
            assert same_bits(params[n], t), n
            assert tensor_digest(params[n]) == tensor_digest(t), n
        assert receiver.digests() == {n: tensor_digest(t) for n, t in source.items()}
        assert len(importer) == 2  # one mapping per slot

        # A second push reuses the cached mappings and still delivers the new bytes.
        source2 = make_source(seed=7)
        push(receiver, exporter, plan, source2, version=2)
        assert receiver.version == 2
        assert len(importer) == 2
        for n, t in source2.items():
            assert same_bits(params[n], t), n
        assert not same_bits(params["f32"], source["f32"])
    finally:
        receiver.close()
    assert len(importer) == 0


@pytest.mark.parametrize("dtype", ["float8_e8m0fnu", "float4_e2m1fn_x2", "float8_e4m3fn"])
def test_low_precision_dtypes_arrive_bit_exact(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter, dtype: str
) -> None:
    # MX-style weights: packed fp4 values (two per byte) with one e8m0 scale per block.
    source = {
        "w": random_tensor((16, 8), torch_dtype(dtype), 1),
        "scale": random_tensor((16, 1), torch.float8_e8m0fnu, 2),
        "bias": random_tensor((16,), torch.bfloat16, 3),
    }
    params = destination_like(source)
    plan = plan_buckets(specs_of(source), 1 << 20)
    assert plan.buckets[0].entries[0].nbytes == 16 * 8  # torch's element size: 1 byte
    exporter.allocate(1, plan.max_bucket_bytes)
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        push(receiver, exporter, plan, source, version=1, devices=(DEV,))
    finally:
        receiver.close()
    assert receiver.version == 1
    for n, t in source.items():
        assert same_bits(params[n], t), n


def test_default_importer_is_shared_memory(exporter: SharedMemoryExporter) -> None:
    source = {"w": random_tensor((8, 8), torch.bfloat16, 3)}
    params = destination_like(source)
    plan = plan_buckets(specs_of(source), 1 << 20)
    exporter.allocate(1, plan.max_bucket_bytes)
    receiver = ParameterReceiver(params, DEV)
    try:
        push(receiver, exporter, plan, source, version=5)
    finally:
        receiver.close()
    assert receiver.version == 5
    assert same_bits(params["w"], source["w"])


def test_importer_factory_is_used_for_unknown_kind(exporter: SharedMemoryExporter) -> None:
    source = {"w": random_tensor((4,), torch.float32, 3)}
    params = destination_like(source)
    plan = plan_buckets(specs_of(source), 1 << 20)
    exporter.allocate(1, plan.max_bucket_bytes)
    made: list[str] = []
    importers: list[SharedMemoryImporter] = []

    def factory(kind: str) -> Importer:
        made.append(kind)
        importers.append(SharedMemoryImporter())
        return importers[-1]

    receiver = ParameterReceiver(params, DEV, importers={}, importer_factory=factory)
    try:
        push(receiver, exporter, plan, source, version=1)
        push(receiver, exporter, plan, source, version=2)
    finally:
        receiver.close()
    assert made == ["shm"]
    assert len(importers[0]) == 0
    assert same_bits(params["w"], source["w"])


def test_specs_describe_the_parameters() -> None:
    params = {"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(0)}
    receiver = ParameterReceiver(params, DEV, importers={})
    assert receiver.specs() == (
        # taken whole or in parts (rows): a parameter larger than a bucket is split
        ParamSpec(name="a", shape=(2, 3), dtype="bfloat16", parts=True),
        ParamSpec(name="b", shape=(0,), dtype="float32", parts=True),
    )
    assert receiver.version is None
    receiver.close()


# --- ParameterReceiver: errors raised before any byte is written -------------------------


def one_bucket(
    exporter: SharedMemoryExporter, plan_source: Mapping[str, torch.Tensor]
) -> tuple[Handle, ...]:
    """Pack ``plan_source`` into one bucket and return its handles for DEV and OTHER."""
    plan = plan_buckets(specs_of(plan_source), 1 << 20)
    assert len(plan.buckets) == 1
    exporter.allocate(1, plan.max_bucket_bytes)
    pack(exporter, 0, plan.buckets[0], plan_source)
    return (
        exporter.handle(0, plan.buckets[0], OTHER),
        exporter.handle(0, plan.buckets[0], DEV),
    )


@pytest.mark.parametrize(
    ("bad_name", "bad", "match"),
    [
        ("ghost", torch.ones(3), "unknown parameter 'ghost'"),
        ("w", torch.ones(4, 3), r"'w': float32\[4, 3\] sent, float32\[3, 4\] held"),
        ("w", torch.ones(3, 4, dtype=torch.int32), r"'w': int32\[3, 4\] sent, float32"),
        ("w", torch.ones(3, 4, dtype=torch.bfloat16), "bfloat16"),
    ],
)
def test_bad_entries_raise_before_any_write(
    exporter: SharedMemoryExporter,
    importer: SharedMemoryImporter,
    bad_name: str,
    bad: torch.Tensor,
    match: str,
) -> None:
    params = {"first": torch.zeros(16), "w": torch.zeros(3, 4)}
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        # Version 1 arrives whole.
        good = {"first": torch.full((16,), 1.5), "w": torch.full((3, 4), 2.5)}
        handles = one_bucket(exporter, good)
        receiver.begin(1)
        receiver.load(1, 0, handles)
        receiver.commit(1, 1)
        before = snapshot(params)
        # Version 2: a valid entry first, then the bad one.
        plan_source = {"first": torch.full((16,), -7.0), bad_name: bad}
        handles = one_bucket(exporter, plan_source)
        receiver.begin(2)
        with pytest.raises(TransportError, match=match):
            receiver.load(2, 0, handles)
        assert_unchanged(params, before)
        receiver.abort(2)
        assert receiver.version == 1  # nothing was written: version 1 still whole
    finally:
        receiver.close()


def malformed(handle: Handle, defect: str) -> Handle:
    """``handle`` with its second entry (or the pair of entries) made invalid."""
    first, second, *rest = handle.entries
    page = mmap.PAGESIZE
    bad = {
        "nbytes-short": (first, replace(second, nbytes=second.nbytes - 4), *rest),
        "nbytes-long": (first, replace(second, nbytes=second.nbytes + 4), *rest),
        "past-bucket": (first, replace(second, offset=handle.nbytes), *rest),
        "past-segment": (first, replace(second, offset=page - 16), *rest),
        "far-past-segment": (first, replace(second, offset=1 << 40), *rest),
        "negative-offset": (first, replace(second, offset=-256), *rest),
        "misaligned": (first, replace(second, offset=second.offset + 2), *rest),
        "duplicate": (first, second, replace(second, offset=0), *rest),
        "overlap": (first, replace(second, offset=first.offset + 4), *rest),
    }[defect]
    return replace(handle, entries=bad)


DEFECTS = [
    "nbytes-short",
    "nbytes-long",
    "past-bucket",
    "past-segment",
    "far-past-segment",
    "negative-offset",
    "misaligned",
    "duplicate",
    "overlap",
]


@pytest.mark.parametrize("defect", DEFECTS)
def test_every_entry_is_validated_before_the_first_write(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter, defect: str
) -> None:
    params = {"first": torch.zeros(16), "w": torch.zeros(3, 4), "last": torch.zeros(5)}
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        good = {
            "first": torch.full((16,), 1.5),
            "w": torch.full((3, 4), 2.5),
            "last": torch.ones(5),
        }
        receiver.begin(1)
        receiver.load(1, 0, one_bucket(exporter, good))
        receiver.commit(1, 1)
        before = snapshot(params)
        # Version 2: the first entry is valid, a later one is not.
        new = {n: t - 9 for n, t in good.items()}
        handles = tuple(malformed(h, defect) for h in one_bucket(exporter, new))
        receiver.begin(2)
        with pytest.raises(TransportError, match="bucket 0") as info:
            receiver.load(2, 0, handles)
        assert "'w'" in str(info.value) or defect == "overlap", info.value
        assert_unchanged(params, before)
        assert receiver.state.dirty is False
        receiver.abort(2)
        assert receiver.version == 1  # nothing was written: version 1 still whole
    finally:
        receiver.close()


def test_no_handle_for_own_device_raises_before_any_write(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    source = {"a": random_tensor((64,), torch.float16, 1), "b": random_tensor((9,), torch.int8, 2)}
    params = destination_like(source)
    before = snapshot(params)
    plan = plan_buckets(specs_of(source), 1 << 20)
    exporter.allocate(1, plan.max_bucket_bytes)
    bucket = plan.buckets[0]
    pack(exporter, 0, bucket, source)
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        receiver.begin(1)
        # Same device id on another node, and another device on this node: neither is ours.
        handles = (exporter.handle(0, bucket, OTHER), exporter.handle(0, bucket, ELSEWHERE))
        with pytest.raises(TransportError, match="no handle for device node-a/cpu:0") as info:
            receiver.load(1, 0, handles)
        assert "node-a/cpu:1" in str(info.value) and "node-b/cpu:0" in str(info.value)
        with pytest.raises(TransportError, match="offered: none"):
            receiver.load(1, 0, ())
        assert_unchanged(params, before)
        assert len(importer) == 0  # nothing was even opened
        assert receiver.state.dirty is False
    finally:
        receiver.close()


def test_missing_importer_raises_before_any_write(exporter: SharedMemoryExporter) -> None:
    source = {"a": random_tensor((8,), torch.float32, 1)}
    params = destination_like(source)
    before = snapshot(params)
    plan = plan_buckets(specs_of(source), 1 << 20)
    exporter.allocate(1, plan.max_bucket_bytes)
    pack(exporter, 0, plan.buckets[0], source)

    def refuse(kind: str) -> Importer:
        raise TransportError(f"this worker cannot open {kind!r} handles")

    receiver = ParameterReceiver(params, DEV, importer_factory=refuse)
    receiver.begin(1)
    with pytest.raises(TransportError, match="cannot open 'shm' handles"):
        receiver.load(1, 0, (exporter.handle(0, plan.buckets[0], DEV),))
    assert_unchanged(params, before)
    receiver.close()


def test_unknown_transport_kind_is_a_transport_error() -> None:
    with pytest.raises(TransportError, match="'carrier-pigeon'"):
        make_importer("carrier-pigeon")


def test_load_of_version_not_being_received_raises(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    source = {"a": random_tensor((8,), torch.float64, 1)}
    params = destination_like(source)
    before = snapshot(params)
    plan = plan_buckets(specs_of(source), 1 << 20)
    exporter.allocate(1, plan.max_bucket_bytes)
    pack(exporter, 0, plan.buckets[0], source)
    handles = (exporter.handle(0, plan.buckets[0], DEV),)
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        with pytest.raises(UpdateStateError):
            receiver.load(1, 0, handles)  # nothing begun
        receiver.begin(2)
        with pytest.raises(UpdateStateError, match="version 1 arrived"):
            receiver.load(1, 0, handles)
        assert_unchanged(params, before)
        with pytest.raises(UpdateStateError, match="0 of 1 buckets"):
            receiver.commit(2, 1)
        receiver.load(2, 0, handles)
        receiver.commit(2, 1)
        assert receiver.version == 2
        assert same_bits(params["a"], source["a"])
    finally:
        receiver.close()


# --- tensor_digest ---------------------------------------------------------------------------


def test_tensor_digest_is_bitwise() -> None:
    t = random_tensor((4, 5), torch.float32, 9)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t.t().contiguous().t()) == tensor_digest(t)  # layout does not matter
    pos, neg = torch.tensor([0.0]), torch.tensor([-0.0])
    assert bool((pos == neg).all())
    assert tensor_digest(pos) != tensor_digest(neg)
    nan1 = from_bits("I", torch.float32, [0x7FC00000])
    nan2 = from_bits("I", torch.float32, [0x7FC00001])
    assert tensor_digest(nan1) != tensor_digest(nan2)
    assert tensor_digest(nan1) == tensor_digest(nan1.clone())
    # Same bytes, other dtype or shape: different digests.
    assert tensor_digest(t.view(torch.int32)) != tensor_digest(t)
    assert tensor_digest(t.reshape(5, 4)) != tensor_digest(t)
    assert tensor_digest(torch.empty(0, 4)) != tensor_digest(torch.empty(4, 0))
    bf = random_tensor((3,), torch.bfloat16, 1)
    assert tensor_digest(bf) != tensor_digest(bf.view(torch.float16))


# --- ParameterReceiver: handles seen before -------------------------------------------


def test_a_handle_seen_before_is_not_checked_again_and_still_delivers(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncrefit._worker._layout as layout_module

    source = make_source()
    params = destination_like(source)
    plan = plan_buckets(specs_of(source), 1024)
    exporter.allocate(2, plan.max_bucket_bytes)
    checks: list[int] = []
    real = layout_module.check_layout

    def counting(handle: Handle, buffer_bytes: int | None = None) -> None:
        checks.append(handle.bucket)
        real(handle, buffer_bytes)

    monkeypatch.setattr(layout_module, "check_layout", counting)
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        push(receiver, exporter, plan, source, version=1)
        first = len(checks)
        assert first >= len(plan.buckets)
        for version, seed in ((2, 7), (3, 8)):
            fresh = make_source(seed=seed)
            push(receiver, exporter, plan, fresh, version=version)  # equal, new handles
            assert len(checks) == first
            for n, t in fresh.items():
                assert same_bits(params[n], t), n
    finally:
        receiver.close()


def test_views_of_buffers_a_new_generation_replaced_are_not_kept(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    source = make_source()
    params = destination_like(source)
    plan = plan_buckets(specs_of(source), 1024)
    exporter.allocate(2, plan.max_bucket_bytes)
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        push(receiver, exporter, plan, source, version=1)
        # A re-plan: the exporter re-allocates (a new generation of segments); the
        # importer unmaps the old ones when the first new name arrives. (Unmapped
        # memory must never be read: views of it must not survive in the receiver.)
        exporter.allocate(3, plan.max_bucket_bytes + 4096)
        fresh = make_source(seed=3)
        push(receiver, exporter, plan, fresh, version=2)
        current = {id(exporter_view) for exporter_view in _opened(importer, exporter, plan)}
        held = {id(p.buffer) for p in receiver.parameter_sink._prepared.values()}
        assert held and held <= current
        for n, t in fresh.items():
            assert same_bits(params[n], t), n
        receiver.release_handles()
        assert not receiver.parameter_sink._prepared and len(importer) == 0
    finally:
        receiver.close()


def _opened(
    importer: SharedMemoryImporter, exporter: SharedMemoryExporter, plan: Plan
) -> list[torch.Tensor]:
    """The buffers ``importer`` returns now for the handles ``push`` sends."""
    return [importer.open(exporter.handle(b.index % 2, b, DEV)) for b in plan.buckets]


class _Shrinking:
    """An importer over a real one that hands out a smaller buffer when told to."""

    def __init__(self, inner: SharedMemoryImporter) -> None:
        self.inner = inner
        self.shrink = False

    def open(self, handle: Handle) -> torch.Tensor:
        buffer = self.inner.open(handle)
        return buffer[:16].clone() if self.shrink else buffer

    def finish(self, handle: Handle) -> bytes:
        return self.inner.finish(handle)

    def settle(self) -> None:
        self.inner.settle()

    def close(self) -> None:
        self.inner.close()


def test_a_handle_seen_before_is_checked_against_a_new_buffer(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    shrinking = _Shrinking(importer)
    params = {"first": torch.zeros(16), "w": torch.zeros(3, 4)}
    receiver = ParameterReceiver(params, DEV, importers={"shm": shrinking})
    try:
        good = {"first": torch.full((16,), 1.5), "w": torch.full((3, 4), 2.5)}
        handles = one_bucket(exporter, good)
        receiver.begin(1)
        receiver.load(1, 0, handles)
        receiver.commit(1, 1)
        before = snapshot(params)
        shrinking.shrink = True  # the same handle now opens a 16-byte buffer
        receiver.begin(2)
        with pytest.raises(TransportError, match="outside the 16-byte buffer"):
            receiver.load(2, 0, handles)
        assert_unchanged(params, before)
        assert receiver.state.dirty is False
    finally:
        receiver.close()


def test_views_are_kept_of_at_most_max_viewed_buffers(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    from asyncrefit._worker._receiver import MAX_VIEWED_BUFFERS

    slots = MAX_VIEWED_BUFFERS + 3
    source = {f"t{i}": torch.full((64,), float(i)) for i in range(slots)}
    params = {n: torch.zeros(64) for n in source}
    plan = plan_buckets(specs_of(source), 256)
    assert len(plan.buckets) == slots
    exporter.allocate(slots, plan.max_bucket_bytes)
    receiver = ParameterReceiver(params, DEV, importers={"shm": importer})
    try:
        for version in (1, 2):
            receiver.begin(version)
            for bucket in plan.buckets:  # every bucket in a slot of its own
                pack(exporter, bucket.index, bucket, {n: t + version for n, t in source.items()})
                receiver.load(version, bucket.index, (exporter.handle(bucket.index, bucket, DEV),))
            receiver.commit(version, slots)
            prepared = receiver.parameter_sink._prepared.values()
            assert len({id(p.buffer) for p in prepared}) == MAX_VIEWED_BUFFERS
            for n, t in source.items():
                assert same_bits(params[n], t + version), n
    finally:
        receiver.close()
