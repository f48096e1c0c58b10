"""From the trainer's parameter names to the engine's: prefix stripping, renaming, selection.

Trainers name parameters after their wrappers (``_fsdp_wrapped_module.``,
``_orig_mod.`` from ``torch.compile``, ``module.`` from DDP), hold parameters the
engine must not get (a value head, a reference model), or name them another way
altogether. A :class:`NameMap` turns a trainer name into the engine's name, or drops
it; every trainer source applies one before the parameter set is planned, so the
coordinator validates the engine-named set against every worker before any byte moves.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ._exceptions import PlanError

#: Prefixes that wrappers add to parameter names (FSDP1, torch.compile, DDP,
#: activation checkpointing), stripped by ``NameMap(strip_prefixes=WRAPPER_PREFIXES)``.
WRAPPER_PREFIXES: tuple[str, ...] = (
    "_fsdp_wrapped_module.",
    "_orig_mod.",
    "_checkpoint_wrapped_module.",
    "module.",
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class NameMap:
    """Maps a trainer parameter name to the engine's name, or to ``None`` (not sent).

    In order: every ``strip_prefixes`` entry is removed wherever it starts a dotted
    component (``model._orig_mod.layers.0`` becomes ``model.layers.0``); ``rename``
    (a callable) maps the result, and may return ``None`` to drop the parameter; then
    the engine name must match one of ``include`` (``fnmatch`` patterns; ``None``:
    everything) and none of ``exclude``.

    A :class:`NameMap` is also what :func:`as_name_map` makes of a plain callable.
    """

    strip_prefixes: tuple[str, ...] = ()
    rename: Callable[[str], str | None] | None = None
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()

    def __call__(self, name: str) -> str | None:
        for prefix in self.strip_prefixes:
            name = _strip(name, prefix)
        if self.rename is not None:
            renamed = self.rename(name)
            if renamed is None:
                return None
            name = renamed
        if self.include is not None and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return None
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return None
        return name


def _strip(name: str, prefix: str) -> str:
    if name.startswith(prefix):
        name = name[len(prefix) :]
    return name.replace("." + prefix, ".")


def strip_wrappers(*, exclude: Iterable[str] = (), include: Iterable[str] | None = None) -> NameMap:
    """A :class:`NameMap` stripping :data:`WRAPPER_PREFIXES`, with a selection."""
    return NameMap(
        strip_prefixes=WRAPPER_PREFIXES,
        include=None if include is None else tuple(include),
        exclude=tuple(exclude),
    )


def as_name_map(names: Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    """``names`` as a name map (the identity when ``None``)."""
    return names if names is not None else _identity


def _identity(name: str) -> str:
    return name


def engine_named(
    tensors: Mapping[str, T], names: Callable[[str], str | None], *, source: str
) -> dict[str, T]:
    """``tensors`` under the engine's names, in order, without the dropped ones.

    Raises :class:`PlanError` naming both trainer parameters if two map to one name,
    or if the map returns something that is not a non-empty string.
    """
    out: dict[str, T] = {}
    origin: dict[str, str] = {}
    for trainer_name, value in tensors.items():
        engine_name = names(trainer_name)
        if engine_name is None:
            continue
        if not isinstance(engine_name, str) or not engine_name:
            raise PlanError(
                f"trainer source {source!r}: the name map made {engine_name!r} of "
                f"parameter {trainer_name!r}, not a parameter name"
            )
        if engine_name in out:
            raise PlanError(
                f"trainer source {source!r}: parameters {origin[engine_name]!r} and "
                f"{trainer_name!r} both map to {engine_name!r}"
            )
        out[engine_name] = value
        origin[engine_name] = trainer_name
    return out
