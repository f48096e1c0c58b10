"""Taking an actor's per-bucket calls in bucket order, whatever order Ray runs them in.

Ray guarantees no execution order for an async actor's calls: two calls submitted in
order may start in either order. A worker that receives a broadcast must take the
buckets in order, and a trainer rank must gather them in the same order as its peers
(a collective matched with another bucket's would hang, or, with equal sizes, mix
up data). :class:`BucketTurns` runs the calls numbered ``0, 1, 2, ...`` of one push
one after the other, in number order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from .._exceptions import AsyncRefitError


class BucketTurns:
    """The turns of one push's per-bucket calls: bucket ``k`` runs after ``k - 1`` ended.

    :meth:`restart` begins a new push (bucket 0 is next); a call still waiting for its
    turn then gives up with :class:`~asyncrefit.AsyncRefitError`. A call that fails
    still passes the turn on, so the next bucket fails fast rather than wait.

    Made lazily on the actor's loop (an actor's ``__init__`` may run elsewhere).
    Resource handling: holds no resource; passing the turn on is shielded from
    cancellation.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._condition: anyio.Condition | None = None
        self._next = 0
        self._epoch = 0

    def _turns(self) -> anyio.Condition:
        if self._condition is None:
            self._condition = anyio.Condition()
        return self._condition

    @property
    def next(self) -> int:
        """The bucket whose turn it is."""
        return self._next

    async def restart(self) -> None:
        """A new push (or an abort): bucket 0 is next; calls still waiting give up."""
        turns = self._turns()
        async with turns:
            self._next = 0
            self._epoch += 1
            turns.notify_all()

    @asynccontextmanager
    async def turn(self, bucket: int, version: int | None = None) -> AsyncIterator[None]:
        """Wait for ``bucket``'s turn, run the body, then pass the turn on."""
        turns = self._turns()
        epoch = self._epoch
        async with turns:
            while self._next != bucket:
                if self._epoch != epoch:
                    of = "" if version is None else f" of version {version}"
                    raise AsyncRefitError(
                        f"{self._what} of bucket {bucket}{of} waited for its turn, "
                        "but the push was aborted or a new one began"
                    )
                await turns.wait()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                async with turns:
                    if self._epoch == epoch:
                        self._next = bucket + 1  # also after a failure: fail fast
                    turns.notify_all()
