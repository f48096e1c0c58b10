"""Turning Ray actor handles into the objects a :class:`~asyncrefit.RefitCoordinator` takes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

from .._protocols import TrainerSource, Worker
from ._trainer import RayTrainerSource
from ._worker import RayWorker


def is_actor_handle(obj: object) -> bool:
    """Whether ``obj`` is a Ray actor handle (checked without importing Ray)."""
    return type(obj).__name__ == "ActorHandle" and type(obj).__module__.startswith("ray.")


def adapt(obj: Any, role: Literal["worker", "source"]) -> Worker | TrainerSource | None:
    """The ``asyncrefit.adapters`` entry point: wrap an actor handle, refuse the rest."""
    if not is_actor_handle(obj):
        return None
    return RayWorker(obj) if role == "worker" else RayTrainerSource(obj)


def as_worker(obj: Any, *, name: str | None = None) -> Worker:
    """``obj`` as a :class:`~asyncrefit.abc.Worker`: an actor handle is wrapped in
    :class:`RayWorker`.

    Anything else is returned unchanged.
    """
    if is_actor_handle(obj):
        return RayWorker(obj, name=name)
    if isinstance(obj, Worker):
        return obj
    raise TypeError(f"{obj!r} is neither a Worker nor a Ray actor handle")


def as_workers(actors: Iterable[Any], *, names: Sequence[str] | None = None) -> list[Worker]:
    """:func:`as_worker` of each of ``actors``, named ``names[i]`` when given."""
    items = list(actors)
    if names is not None and len(names) != len(items):
        raise ValueError(f"{len(names)} names for {len(items)} workers")
    return [as_worker(a, name=None if names is None else names[i]) for i, a in enumerate(items)]


def as_source(obj: Any, *, name: str | None = None) -> TrainerSource:
    """``obj`` as a :class:`~asyncrefit.abc.TrainerSource`: an actor handle is wrapped in
    :class:`RayTrainerSource`; anything else is returned unchanged."""
    if is_actor_handle(obj):
        return RayTrainerSource(obj, name=name)
    if isinstance(obj, TrainerSource):
        return obj
    raise TypeError(f"{obj!r} is neither a TrainerSource nor a Ray actor handle")
