"""SlotTable: which staging slots are free, busy or quarantined behind readers."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncrefit._core._slots import SlotTable


def test_new_table_is_all_free() -> None:
    table = SlotTable[str](3)
    assert len(table) == 3
    assert table.free() == [0, 1, 2]
    assert table.quarantined() == {}


def test_take_lowest_free_and_exhaustion() -> None:
    table = SlotTable[str](2)
    assert table.take() == 0
    assert table.free() == [1]
    assert table.take() == 1
    assert table.free() == []
    with pytest.raises(RuntimeError, match="no free slot"):
        table.take()
    assert table.finish(1) is True
    assert table.free() == [1]
    assert table.take() == 1


def test_zero_slots_cannot_be_taken() -> None:
    with pytest.raises(RuntimeError):
        SlotTable[str](0).take()


def test_normal_path_acks_then_finish() -> None:
    table = SlotTable[str](2)
    slot = table.take()
    table.reading(slot, "w0")
    table.reading(slot, "w1")
    assert table.acked(slot, "w0") is False  # still busy, w1 still reading
    assert table.acked(slot, "w1") is False  # still busy
    assert table.quarantined() == {}
    assert slot not in table.free()
    assert table.finish(slot) is True
    assert slot in table.free()


def test_finish_then_last_ack_frees() -> None:
    table = SlotTable[str](1)
    slot = table.take()
    table.reading(slot, "w0")
    table.reading(slot, "w1")
    table.acked(slot, "w0")
    assert table.finish(slot) is False
    assert table.quarantined() == {slot: frozenset({"w1"})}
    assert table.free() == []
    with pytest.raises(RuntimeError):
        table.take()
    assert table.acked(slot, "w1") is True
    assert table.free() == [slot]
    assert table.quarantined() == {}


def test_finished_with_unacked_reader_stays_quarantined_until_worker_done() -> None:
    table = SlotTable[str](3)
    a, b, c = table.take(), table.take(), table.take()
    for slot in (a, b):
        table.reading(slot, "dead")
        table.reading(slot, "alive")
    table.reading(c, "dead")
    table.acked(a, "alive")
    assert table.finish(a) is False
    assert table.finish(b) is False
    assert table.quarantined() == {a: frozenset({"dead"}), b: frozenset({"dead", "alive"})}
    assert table.free() == []
    # The dead worker is gone: a is free, b still waits for "alive", c is still busy.
    assert table.worker_done("dead") == [a]
    assert table.free() == [a]
    assert table.quarantined() == {b: frozenset({"alive"})}
    assert table.finish(c) is True
    assert table.worker_done("alive") == [b]
    assert table.free() == [a, b, c]
    assert table.worker_done("nobody") == []


def test_worker_done_on_busy_slot_does_not_free_it() -> None:
    table = SlotTable[str](1)
    slot = table.take()
    table.reading(slot, "w0")
    assert table.worker_done("w0") == []
    assert table.free() == []
    assert table.finish(slot) is True


def test_ack_from_unknown_worker_is_harmless() -> None:
    table = SlotTable[str](1)
    slot = table.take()
    table.reading(slot, "w0")
    table.finish(slot)
    assert table.acked(slot, "stranger") is False
    assert table.quarantined() == {slot: frozenset({"w0"})}


def test_repr_counts() -> None:
    table = SlotTable[str](2)
    slot = table.take()
    table.reading(slot, "w")
    table.finish(slot)
    assert repr(table) == "<SlotTable slots=2 free=1 quarantined={0: frozenset({'w'})}>"


WORKERS = ("w0", "w1", "w2")
N_SLOTS = 3


class SlotMachine(RuleBasedStateMachine):
    """Random take/reading/acked/finish/worker_done sequences against a simple model.

    The model says who *may* read each slot: a worker from the moment it is sent the
    handle until it acks or is known to be done. A slot may be free only when it is not
    busy and nobody may read it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.table = SlotTable[str](N_SLOTS)
        self.busy: set[int] = set()
        self.readers: dict[int, set[str]] = {i: set() for i in range(N_SLOTS)}

    def model_free(self) -> list[int]:
        return [i for i in range(N_SLOTS) if i not in self.busy and not self.readers[i]]

    @rule()
    def take(self) -> None:
        free = self.model_free()
        if free:
            slot = self.table.take()
            assert slot == free[0]
            self.busy.add(slot)
        else:
            with pytest.raises(RuntimeError):
                self.table.take()

    @precondition(lambda self: bool(self.busy))
    @rule(data=st.data(), worker=st.sampled_from(WORKERS))
    def reading(self, data: st.DataObject, worker: str) -> None:
        slot = data.draw(st.sampled_from(sorted(self.busy)))
        self.table.reading(slot, worker)
        self.readers[slot].add(worker)

    @rule(slot=st.integers(0, N_SLOTS - 1), worker=st.sampled_from(WORKERS))
    def acked(self, slot: int, worker: str) -> None:
        freed = self.table.acked(slot, worker)
        self.readers[slot].discard(worker)
        assert freed == (slot in self.model_free())

    @precondition(lambda self: bool(self.busy))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.busy)))
        freed = self.table.finish(slot)
        self.busy.discard(slot)
        assert freed == (not self.readers[slot])

    @rule(worker=st.sampled_from(WORKERS))
    def worker_done(self, worker: str) -> None:
        before = set(self.model_free())
        freed = self.table.worker_done(worker)
        for readers in self.readers.values():
            readers.discard(worker)
        assert freed == sorted(set(self.model_free()) - before)

    @invariant()
    def never_free_while_readable(self) -> None:
        free = self.table.free()
        for slot in free:
            assert not self.readers[slot], (slot, self.readers[slot])
            assert slot not in self.busy
        assert free == self.model_free()
        assert self.table.quarantined() == {
            i: frozenset(r) for i, r in self.readers.items() if r and i not in self.busy
        }


SlotMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestSlotMachine = SlotMachine.TestCase


def test_reads_tells_who_may_still_read_a_slot() -> None:
    table: SlotTable[str] = SlotTable(2)
    slot = table.take()
    table.reading(slot, "a")
    table.reading(slot, "b")
    table.acked(slot, "a")
    assert not table.reads(slot, "a") and table.reads(slot, "b")
    assert not table.reads(1 - slot, "b")
