"""Which staging slots are free, being packed, or still being read: a pure state machine.

The coordinator takes a slot after the budget granted its bytes, records every worker
it sends the slot's handle to, and hands the slot back when the bucket is done. A slot
goes back to the free list only once no worker may still be reading it: on the normal
path after every ack; after a failure only when each reader has acknowledged an abort
or is known to be gone. Until then it is *quarantined*, and its budget stays taken.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

#: What identifies a reader: the coordinator uses the worker's membership record (by
#: identity), so that a new worker under an old name is never taken for the old one.
K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Slot(Generic[K]):
    busy: bool = False  # taken by a bucket that is not finished yet
    readers: set[K] = field(default_factory=set)


class SlotTable(Generic[K]):
    """Slots ``0..n-1`` and the workers that may be reading each one."""

    def __init__(self, slots: int) -> None:
        self._slots: list[_Slot[K]] = [_Slot() for _ in range(slots)]

    def __len__(self) -> int:
        return len(self._slots)

    def __repr__(self) -> str:
        return (
            f"<SlotTable slots={len(self._slots)} free={len(self.free())} "
            f"quarantined={self.quarantined()}>"
        )

    def free(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if not s.busy and not s.readers]

    def quarantined(self) -> dict[int, frozenset[K]]:
        """Finished slots that workers may still be reading, with those workers."""
        return {
            i: frozenset(s.readers) for i, s in enumerate(self._slots) if not s.busy and s.readers
        }

    def take(self) -> int:
        """Take the lowest free slot. Raises ``RuntimeError`` if none is free."""
        for i, s in enumerate(self._slots):
            if not s.busy and not s.readers:
                s.busy = True
                return i
        raise RuntimeError("no free slot: the budget granted more than the slots hold")

    def reading(self, slot: int, worker: K) -> None:
        """``worker`` was sent the handle of ``slot`` and may read it from now on."""
        self._slots[slot].readers.add(worker)

    def reads(self, slot: int, worker: K) -> bool:
        """Whether ``worker`` may still be reading ``slot``."""
        return worker in self._slots[slot].readers

    def acked(self, slot: int, worker: K) -> bool:
        """``worker`` finished reading ``slot``. True if the slot became free."""
        s = self._slots[slot]
        s.readers.discard(worker)
        return not s.busy and not s.readers

    def finish(self, slot: int) -> bool:
        """The bucket in ``slot`` is done (or failed). True if the slot is free now."""
        s = self._slots[slot]
        s.busy = False
        return not s.readers

    def reads_any(self, worker: K) -> bool:
        """Whether ``worker`` may be reading some slot."""
        return any(worker in s.readers for s in self._slots)

    def worker_done(self, worker: K) -> list[int]:
        """``worker`` reads nothing any more (aborted, or gone): the slots freed by that."""
        freed = []
        for i, s in enumerate(self._slots):
            if worker in s.readers:
                s.readers.discard(worker)
                if not s.busy and not s.readers:
                    freed.append(i)
        return freed
