"""Pickling the small frozen records that cross a process boundary at every bucket.

A frozen dataclass with ``slots=True`` pickles through a generated ``__getstate__``
and ``__setstate__`` that call :func:`dataclasses.fields` for every object, both
ways: for a handle and its entries that is most of what a bucket's notification
costs to encode and decode. :class:`FastPickle` pickles such a record as its class
and its field values in order (the names resolved once per class), and rebuilds it
the way the generated ``__setstate__`` does (without running ``__init__``): the same
objects, several times faster.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

_NAMES: dict[type, tuple[str, ...]] = {}


_CACHES: dict[type, tuple[tuple[str, Any], ...]] = {}


def _names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        # A field that is not compared (a cached hash) is this process's own: it is
        # not pickled, and starts again from its default in the process that unpickles.
        names = _NAMES[cls] = tuple(f.name for f in fields(cls) if f.compare)
        _CACHES[cls] = tuple((f.name, f.default) for f in fields(cls) if not f.compare)
    return names


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    obj: Any = object.__new__(cls)
    for name, value in zip(_names(cls), values, strict=True):
        object.__setattr__(obj, name, value)
    for name, default in _CACHES[cls]:
        object.__setattr__(obj, name, default)
    return obj


class FastPickle:
    """Mix into a frozen, slotted dataclass to pickle it as (class, field values)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        cls = type(self)
        return (_rebuild, (cls, tuple([getattr(self, n) for n in _names(cls)])))
