"""FP8 engine tensors of the trainer's weights, quantized when written (see
:mod:`asyncrefit.quantization`).

:func:`quantize_tensors` replaces each targeted engine tensor ``X.weight`` by
:class:`Fp8Weight` and adds ``X.weight_scale_inv`` as :class:`Fp8Scales`: lazy tensors
(:class:`~asyncrefit.trainer._slices.Lazy`) that read the trainer's weight when their
bucket is packed (or written directly) and quantize it there, on the weight's device.
Each computes what it needs from the weight afresh (the scales alone are one read of
it), so nothing of a push outlives the write of its bucket. A quantized tensor is
packed whole: a bucket must hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..quantization import fp8_block_quantize, fp8_block_scales
from ._slices import CopyPiece, Lazy, copy_plain

if TYPE_CHECKING:
    import torch

#: A block-quantized weight's scales are named ``X.weight_scale_inv`` after it (``X.weight``).
SCALE_SUFFIX = "_scale_inv"


def _read(source: Any) -> torch.Tensor:
    """The value of ``source`` (a trainer tensor, or a lazy one) as a tensor."""
    import torch

    if not isinstance(source, Lazy):
        return source.detach() if isinstance(source, torch.Tensor) else source
    device = next((s.device for s in source.sources if hasattr(s, "device")), None)
    whole = torch.empty(source.shape, dtype=source.dtype, device=device)
    source.copy_into(whole, copy_plain)
    return whole


class _Quantized(Lazy):
    __slots__ = ("block", "dtype", "shape", "sources")

    def __init__(self, source: Any, block: tuple[int, int]) -> None:
        self.sources = (source,)
        self.block = block

    def rows(self, start: int, stop: int) -> Lazy:
        raise ValueError(
            f"a quantized tensor is packed whole (rows {start}:{stop} of it were asked): "
            "make buckets at least as large as the largest weight"
        )


class Fp8Weight(_Quantized):
    """A trainer weight (2-D, floating point) in ``float8_e4m3fn`` with block scales."""

    __slots__ = ()

    def __init__(self, source: Any, block: tuple[int, int]) -> None:
        import torch

        super().__init__(source, block)
        self.shape = tuple(source.shape)
        self.dtype = torch.float8_e4m3fn

    def __repr__(self) -> str:
        return f"<Fp8Weight shape={list(self.shape)} block={list(self.block)}>"

    def copy_into(self, out: torch.Tensor, copy: CopyPiece) -> None:
        weight = _read(self.sources[0])
        if out.is_contiguous() and out.dtype == self.dtype and out.device == weight.device:
            fp8_block_quantize(weight, self.block, out=out)  # stored as it is computed
        else:
            out.copy_(fp8_block_quantize(weight, self.block)[0])


class Fp8Scales(_Quantized):
    """The ``float32`` block scales of a trainer weight (its ``weight_scale_inv``)."""

    __slots__ = ()

    def __init__(self, source: Any, block: tuple[int, int]) -> None:
        import torch

        super().__init__(source, block)
        m, n = source.shape
        self.shape = (-(-m // block[0]), -(-n // block[1]))
        self.dtype = torch.float32

    def __repr__(self) -> str:
        return f"<Fp8Scales shape={list(self.shape)} block={list(self.block)}>"

    def copy_into(self, out: torch.Tensor, copy: CopyPiece) -> None:
        out.copy_(fp8_block_scales(_read(self.sources[0]), self.block))


def quantize_tensors(
    tensors: Mapping[str, Any],
    quantized: Callable[[str, tuple[int, ...]], bool],
    block: tuple[int, int],
    *,
    source: str,
) -> dict[str, Any]:
    """``tensors`` with each one ``quantized(name, shape)`` picks made FP8, followed by
    its scales (``name + "_scale_inv"``), in order.

    Raises :class:`~asyncrefit.PlanError` for a picked tensor that is not floating
    point, or whose scales' name the trainer already has.
    """
    from .._exceptions import PlanError

    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if not quantized(name, tuple(tensor.shape)):
            out[name] = tensor
            continue
        if not tensor.dtype.is_floating_point or tensor.dtype.itemsize < 2:
            raise PlanError(
                f"trainer source {source!r}: {name!r} is {tensor.dtype}, not a weight to "
                "quantize to FP8 (a float of 16 bits or more)"
            )
        scales = name + SCALE_SUFFIX
        if scales in tensors:
            raise PlanError(
                f"trainer source {source!r}: {name!r} is quantized, but the trainer already "
                f"has {scales!r}"
            )
        out[name] = Fp8Weight(tensor, block)
        out[scales] = Fp8Scales(tensor, block)
    return out
