"""Validation of a handle's entries against what a worker accepts, before any is read.

:func:`check_layout` checks that every entry can be read as it says;
:class:`Declared` holds what a worker accepts (its parameter specs by name) and checks
a handle's entries against them. Both raise :class:`TransportError` naming the bucket
and the entry; neither reads or writes a byte.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .._core._plan import ParamSpec, TensorEntry
from .._dtypes import dtype_itemsize
from .._exceptions import PlanError, TransportError
from ..transport._base import Handle


def check_layout(handle: Handle, buffer_bytes: int | None = None) -> None:
    """Check that every entry of ``handle`` can be read as it says, before any is read.

    Each entry must span exactly its shape's bytes (``numel * itemsize``), start at a
    non-negative offset aligned to its item size, and end inside the bucket
    (``handle.nbytes``) and inside the opened buffer (``buffer_bytes``, when given); no
    parameter may be named twice and no two entries may overlap. Raises
    :class:`TransportError` naming the bucket and the entry.
    """
    names: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for e in handle.entries:
        where = f"bucket {handle.bucket}, parameter {e.name!r}"
        if e.name in names:
            raise TransportError(f"{where}: named twice in the handle")
        names.add(e.name)
        try:
            itemsize = dtype_itemsize(e.dtype)
        except PlanError as exc:
            raise TransportError(f"{where}: {exc}") from None
        want = math.prod(e.shape) * itemsize
        if e.nbytes != want:
            raise TransportError(
                f"{where}: {e.nbytes} bytes for {e.dtype}{list(e.shape)}, which is {want}"
            )
        if e.offset < 0 or e.offset % itemsize:
            raise TransportError(
                f"{where}: offset {e.offset} is not a non-negative multiple of the "
                f"{e.dtype} item size {itemsize}"
            )
        end = e.offset + e.nbytes
        if end > handle.nbytes:
            raise TransportError(
                f"{where}: bytes {e.offset}..{end} lie outside the {handle.nbytes}-byte bucket"
            )
        if buffer_bytes is not None and end > buffer_bytes:
            raise TransportError(
                f"{where}: bytes {e.offset}..{end} lie outside the {buffer_bytes}-byte buffer"
            )
        if e.nbytes:
            spans.append((e.offset, end, e.name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise TransportError(
                f"bucket {handle.bucket}: the bytes of parameters {a!r} and {b!r} overlap"
            )


def reach(handle: Handle) -> int:
    """The end of the handle's last byte: a buffer of fewer bytes cannot hold it."""
    return max((e.offset + e.nbytes for e in handle.entries), default=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Declared:
    """What a worker accepts: its parameter specs by name, and how its errors say so.

    ``unknown`` is what an error says of a name the worker does not accept (formatted
    with ``name``), ``own`` the word for the worker's spec of a mismatched one.
    """

    specs: Mapping[str, ParamSpec]
    unknown: str = "names unknown parameter {name!r}"
    own: str = "held"

    def check(self, handle: Handle) -> None:
        """Check every entry's name, shape and dtype, then its layout (:func:`check_layout`)."""
        for e in handle.entries:
            spec = self.specs.get(e.name)
            if spec is None:
                raise TransportError(f"bucket {handle.bucket} {self.unknown.format(name=e.name)}")
            if e.part is not None:
                _check_part(handle.bucket, e, spec)
                continue
            if spec.shape != e.shape or spec.dtype != e.dtype:
                raise TransportError(
                    f"bucket {handle.bucket}, parameter {e.name!r}: {e.dtype}{list(e.shape)} "
                    f"sent, {spec.dtype}{list(spec.shape)} {self.own}"
                )
        check_layout(handle)


def _check_part(bucket: int, e: TensorEntry, spec: ParamSpec) -> None:
    """A part ``e`` must be rows ``start:stop`` of ``spec``, which the worker takes in parts."""
    where = f"bucket {bucket}, parameter {e.label!r}"
    if not spec.parts:
        raise TransportError(f"{where}: sent in parts, and this worker takes it only whole")
    part = e.part
    if (
        not isinstance(part, tuple)
        or len(part) != 2
        or not all(isinstance(i, int) for i in part)
        or not spec.shape
        or not 0 <= part[0] < part[1] <= spec.shape[0]
        or e.shape != (part[1] - part[0], *spec.shape[1:])
        or e.dtype != spec.dtype
    ):
        raise TransportError(
            f"{where}: {e.dtype}{list(e.shape)} is not those rows of {spec.dtype}{list(spec.shape)}"
        )
