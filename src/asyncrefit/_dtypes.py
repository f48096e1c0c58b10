"""Dtypes by name: the one place that maps ``"bfloat16"`` to a ``torch.dtype`` and a size.

Specs, plans and handles name dtypes by their canonical torch name without the
``torch.`` prefix (``"float8_e4m3fn"``), so that planning stays pure. Sizes come from
torch itself (``torch.dtype.itemsize``), never from a table of our own, so every dtype
the installed torch has is known. torch is imported on first use only: importing this
module (and the planner) does not import torch.

A *packed* dtype such as ``float4_e2m1fn_x2`` holds several values per element; its
shape counts elements as torch does (a ``(4, 8)`` tensor of it is 32 bytes and holds 64
four-bit values), and its item size is torch's element size, 1.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from ._exceptions import PlanError

if TYPE_CHECKING:
    import torch

#: Quantized dtypes: their scale and zero point live outside the bytes, which a copy of
#: the bytes would lose.
_QUANTIZED_PREFIXES = ("qint", "quint")


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a ``torch.dtype`` without the ``torch.`` prefix (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


@cache
def _lookup(name: str) -> torch.dtype | None:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype_name(dtype) != name:
        return None  # not a dtype, or an alias ("half", "float"): only canonical names
    return dtype


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` named ``name`` (its canonical name, ``"bfloat16"``).

    Raises ``ValueError`` if torch has no dtype of that canonical name.
    """
    dtype = _lookup(name)
    if dtype is None:
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


@cache
def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype named ``name``, as torch reports them.

    Raises :class:`PlanError` for a name that is not a canonical torch dtype name
    (``"half"``, ``"torch.float32"``, ``"float128"``) and for quantized dtypes, whose
    bytes alone do not carry their values.
    """
    dtype = _lookup(name)
    if dtype is None:
        raise PlanError(f"unsupported dtype {name!r}: not a torch dtype of this name")
    if name.startswith(_QUANTIZED_PREFIXES):
        raise PlanError(
            f"unsupported dtype {name!r}: a quantized tensor's scale and zero point "
            "are not in its bytes"
        )
    return int(dtype.itemsize)


def _kind(dtype: torch.dtype) -> str:
    import torch

    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating-point"
    if dtype == torch.bool:
        return "boolean"
    return "integer"


def cast_problem(source: torch.dtype, target: torch.dtype) -> str | None:
    """Why a tensor of ``source`` dtype must not be cast into ``target``, or ``None``.

    A cast keeps the kind of value: floating point into floating point (fp32 master
    weights into a bf16 or fp8 engine), integer into integer, complex into complex.
    Between kinds (integer and floating point, complex and real, boolean and anything)
    it would change what the values mean rather than their precision: refused. Whether
    torch can carry out an allowed cast (packed and sub-byte dtypes it cannot) is
    learnt from the copy itself.
    """
    if source == target:
        return None
    have, want = _kind(source), _kind(target)
    if have != want:
        return f"{dtype_name(source)} cannot be cast to {dtype_name(target)} ({have} to {want})"
    return None
