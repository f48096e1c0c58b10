"""Adapters: plug-ins that turn foreign objects into workers and trainer sources.

The coordinator takes :class:`~asyncrefit.abc.Worker` and
:class:`~asyncrefit.abc.TrainerSource` objects; an integration (Ray's actor handles, say)
may hand it objects of its own instead. An adapter is looked up by the top-level
package of the object's type, before the protocols are checked (a proxy such as an
actor handle answers to any method name, so it would pass for either protocol).

Adapters come from the entry-point group ``asyncrefit.adapters`` (name: the
top-level package, value: ``module:callable``; ``asyncrefit[ray]`` registers
``ray``), read once per process, and from :func:`register_adapter`. An adapter is
called as ``adapter(obj, role)`` with ``role`` ``"worker"`` or ``"source"`` and
returns the wrapped object, or ``None`` for an object it does not take. Its module is
imported only when an object of its package comes.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Literal, TypeAlias

logger = logging.getLogger(__name__)

Role: TypeAlias = Literal["worker", "source"]
Adapter: TypeAlias = Callable[[Any, Role], Any]

GROUP = "asyncrefit.adapters"

_registered: dict[str, Adapter | str] = {}
_discovered = False


def register_adapter(package: str, adapter: Adapter | str) -> None:
    """Adapt objects whose type comes from ``package`` with ``adapter``.

    ``adapter`` is a callable or a ``"module:callable"`` string (imported at first
    use). A later registration for the same package replaces the earlier one.
    """
    _registered[package] = adapter


def _table() -> dict[str, Adapter | str]:
    global _discovered
    if not _discovered:
        _discovered = True
        for entry in entry_points(group=GROUP):
            _registered.setdefault(entry.name, entry.value)
    return _registered


def _load(package: str) -> Adapter:
    adapter = _table()[package]
    if isinstance(adapter, str):
        module, _, attr = adapter.partition(":")
        adapter = getattr(importlib.import_module(module), attr)
        assert callable(adapter)
        _registered[package] = adapter
    return adapter


def adapt(obj: Any, role: Role) -> Any:
    """``obj`` wrapped by the adapter of its type's package, or ``obj`` itself."""
    package = type(obj).__module__.partition(".")[0]
    if package not in _table():
        return obj
    adapted = _load(package)(obj, role)
    return obj if adapted is None else adapted
