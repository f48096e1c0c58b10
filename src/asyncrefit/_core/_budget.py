"""A byte-weighted, FIFO-fair async semaphore: the memory budget."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint_if_cancelled

from .._exceptions import CapacityExceededError


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetStatistics:
    """A snapshot of a :class:`ByteBudget`."""

    capacity: int
    in_use: int
    waiters: int
    peak: int


class _Waiter:
    __slots__ = ("event", "granted", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.event = anyio.Event()
        self.granted = False


class ByteBudget:
    """An async semaphore whose units are bytes.

    ``acquire(n)`` waits until ``n`` bytes are free and takes them; ``release(n)``
    gives them back. Waiters are served strictly in arrival order: a large request at
    the head is not overtaken by smaller ones behind it, so no request starves.

    Resource handling: a waiter cancelled before it is granted holds nothing; one
    cancelled in the instant after it was granted gives the bytes back before the
    cancellation propagates. Every buffer the coordinator packs into is reached only
    through a grant of this budget.

    Error handling: a request larger than the whole capacity can never be granted and
    raises :class:`CapacityExceededError` at once instead of waiting forever.
    Releasing more than is held raises :class:`RuntimeError` (a bug, not bad input).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:  # zero: nothing is staged (every worker is written directly)
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self._capacity = capacity
        self._in_use = 0
        self._peak = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def capacity(self) -> int:
        return self._capacity

    def statistics(self) -> BudgetStatistics:
        """Return a frozen snapshot: capacity, bytes in use, waiters, peak in use."""
        return BudgetStatistics(
            capacity=self._capacity,
            in_use=self._in_use,
            waiters=len(self._waiters),
            peak=self._peak,
        )

    def __repr__(self) -> str:
        return (
            f"<ByteBudget in_use={self._in_use}/{self._capacity} "
            f"waiters={len(self._waiters)} peak={self._peak}>"
        )

    def _take(self, nbytes: int) -> None:
        self._in_use += nbytes
        self._peak = max(self._peak, self._in_use)

    def _wake(self) -> None:
        while self._waiters and self._in_use + self._waiters[0].nbytes <= self._capacity:
            waiter = self._waiters.popleft()
            self._take(waiter.nbytes)
            waiter.granted = True
            waiter.event.set()

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` are free, then take them (first come, first served)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        if nbytes > self._capacity:
            raise CapacityExceededError(nbytes, self._capacity)
        await checkpoint_if_cancelled()
        if not self._waiters and self._in_use + nbytes <= self._capacity:
            self._take(nbytes)
            await cancel_shielded_checkpoint()
            return
        waiter = _Waiter(nbytes)
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release(nbytes)
            else:
                self._waiters.remove(waiter)
                self._wake()  # the head may have left: those behind may fit now
            raise

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken by :meth:`acquire` and wake waiters that now fit."""
        if nbytes < 0 or nbytes > self._in_use:
            raise RuntimeError(f"releasing {nbytes} bytes but {self._in_use} are in use")
        self._in_use -= nbytes
        self._wake()

    def release_slots(self, freed: Iterable[int], slot_bytes: int) -> None:
        """Give back ``slot_bytes`` for each slot in ``freed`` (slots no worker reads any
        more, as the ledger says), waking waiters that now fit."""
        for _ in freed:
            self.release(slot_bytes)

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Acquire ``nbytes`` for the duration of the ``async with`` block."""
        await self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)
