"""Planning: parameter specs to packed, aligned buckets; validation against a worker."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrefit import ParameterMismatchError, ParamSpec, PlanError
from asyncrefit._core._plan import DEFAULT_ALIGNMENT, dtype_itemsize, fingerprint
from asyncrefit.planning import Plan, plan_buckets, validate_worker

#: The dtypes the planner supports, with their item sizes (written out independently).
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,  # packed: one byte per element, two 4-bit values in it
}

shapes = st.lists(st.integers(min_value=0, max_value=7), max_size=3).map(tuple)
dtypes = st.sampled_from(sorted(ITEMSIZE))
alignments = st.sampled_from([1 << k for k in range(10)])
bucket_sizes = st.integers(min_value=1, max_value=4096)


@st.composite
def spec_lists(draw: st.DrawFn, min_size: int = 1) -> list[ParamSpec]:
    names = draw(
        st.lists(st.text(min_size=1, max_size=6), min_size=min_size, max_size=12, unique=True)
    )
    return [ParamSpec(name=n, shape=draw(shapes), dtype=draw(dtypes)) for n in names]


def expected_nbytes(spec: ParamSpec) -> int:
    n = ITEMSIZE[spec.dtype]
    for d in spec.shape:
        n *= d
    return n


def check_plan(specs: Sequence[ParamSpec], plan: Plan, bucket_bytes: int, alignment: int) -> None:
    """Every structural property a plan must have."""
    assert plan.bucket_bytes == bucket_bytes
    assert plan.alignment == alignment
    assert plan.fingerprint == fingerprint(specs)
    # Every tensor exactly once, in input order, with its own shape, dtype and size.
    entries = [e for b in plan.buckets for e in b.entries]
    assert [e.name for e in entries] == [s.name for s in specs]
    for e, s in zip(entries, specs, strict=True):
        assert (e.shape, e.dtype, e.nbytes) == (s.shape, s.dtype, expected_nbytes(s))
    assert plan.specs == {s.name: s for s in specs}
    assert plan.payload_bytes == sum(expected_nbytes(s) for s in specs)
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))
    for b in plan.buckets:
        assert b.entries, "a bucket without tensors"
        assert b.payload_bytes == sum(e.nbytes for e in b.entries)
        for e in b.entries:
            assert e.offset % alignment == 0, (e, alignment)
            assert 0 <= e.offset and e.offset + e.nbytes <= b.nbytes, (e, b.nbytes)
        # Payload ranges are disjoint (so each payload byte is covered exactly once).
        ranges = sorted((e.offset, e.offset + e.nbytes) for e in b.entries if e.nbytes)
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, ranges
        covered = bytearray(b.nbytes)
        for e in b.entries:
            for i in range(e.offset, e.offset + e.nbytes):
                covered[i] += 1
        assert sum(covered) == b.payload_bytes
        assert max(covered, default=0) <= 1
        # The buffer ends where its last tensor ends: no trailing padding.
        assert b.nbytes == max(e.offset + e.nbytes for e in b.entries)
        if b.nbytes > bucket_bytes:
            assert len(b.entries) == 1, "an oversized bucket must hold one tensor"
            assert b.entries[0].nbytes > bucket_bytes
            assert b.nbytes == b.entries[0].nbytes
    # An oversized tensor is alone in its bucket.
    for b in plan.buckets:
        if any(e.nbytes > bucket_bytes for e in b.entries):
            assert len(b.entries) == 1
    assert plan.max_bucket_bytes == max(b.nbytes for b in plan.buckets)


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists(), bucket_bytes=bucket_sizes, alignment=alignments)
def test_plan_properties(specs: list[ParamSpec], bucket_bytes: int, alignment: int) -> None:
    plan = plan_buckets(specs, bucket_bytes, alignment=alignment)
    check_plan(specs, plan, bucket_bytes, alignment)


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists(), bucket_bytes=bucket_sizes, alignment=alignments)
def test_plan_is_greedy(specs: list[ParamSpec], bucket_bytes: int, alignment: int) -> None:
    """A bucket is closed only when it is full or the next tensor does not fit in it."""
    plan = plan_buckets(specs, bucket_bytes, alignment=alignment)
    for b, nxt in itertools.pairwise(plan.buckets):
        first = nxt.entries[0]
        step = max(alignment, dtype_itemsize(first.dtype))
        aligned_end = -(-b.nbytes // step) * step
        assert b.nbytes >= bucket_bytes or aligned_end + first.nbytes > bucket_bytes, (b, first)


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists(), bucket_bytes=bucket_sizes, alignment=alignments)
def test_plan_is_deterministic(specs: list[ParamSpec], bucket_bytes: int, alignment: int) -> None:
    copies = [ParamSpec(name=s.name, shape=tuple(s.shape), dtype=s.dtype) for s in specs]
    a = plan_buckets(specs, bucket_bytes, alignment=alignment)
    b = plan_buckets(tuple(copies), bucket_bytes, alignment=alignment)
    assert a == b
    assert a.fingerprint == b.fingerprint == fingerprint(copies)


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists(), data=st.data())
def test_fingerprint_changes_with_shape(specs: list[ParamSpec], data: st.DataObject) -> None:
    i = data.draw(st.integers(min_value=0, max_value=len(specs) - 1))
    new_shape = data.draw(shapes.filter(lambda s: s != specs[i].shape))
    changed = list(specs)
    changed[i] = ParamSpec(name=specs[i].name, shape=new_shape, dtype=specs[i].dtype)
    assert fingerprint(changed) != fingerprint(specs)
    assert plan_buckets(changed, 1024).fingerprint != plan_buckets(specs, 1024).fingerprint


def test_fingerprint_changes_with_dtype_name_and_order() -> None:
    a = ParamSpec(name="a", shape=(2, 3), dtype="float32")
    b = ParamSpec(name="b", shape=(4,), dtype="bfloat16")
    base = fingerprint([a, b])
    assert fingerprint([a, b]) == base
    assert fingerprint([b, a]) != base
    assert fingerprint([a, ParamSpec(name="b", shape=(4,), dtype="float16")]) != base
    assert fingerprint([a, ParamSpec(name="c", shape=(4,), dtype="bfloat16")]) != base
    assert fingerprint([a]) != base


def test_plan_example_layout() -> None:
    specs = [
        ParamSpec(name="w1", shape=(10,), dtype="float32"),  # 40 bytes
        ParamSpec(name="w2", shape=(3,), dtype="float16"),  # 6 bytes
        ParamSpec(name="empty", shape=(0, 4), dtype="float32"),  # 0 bytes
        ParamSpec(name="big", shape=(1000,), dtype="float64"),  # 8000 bytes
        ParamSpec(name="w3", shape=(2,), dtype="int8"),  # 2 bytes
    ]
    plan = plan_buckets(specs, 600)
    assert plan.alignment == DEFAULT_ALIGNMENT == 256
    layout = [[(e.name, e.offset, e.nbytes) for e in b.entries] for b in plan.buckets]
    assert layout == [
        [("w1", 0, 40), ("w2", 256, 6), ("empty", 512, 0)],
        [("big", 0, 8000)],
        [("w3", 0, 2)],
    ]
    assert [b.nbytes for b in plan.buckets] == [512, 8000, 2]
    assert plan.payload_bytes == 40 + 6 + 8000 + 2


def test_oversized_tensor_is_alone_between_small_ones() -> None:
    specs = [
        ParamSpec(name="a", shape=(4,), dtype="uint8"),
        ParamSpec(name="huge", shape=(100,), dtype="float32"),
        ParamSpec(name="b", shape=(4,), dtype="uint8"),
    ]
    plan = plan_buckets(specs, 64, alignment=8)
    assert [[e.name for e in b.entries] for b in plan.buckets] == [["a"], ["huge"], ["b"]]
    assert plan.buckets[1].nbytes == 400
    assert plan.max_bucket_bytes == 400


def test_offsets_are_aligned_to_itemsize() -> None:
    specs = [
        ParamSpec(name="flag", shape=(1,), dtype="uint8"),
        ParamSpec(name="w", shape=(3,), dtype="float64"),
        ParamSpec(name="h", shape=(1,), dtype="float16"),
        ParamSpec(name="c", shape=(2,), dtype="complex128"),
    ]
    plan = plan_buckets(specs, 1 << 20, alignment=1)
    offsets = {e.name: e.offset for b in plan.buckets for e in b.entries}
    for s in specs:
        assert offsets[s.name] % ITEMSIZE[s.dtype] == 0, (s.name, offsets)


# --- errors ---------------------------------------------------------------------------


def spec(name: str = "w", shape: tuple[int, ...] = (2,), dtype: str = "float32") -> ParamSpec:
    return ParamSpec(name=name, shape=shape, dtype=dtype)


@pytest.mark.parametrize(
    ("specs", "bucket_bytes", "alignment", "match"),
    [
        ([spec("a"), spec("b"), spec("a")], 1024, 256, "'a' is given twice"),
        ([], 1024, 256, "no parameters"),
        ([spec()], 0, 256, "bucket_bytes must be positive"),
        ([spec()], -5, 256, "bucket_bytes must be positive"),
        ([spec()], 1024, 0, "power of two"),
        ([spec()], 1024, -256, "power of two"),
        ([spec()], 1024, 3, "power of two"),
        ([spec()], 1024, 96, "power of two"),
        ([spec("neg", shape=(2, -1))], 1024, 256, "negative dimension"),
        ([spec("n2", shape=(-2, -3))], 1024, 256, "negative dimension"),
        ([spec("x", dtype="float128")], 1024, 256, "unsupported dtype 'float128'"),
        ([spec("x", dtype="torch.float32")], 1024, 256, "unsupported dtype"),
    ],
)
def test_plan_errors(specs: list[ParamSpec], bucket_bytes: int, alignment: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plan_buckets(specs, bucket_bytes, alignment=alignment)


def test_spec_nbytes_and_bad_dtype() -> None:
    assert spec(shape=(3, 5), dtype="bfloat16").nbytes == 30
    assert spec(shape=(3, 0), dtype="float64").nbytes == 0
    assert spec(shape=(), dtype="complex128").nbytes == 16
    assert spec(shape=(3, 5)).numel == 15
    with pytest.raises(PlanError, match="unsupported dtype"):
        _ = spec(dtype="half").nbytes


def torch_dtype_names() -> list[str]:
    """Every canonical dtype name of the installed torch, quantized ones excepted."""
    import torch

    names = {
        str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)
    }
    return sorted(n for n in names if not n.startswith(("qint", "quint")))


def test_itemsize_of_every_torch_dtype_comes_from_torch() -> None:
    import torch

    names = torch_dtype_names()
    assert {"float8_e8m0fnu", "float4_e2m1fn_x2", "float8_e4m3fn", "bfloat16"} <= set(names)
    for name in names:
        dtype = getattr(torch, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            element_size = torch.empty((), dtype=dtype).element_size()
        assert dtype_itemsize(name) == dtype.itemsize == element_size, name
    for name, size in ITEMSIZE.items():
        assert dtype_itemsize(name) == size, name


def test_packed_dtype_shapes_count_torch_elements() -> None:
    # float4_e2m1fn_x2: each element is one byte holding two 4-bit values; a spec's
    # shape is torch's shape, so (4, 8) is 32 elements, 32 bytes, 64 values.
    fp4 = spec("fp4", shape=(4, 8), dtype="float4_e2m1fn_x2")
    scale = spec("scale", shape=(4, 1), dtype="float8_e8m0fnu")
    assert (fp4.nbytes, scale.nbytes) == (32, 4)
    plan = plan_buckets([fp4, scale, spec("w", shape=(3,), dtype="float32")], 1 << 20)
    assert [(e.name, e.offset, e.nbytes) for e in plan.buckets[0].entries] == [
        ("fp4", 0, 32),
        ("scale", 256, 4),
        ("w", 512, 12),
    ]


@pytest.mark.parametrize("name", ["half", "float", "long", "torch.float32", "qint8", "quint4x2"])
def test_aliases_and_quantized_dtypes_are_refused(name: str) -> None:
    with pytest.raises(PlanError, match=f"unsupported dtype {name!r}"):
        dtype_itemsize(name)


def test_importing_the_planner_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, asyncrefit._core._plan\nassert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- validate_worker ---------------------------------------------------------------------

EXPECTED = {
    s.name: s
    for s in [
        spec("embed", (10, 4), "bfloat16"),
        spec("layer.0.w", (4, 4), "float32"),
        spec("layer.0.b", (4,), "float32"),
    ]
}


def test_validate_worker_accepts_equal_sets_in_any_order() -> None:
    validate_worker(EXPECTED, "w0", list(EXPECTED.values()))
    validate_worker(EXPECTED, "w0", reversed(list(EXPECTED.values())))


def _declared(**changes: ParamSpec | None) -> list[ParamSpec]:
    out = []
    for name, s in EXPECTED.items():
        key = name.replace(".", "_")
        if key in changes:
            new = changes[key]
            if new is not None:
                out.append(new)
        else:
            out.append(s)
    return out


@pytest.mark.parametrize(
    ("declared", "parameter", "problem"),
    [
        (_declared(layer_0_b=None), "layer.0.b", "no such parameter"),
        (
            [*EXPECTED.values(), spec("lm_head", (4, 10), "bfloat16")],
            "lm_head",
            "does not send it",
        ),
        (_declared(embed=spec("embed", (11, 4), "bfloat16")), "embed", "shape [11, 4]"),
        (_declared(layer_0_w=spec("layer.0.w", (4, 4), "float16")), "layer.0.w", "dtype float16"),
        (
            [*EXPECTED.values(), spec("layer.0.w", (4, 4), "float32")],
            "layer.0.w",
            "declared twice",
        ),
        # The first offender in sorted order is named.
        (
            _declared(
                layer_0_w=spec("layer.0.w", (5, 4), "float32"),
                embed=spec("embed", (10, 4), "float32"),
            ),
            "embed",
            "dtype float32 on the worker, bfloat16 on the trainer",
        ),
    ],
)
def test_validate_worker_mismatch(declared: list[ParamSpec], parameter: str, problem: str) -> None:
    with pytest.raises(ParameterMismatchError) as info:
        validate_worker(EXPECTED, "vllm-worker-3", declared)
    err = info.value
    assert isinstance(err, PlanError)
    assert err.worker == "vllm-worker-3"
    assert err.parameter == parameter
    assert problem in err.problem
    assert "vllm-worker-3" in str(err)
    assert parameter in str(err)
    assert problem in str(err)


def test_validate_worker_empty_worker() -> None:
    with pytest.raises(ParameterMismatchError) as info:
        validate_worker(EXPECTED, "w", [])
    assert info.value.parameter == "embed"
