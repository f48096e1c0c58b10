"""Planning: parameter specs to packed, aligned buckets; validation against workers.

Everything here is pure and synchronous: no I/O, no tensors, no clocks (item sizes
come from torch's dtypes, looked up on first use; see :mod:`asyncrefit._dtypes`). The
plan is a value that the coordinator computes once and reuses while the parameter set
is unchanged (compared by :attr:`Plan.fingerprint`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .._dtypes import dtype_itemsize as dtype_itemsize
from .._exceptions import ParameterMismatchError, PlanError, WorkerProtocolError
from .._wire._pickling import FastPickle

#: Default alignment of every tensor inside a bucket, in bytes.
DEFAULT_ALIGNMENT = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """What a parameter is: its name, shape and dtype name (``"float32"``).

    ``parts`` is declared by a worker: it takes this parameter in parts (slices of
    consecutive rows along dimension 0, each in its own bucket), so that a tensor
    larger than a bucket is split rather than refused. Trainers leave it ``False``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    parts: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry(FastPickle):
    """Where one tensor lives inside a bucket.

    ``part`` is ``None`` for a whole tensor, or ``(start, stop)``: the entry holds rows
    ``start:stop`` (dimension 0) of the parameter ``name``, and ``shape`` is the shape
    of those rows.
    """

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    part: tuple[int, int] | None = None
    # Entries are hashed whenever a handle is looked up by value (a worker validates a
    # handle once, a link finds the reference it sent it under): the hash is kept.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        h = self._hash
        if not h:
            key = (self.name, self.offset, self.nbytes, self.shape, self.dtype, self.part)
            h = hash(key) or 1
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def label(self) -> str:
        """The parameter's name, with the rows of a part (``name[0:512]``)."""
        return self.name if self.part is None else f"{self.name}[{self.part[0]}:{self.part[1]}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """A group of tensors packed into one contiguous buffer of ``nbytes``."""

    index: int
    nbytes: int
    entries: tuple[TensorEntry, ...]
    #: Bytes of tensor data, without alignment padding (summed once: a push reads it
    #: for every bucket).
    payload_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload_bytes", sum(e.nbytes for e in self.entries))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The buckets of a parameter set, in transfer order.

    ``params`` are the parameters planned, whole (a parameter split into parts has
    one entry per part).
    """

    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    alignment: int
    fingerprint: str
    params: tuple[ParamSpec, ...] = ()

    @property
    def payload_bytes(self) -> int:
        return sum(b.payload_bytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def specs(self) -> dict[str, ParamSpec]:
        return {s.name: s for s in self.params}

    @property
    def split(self) -> frozenset[str]:
        """The parameters sent in parts."""
        return frozenset(e.name for b in self.buckets for e in b.entries if e.part is not None)


def fingerprint(specs: Iterable[ParamSpec]) -> str:
    """A digest of names, shapes and dtypes, in order: equal iff the set is unchanged."""
    h = hashlib.blake2b(digest_size=16)
    for s in specs:
        h.update(f"{s.name}\0{s.shape}\0{s.dtype}\n".encode())
    return h.hexdigest()


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_buckets(
    specs: Sequence[ParamSpec],
    bucket_bytes: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    splittable: Collection[str] = (),
) -> Plan:
    """Pack ``specs`` in order into buckets of at most ``bucket_bytes``.

    Every tensor starts at a multiple of ``alignment``. A tensor larger than
    ``bucket_bytes`` is split into parts of whole rows (dimension 0) if it is named in
    ``splittable`` (the receivers take it in parts): the first part fills what is left
    of the current bucket, the next ones fill buckets of their own, the last one shares
    its bucket with the tensors after it. Otherwise, or if one row alone is larger
    than ``bucket_bytes``, it gets a bucket of its own, exactly its size (the caller's
    budget must still hold it). The result depends only on the arguments.

    Raises :class:`PlanError` for duplicate names, an empty set, a non-positive
    ``bucket_bytes`` or an ``alignment`` that is not a power of two.
    """
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise PlanError(f"alignment must be a power of two, got {alignment}")
    if not specs:
        raise PlanError("the trainer has no parameters to send")
    seen: set[str] = set()
    buckets: list[Bucket] = []
    current: list[TensorEntry] = []
    end = 0  # first free byte of the current bucket

    def close() -> None:
        nonlocal current, end
        if current:
            buckets.append(Bucket(index=len(buckets), nbytes=end, entries=tuple(current)))
        current, end = [], 0

    for spec in specs:
        if spec.name in seen:
            raise PlanError(f"parameter {spec.name!r} is given twice")
        seen.add(spec.name)
        if any(d < 0 for d in spec.shape):
            raise PlanError(f"parameter {spec.name!r} has a negative dimension {spec.shape}")
        nbytes = spec.nbytes
        # Never below the element size, so every entry can be viewed as its dtype.
        offset = _align(end, max(alignment, dtype_itemsize(spec.dtype)))
        row = nbytes // spec.shape[0] if spec.shape and spec.shape[0] else 0
        if nbytes > bucket_bytes and spec.name in splittable and 0 < row <= bucket_bytes:
            start = 0
            while start < spec.shape[0]:
                if current and (bucket_bytes - offset) < row:
                    close()
                    offset = 0
                rows = min(spec.shape[0] - start, (bucket_bytes - offset) // row)
                current.append(
                    TensorEntry(
                        name=spec.name,
                        offset=offset,
                        nbytes=rows * row,
                        shape=(rows, *spec.shape[1:]),
                        dtype=spec.dtype,
                        part=(start, start + rows),
                    )
                )
                start += rows
                end = offset + rows * row
                if start < spec.shape[0]:
                    close()
                    offset = 0
            if end >= bucket_bytes:
                close()
            continue
        if current and offset + nbytes > bucket_bytes:
            close()
            offset = 0
        current.append(
            TensorEntry(
                name=spec.name, offset=offset, nbytes=nbytes, shape=spec.shape, dtype=spec.dtype
            )
        )
        end = offset + nbytes
        if end >= bucket_bytes:
            close()  # full, or an oversized tensor alone in its bucket
    close()
    return Plan(
        buckets=tuple(buckets),
        bucket_bytes=bucket_bytes,
        alignment=alignment,
        fingerprint=fingerprint(specs),
        params=tuple(specs),
    )


def validate_worker(
    expected: Mapping[str, ParamSpec], worker: str, declared: Iterable[ParamSpec]
) -> None:
    """Check a worker's declared parameters against the trainer's, name by name.

    The sets must be equal: a trainer parameter the worker lacks would be lost, and a
    worker parameter the trainer does not send would silently keep a stale value.
    Raises :class:`ParameterMismatchError` naming the first offending parameter (in
    sorted order) and the worker.
    """
    have = {}
    for spec in declared:
        if spec.name in have:
            raise ParameterMismatchError(worker, spec.name, "declared twice by the worker")
        have[spec.name] = spec
    for name in sorted(expected.keys() | have.keys()):
        want, got = expected.get(name), have.get(name)
        if got is None:
            raise ParameterMismatchError(worker, name, "the worker has no such parameter")
        if want is None:
            raise ParameterMismatchError(worker, name, "the trainer does not send it")
        if want.shape != got.shape:
            raise ParameterMismatchError(
                worker,
                name,
                f"shape {list(got.shape)} on the worker, {list(want.shape)} on the trainer",
            )
        if want.dtype != got.dtype:
            raise ParameterMismatchError(
                worker, name, f"dtype {got.dtype} on the worker, {want.dtype} on the trainer"
            )


def check_specs(worker: str, declared: object) -> tuple[ParamSpec, ...]:
    """A worker's answer to ``parameter_specs``, checked for type: a tuple of specs.

    Raises :class:`WorkerProtocolError` naming the worker and what is wrong (a value
    that is not a sequence, an item that is not a :class:`ParamSpec`, a name that is
    not a string, a shape that is not a tuple of non-negative ints, a dtype that is
    not a string).
    """
    if isinstance(declared, str | bytes) or not isinstance(declared, Iterable):
        raise WorkerProtocolError(
            worker, f"parameter_specs returned {type(declared).__name__}, not a sequence of specs"
        )
    specs = tuple(declared)
    for i, spec in enumerate(specs):
        problem = None
        if not isinstance(spec, ParamSpec):
            problem = f"is a {type(spec).__name__}, not a ParamSpec"
        elif not isinstance(spec.name, str):
            problem = f"has a name of type {type(spec.name).__name__}"
        elif not isinstance(spec.shape, tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec.shape
        ):
            problem = f"({spec.name!r}) has shape {spec.shape!r}, not a tuple of sizes"
        elif not isinstance(spec.dtype, str):
            problem = f"({spec.name!r}) has a dtype of type {type(spec.dtype).__name__}"
        if problem is not None:
            raise WorkerProtocolError(worker, f"parameter_specs item {i} {problem}")
    return specs
