"""Public names report the module a user imports them from, not the private one.

Tracebacks and reprs then say ``asyncrefit.VersionError``, not
``asyncrefit._exceptions.VersionError`` (as anyio and trio do). Pickling is unaffected
in effect: each renamed object is reachable under its new module and name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def fix_modules(namespace: Mapping[str, Any], names: Iterable[str]) -> None:
    """Set ``__module__`` of the classes and functions in ``names`` to the namespace's."""
    module = namespace["__name__"]
    for name in names:
        value = namespace[name]
        if isinstance(value, type) or callable(value):
            current = getattr(value, "__module__", None)
            if not isinstance(current, str):
                continue
            parts = current.split(".")
            if parts[0] == "asyncrefit" and any(p.startswith("_") for p in parts[1:]):
                try:
                    value.__module__ = module
                except (AttributeError, TypeError):  # builtins and C types
                    pass
