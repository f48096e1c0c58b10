"""Engine tensors as strided slices of trainer tensors, read without a copy of their own.

An engine tensor that is not a trainer tensor as it is (one expert's ``w1`` of a fused
``[E, 2I, H]`` expert tensor, or rows ``a:b`` of a tensor sent in parts) is described by
:class:`Piece`\\ s: strided views of trainer tensors, as ``torch.as_strided`` takes them,
relative to a trainer tensor's contiguous row-major layout. Several pieces, side by side
along one dimension, make one engine tensor (a concatenation).

:class:`Slices` binds pieces to the trainer's current tensors at a push. Over plain
tensors, a one-piece engine tensor is a view (:func:`view_of`), packed like any tensor.
Over a sharded ``DTensor`` only the rows of dimension 0 that a piece touches are
gathered (:meth:`Piece.rows`), so an engine tensor costs about its own size in
temporary memory, not its trainer tensor's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous, row-major tensor of ``shape``, in elements."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class Piece:
    """A strided view of the trainer tensor ``source`` (of ``source_shape``).

    ``offset`` and ``stride`` count elements of the source's contiguous row-major
    layout, as :func:`torch.as_strided` takes them.
    """

    source: str
    source_shape: tuple[int, ...]
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """Whether this piece is its source, as it is."""
        return (
            self.offset == 0
            and self.shape == self.source_shape
            and self.stride == contiguous_strides(self.shape)
        )

    def rows(self) -> tuple[int, int]:
        """The rows ``lo:hi`` (dimension 0) of the source that this piece reads."""
        if not self.source_shape or math.prod(self.shape) == 0:
            return 0, 0  # a scalar has no rows; an empty piece reads none
        row = math.prod(self.source_shape[1:]) or 1
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return self.offset // row, last // row + 1

    def narrow(self, start: int, stop: int) -> Piece:
        """Rows ``start:stop`` (dimension 0) of this piece."""
        first = self.stride[0] if self.shape else 0
        return Piece(
            source=self.source,
            source_shape=self.source_shape,
            offset=self.offset + start * first,
            shape=(stop - start, *self.shape[1:]),
            stride=self.stride,
        )

    def within(self, lo: int) -> Piece:
        """This piece relative to a tensor holding rows ``lo:`` of its source."""
        row = math.prod(self.source_shape[1:]) if self.source_shape else 1
        shape = (self.source_shape[0] - lo, *self.source_shape[1:]) if self.source_shape else ()
        return Piece(
            source=self.source,
            source_shape=shape,
            offset=self.offset - lo * row,
            shape=self.shape,
            stride=self.stride,
        )

    @staticmethod
    def of(source: str, shape: Sequence[int]) -> Piece:
        """The whole tensor ``source``, as one piece."""
        shape = tuple(shape)
        return Piece(
            source=source,
            source_shape=shape,
            offset=0,
            shape=shape,
            stride=contiguous_strides(shape),
        )


def view_of(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``piece`` of the plain tensor ``tensor``: a view (a copy if ``tensor`` is not
    contiguous, which parameters practically never are not)."""
    if piece.whole and tuple(tensor.shape) == piece.shape:
        return tensor
    base = tensor if tensor.is_contiguous() else tensor.contiguous()
    return base.as_strided(piece.shape, piece.stride, base.storage_offset() + piece.offset)


def is_plain(tensor: object) -> bool:
    """Whether ``tensor`` is a plain tensor (not a sharded ``DTensor``)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return True
    return not isinstance(tensor, DTensor)


#: Copies ``piece`` of ``source`` into ``out`` (of the piece's shape).
CopyPiece = Callable[["torch.Tensor", Any, Piece], None]


class Lazy:
    """An engine tensor computed from the trainer's tensors (``sources``) when it is
    written, not held: it has a ``shape`` and a ``dtype`` like a tensor,
    :meth:`rows` (rows of it, as another one) and :meth:`copy_into` (its value into a
    tensor of its shape). :class:`Slices` and the FP8 tensors of
    :mod:`asyncrefit.trainer._quantized` are; the sources read the trainer's memory
    wherever it is when written.
    """

    __slots__ = ()
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: tuple[Any, ...]

    def rows(self, start: int, stop: int) -> Lazy:
        """Rows ``start:stop`` (dimension 0) of this tensor."""
        raise NotImplementedError

    def copy_into(self, out: torch.Tensor, copy: CopyPiece) -> None:
        """Write this tensor's value into ``out`` (of its shape); ``copy`` copies a
        piece of a source (plain tensors, or a ``DTensor``'s gathered rows)."""
        raise NotImplementedError


class Slices(Lazy):
    """One engine tensor made of pieces of the trainer's tensors, bound at a push.

    ``pieces`` lie side by side along dimension ``dim``; ``sources`` are the trainer's
    tensors by name (plain tensors or ``DTensor``\\ s). It has a ``shape`` and a
    ``dtype`` like a tensor; :meth:`copy_into` writes its value.
    """

    __slots__ = ("dim", "dtype", "pieces", "shape", "sources")

    def __init__(
        self,
        pieces: Sequence[Piece],
        dim: int,
        sources: Sequence[Any],
        dtype: torch.dtype,
    ) -> None:
        self.pieces = tuple(pieces)
        self.sources = tuple(sources)
        self.dim = dim
        self.dtype = dtype
        shape = list(self.pieces[0].shape)
        if len(self.pieces) > 1:
            shape[dim] = sum(p.shape[dim] for p in self.pieces)
        self.shape: tuple[int, ...] = tuple(shape)

    def __repr__(self) -> str:
        names = sorted({p.source for p in self.pieces})
        return f"<Slices of {', '.join(names)} shape={list(self.shape)} dtype={self.dtype}>"

    def rows(self, start: int, stop: int) -> Slices:
        """Rows ``start:stop`` (dimension 0) of this tensor, as pieces."""
        if self.dim != 0 or len(self.pieces) == 1:
            pieces = [p.narrow(start, stop) for p in self.pieces]
            return Slices(pieces, self.dim, self.sources, self.dtype)
        picked: list[Piece] = []
        sources: list[Any] = []
        at = 0
        for piece, source in zip(self.pieces, self.sources, strict=True):
            lo, hi = max(start, at), min(stop, at + piece.shape[0])
            if lo < hi:
                picked.append(piece.narrow(lo - at, hi - at))
                sources.append(source)
            at += piece.shape[0]
        return Slices(picked, 0, sources, self.dtype)

    def copy_into(self, out: torch.Tensor, copy: CopyPiece) -> None:
        """Write this tensor's value into ``out`` (of its shape), a piece at a time."""
        at = 0
        for piece, source in zip(self.pieces, self.sources, strict=True):
            size = piece.shape[self.dim] if piece.shape else 1
            region = out.narrow(self.dim, at, size) if len(self.pieces) > 1 else out
            copy(region, source, piece)
            at += size


def copy_plain(out: torch.Tensor, source: Any, piece: Piece) -> None:
    """:data:`CopyPiece` for plain tensors: one (casting) copy from a view."""
    out.copy_(view_of(source, piece))


def rows_of(tensor: torch.Tensor | Lazy, part: tuple[int, int] | None) -> torch.Tensor | Lazy:
    """Rows ``part`` (dimension 0) of an engine tensor: a view of a plain tensor,
    :class:`Lazy` otherwise; the tensor itself when ``part`` is ``None``."""
    if part is None:
        return tensor
    start, stop = part
    if isinstance(tensor, Lazy):
        return tensor.rows(start, stop)
    if is_plain(tensor):
        return tensor[start:stop]
    whole = Piece.of("", tuple(tensor.shape))
    return Slices([whole], 0, [tensor], tensor.dtype).rows(start, stop)
