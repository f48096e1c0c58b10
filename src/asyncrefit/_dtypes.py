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


#: Floating-point dtypes a pack may cast between (``Tensor.copy_`` converts them):
#: fp32 master weights into a bf16 or fp16 engine, and the like. Packed and exponent-
#: only formats (``float4_e2m1fn_x2``, ``float8_e8m0fnu``) need scales a plain cast
#: does not make, so they are sent only as they are.
CASTABLE_FLOATS = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    }
)


def castable(source: str, target: str) -> bool:
    """Whether a trainer tensor of dtype ``source`` may be packed as ``target``.

    Always for the same dtype; otherwise only between the floating-point dtypes of
    :data:`CASTABLE_FLOATS` (never integer to float, float to integer, or to and from
    booleans, complex or packed formats, where a cast would change what the values mean).
    """
    return source == target or (source in CASTABLE_FLOATS and target in CASTABLE_FLOATS)


def cast_problem(source: torch.dtype, target: torch.dtype) -> str | None:
    """Why a tensor of ``source`` dtype must not be packed as ``target``, or ``None``.

    The rule is :func:`castable`'s; this form names both dtypes for an error message.
    """
    have, want = dtype_name(source), dtype_name(target)
    if castable(have, want):
        return None
    return f"{have} cannot be cast to {want} (only floating-point dtypes are cast)"
