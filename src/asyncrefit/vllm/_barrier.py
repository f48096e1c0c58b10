"""The rank barrier: an engine-wide step runs once every rank of the engine asked for it.

vLLM's weight-update calls are collective (every rank runs them, with the same
arguments), while the coordinator addresses each rank's worker on its own. A
:class:`RankBarrier` collects one request per rank under a step's key (``("begin", v)``,
``("load", v, bucket)``, ...); the rank whose request completes the set runs the step for
all of them, and every rank gets its own answer. With one rank a step runs at once.

Owns only the waiting ranks' bookkeeping; no I/O of its own (``run`` does it).

Errors: a step that failed is every waiting rank's failure, passed through
``translate`` (so that a rank names the rank that failed); the rank that ran it gets
its ``Exception`` translated too, and a ``BaseException`` (a cancellation) as it is,
while the others see it as an interrupted step. A rank asking twice for one step is an
:class:`~asyncrefit.AsyncRefitError`. :meth:`RankBarrier.drop` wakes ranks waiting for
steps that will never run (a push ended) with an ``AsyncRefitError``. Cancelling a
waiting rank leaves its request in the set (the step still runs once the others ask).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio

from .._exceptions import AsyncRefitError

Q = TypeVar("Q")
A = TypeVar("A")

#: What a waiting rank is told when its step will never run.
DROPPED = "the push ended before every rank asked for this step"


@dataclass(slots=True)
class _Gather(Generic[Q, A]):
    """One engine-wide step, waiting for every rank to ask for it."""

    requests: dict[int, Q] = field(default_factory=dict)
    done: anyio.Event = field(default_factory=anyio.Event)
    replies: dict[int, A] = field(default_factory=dict)
    error: BaseException | None = None


class RankBarrier(Generic[Q, A]):
    """Per-rank requests of engine-wide steps, gathered until every rank asked.

    ``name(rank)`` names a rank in errors; ``translate(exc, rank)`` turns a step's
    failure into the error ``rank`` raises.
    """

    def __init__(
        self,
        world: int,
        name: Callable[[int], str],
        translate: Callable[[BaseException, int], Exception],
    ) -> None:
        self.world = world
        self._name = name
        self._translate = translate
        self._gathers: dict[Hashable, _Gather[Q, A]] = {}

    def __len__(self) -> int:
        """Steps some rank asked for and that have not run yet."""
        return len(self._gathers)

    async def gather(
        self,
        key: Hashable,
        rank: int,
        request: Q,
        run: Callable[[dict[int, Q]], Awaitable[dict[int, A]]],
    ) -> A:
        """``rank``'s answer to step ``key``, once every rank asked for it.

        The last rank to ask calls ``run`` with every rank's request; the others wait
        for it.
        """
        gather = self._gathers.get(key)
        if gather is None:
            gather = self._gathers[key] = _Gather()
        if rank in gather.requests:
            raise AsyncRefitError(f"{self._name(rank)} asked for step {key} twice")
        gather.requests[rank] = request
        if len(gather.requests) < self.world:
            await gather.done.wait()
        else:
            del self._gathers[key]
            try:
                gather.replies = await run(dict(gather.requests))
            except BaseException as exc:
                gather.error = exc
                if isinstance(exc, Exception):
                    raise self._translate(exc, rank) from exc
                raise
            finally:
                gather.done.set()
        if gather.error is not None:
            raise self._translate(gather.error, rank) from gather.error
        return gather.replies[rank]

    def drop(self, which: Callable[[Hashable], bool] | None = None) -> None:
        """Wake ranks still waiting for steps that will never run (a push ended): the
        steps whose key ``which`` picks (default: every step)."""
        keys = [k for k in self._gathers if which is None or which(k)]
        gathers = [self._gathers.pop(k) for k in keys]
        for gather in gathers:
            gather.error = AsyncRefitError(DROPPED)
            gather.done.set()
