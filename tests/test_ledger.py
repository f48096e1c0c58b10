"""The ledger: membership by identity, version fencing, slots held while read; no I/O.

A stateful property test drives the ledger through random sequences of what a push
does (admit and remove workers, begin versions, take slots, send, ack, finish, abort,
confirm) against a small model, and checks after every step that the budget the
ledger hands back matches the slots that really became free, that a slot is never
free while someone may read it, and that versions are never reused.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from asyncrefit import (
    AsyncRefitError,
    DeviceId,
    DuplicateWorkerError,
    UnknownWorkerError,
    VersionError,
)
from asyncrefit._core._ledger import Ledger, Member

DEVICE = DeviceId(node="n", device="cpu:0")


def member(name: str) -> Member:
    return Member(name=name, worker=object(), device=DEVICE, specs=())  # type: ignore[arg-type]


def test_begins_taken_back_restore_versions_and_free_the_number() -> None:
    ledger = Ledger()
    a, b = member("a"), member("b")
    ledger.admit(a)
    ledger.admit(b)
    ledger.begin(1)
    ledger.committed(a, 1)
    ledger.committed(b, 1)
    ledger.complete(1)
    ledger.begin(2)
    assert ledger.versions() == {"a": None, "b": None}
    ledger.restored(a)  # a confirmed: it holds 1 again
    assert ledger.versions() == {"a": 1, "b": None}
    ledger.restored(b)
    ledger.take_back(2)  # nothing of 2 anywhere: the number is free
    assert ledger.versions() == {"a": 1, "b": 1}
    ledger.begin(2)
    ledger.restored(a)  # b did not confirm: 2 stays used
    with pytest.raises(VersionError):
        ledger.check_version(2)
    assert ledger.versions() == {"a": 1, "b": None}


def test_members_are_told_apart_by_identity_not_name() -> None:
    ledger = Ledger()
    ledger.reset_slots(1)
    old = member("w")
    ledger.admit(old)
    slot = ledger.slots.take()
    ledger.slots.reading(slot, old)
    ledger.aborting(old, 1)
    assert ledger.slots.finish(slot) is False
    removal = ledger.remove("w")
    assert removal.member is old and removal.unsettled
    new = member("w")
    ledger.admit(new)
    assert ledger.settled(new) == []  # the new "w" frees nothing of the old one's
    assert ledger.quarantined() == {slot: frozenset({"w"})}
    assert ledger.settled(old) == [slot]
    assert not ledger.is_member(old) and ledger.is_member(new)


def test_every_slot_operation_goes_through_the_ledger() -> None:
    ledger = Ledger()
    ledger.reset_slots(1)
    w = member("w")
    ledger.admit(w)
    assert ledger.has_free_slot()
    slot = ledger.take_slot()
    assert not ledger.has_free_slot()
    ledger.reading(slot, w)
    assert ledger.reads(slot, w)
    assert ledger.acked(slot, w) is False  # the bucket is not finished yet
    assert not ledger.reads(slot, w)
    assert ledger.finish_slot(slot) is True
    slot = ledger.take_slot()
    ledger.reading(slot, w)
    assert ledger.finish_slot(slot) is False  # w may still read it: quarantined
    with pytest.raises(AsyncRefitError, match="cannot re-plan while workers may still read"):
        ledger.check_replan()
    with pytest.raises(AsyncRefitError, match="cannot re-plan while workers may still read"):
        ledger.reset_slots(2)
    assert ledger.settled(w) == [slot]
    ledger.check_replan()
    ledger.reset_slots(2)


def test_version_fence_counts_versions_a_failed_push_began() -> None:
    ledger = Ledger()
    ledger.admit(member("w"))
    ledger.begin(3)
    ledger.complete(3)
    with pytest.raises(VersionError) as plain:
        ledger.check_version(3)
    assert not plain.value.failed
    ledger.begin(4)  # and it fails: never completed
    with pytest.raises(VersionError) as fenced:
        ledger.check_version(4)
    assert fenced.value.failed and fenced.value.current == 4
    ledger.check_version(5)


def test_duplicate_and_unknown_names() -> None:
    ledger = Ledger()
    ledger.admit(member("a"))
    with pytest.raises(DuplicateWorkerError):
        ledger.admit(member("a"))
    with pytest.raises(UnknownWorkerError, match=r"'b'.*'a'"):
        ledger.remove("b")


class LedgerMachine(RuleBasedStateMachine):
    """Random pushes, failures and membership changes against a model of the slots."""

    SLOTS = 3
    members = Bundle("members")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.ledger.reset_slots(self.SLOTS)
        self.in_flight = 0  # slots taken whose budget was not handed back
        self.busy: set[int] = set()  # taken, bucket not finished
        self.readers: dict[int, set[Member]] = {i: set() for i in range(self.SLOTS)}
        self.owing: set[Member] = set()  # aborted without confirming while reading
        self.begun: int | None = None
        self.version = 0

    def _free(self, freed: list[int]) -> None:
        for slot in freed:
            assert slot not in self.busy and not self.readers[slot], slot
        self.in_flight -= len(freed)

    @rule(target=members, name=st.sampled_from(["w0", "w1", "w2"]))
    def admit(self, name: str) -> Member:
        m = member(name)
        if name in self.ledger.members:
            with pytest.raises(DuplicateWorkerError):
                self.ledger.admit(m)
        else:
            self.ledger.admit(m)
        return m

    @rule(m=members)
    def remove(self, m: Member) -> None:
        if not self.ledger.is_member(m):
            return
        removal = self.ledger.remove(m.name)
        assert removal.member is m
        assert removal.unsettled == (m in self.owing)

    @rule(step=st.integers(min_value=-1, max_value=2))
    def begin(self, step: int) -> None:
        v = self.version + step
        if self.begun is not None and v <= self.begun:
            with pytest.raises(VersionError):
                self.ledger.begin(v)
            return
        self.ledger.begin(v)
        self.begun = self.version = v
        assert all(x is None for x in self.ledger.versions().values())

    @precondition(lambda self: self.ledger.slots.free())
    @rule()
    def take(self) -> None:
        slot = self.ledger.slots.take()
        assert slot not in self.busy and not self.readers[slot]
        self.busy.add(slot)
        self.in_flight += 1

    @rule(m=members, data=st.data())
    def send(self, m: Member, data: st.DataObject) -> None:
        if not self.busy or not self.ledger.is_member(m):
            return
        slot = data.draw(st.sampled_from(sorted(self.busy)))
        self.ledger.slots.reading(slot, m)
        self.readers[slot].add(m)

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        reading = [(s, m) for s, ms in self.readers.items() for m in ms]
        if not reading:
            return
        slot, m = data.draw(st.sampled_from(sorted(reading, key=lambda x: (x[0], id(x[1])))))
        became_free = self.ledger.slots.acked(slot, m)
        self.readers[slot].discard(m)
        assert became_free == (slot not in self.busy and not self.readers[slot])
        self._free([slot] if became_free else [])

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if not self.busy:
            return
        slot = data.draw(st.sampled_from(sorted(self.busy)))
        self.busy.discard(slot)
        if self.ledger.slots.finish(slot):
            self._free([slot])
        else:
            assert self.readers[slot]

    @rule(m=members)
    def abort_unconfirmed(self, m: Member) -> None:
        self.ledger.aborting(m, self.version)
        if any(m in ms for ms in self.readers.values()):
            self.owing.add(m)

    @rule(m=members)
    def confirmed_or_dead(self, m: Member) -> None:
        freed = self.ledger.settled(m)
        for ms in self.readers.values():
            ms.discard(m)
        self.owing.discard(m)
        self._free(freed)

    @invariant()
    def budget_matches_slots(self) -> None:
        held = {s for s in range(self.SLOTS) if s in self.busy or self.readers[s]}
        assert self.in_flight == len(held)
        assert set(self.ledger.slots.free()) == set(range(self.SLOTS)) - held

    @invariant()
    def quarantine_names_its_readers(self) -> None:
        want = {
            s: frozenset(m.name for m in ms)
            for s, ms in self.readers.items()
            if ms and s not in self.busy
        }
        assert self.ledger.quarantined() == want

    @invariant()
    def debts_are_the_models(self) -> None:
        assert {m for m, _ in self.ledger.unsettled()} == self.owing


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase
