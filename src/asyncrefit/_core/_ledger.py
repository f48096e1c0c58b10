"""The coordinator's bookkeeping, as a pure state machine: who is in, who holds what.

Nothing here awaits or does I/O. The coordinator and its pushes ask the ledger first
(may this version be pushed? which slots does this ack free? whom must an abort
reach?), then carry out what they were told. Every slot operation goes through the
ledger's methods; ``slots`` is its table, exposed for inspection only. Workers are
tracked by their :class:`Member` record, compared by identity, never by name: a worker
added under the name of one that was removed is a different member, and cannot settle
what the old one still owes (a slot it may still read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._exceptions import AsyncRefitError, DuplicateWorkerError, UnknownWorkerError, VersionError
from ._slots import SlotTable

if TYPE_CHECKING:
    from .._device import DeviceId
    from .._protocols import Worker
    from ._plan import ParamSpec


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Member:
    """One worker's membership: what discovery found, and its identity for bookkeeping."""

    name: str
    worker: Worker
    device: DeviceId
    specs: tuple[ParamSpec, ...]

    def __repr__(self) -> str:
        return f"<Member {self.name!r} {self.device} at {id(self):#x}>"


@dataclass(frozen=True, slots=True, kw_only=True)
class Removal:
    """What removing a member needs done: settle its abort, or release its handles."""

    member: Member
    #: It never confirmed an abort: it may still read slots; retry the abort first.
    unsettled: bool


class Ledger:
    """Members, the version each holds, staging slots and their readers, open debts.

    ``last_version`` is the last version every member received completely;
    ``highest_begun`` the highest version any push began: a number is never used for
    two pushes, since a failed push may have left some workers committed to it.
    """

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.last_version: int | None = None
        self.highest_begun: int | None = None
        self.slots: SlotTable[Member] = SlotTable(0)
        self._versions: dict[Member, int | None] = {}
        # Members (current or removed) that may read slots and never confirmed an
        # abort, with the version to abort: their slots stay quarantined until then.
        self._unsettled: dict[Member, int] = {}
        # What the push in progress began over: the highest version begun before it,
        # and the version each member held (see restored, take_back).
        self._before: tuple[int | None, dict[Member, int | None]] = (None, {})

    def __repr__(self) -> str:
        return (
            f"<Ledger members={len(self.members)} version={self.last_version} "
            f"begun={self.highest_begun} {self.slots!r} unsettled={len(self._unsettled)}>"
        )

    # --- membership -------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        """Raise :class:`DuplicateWorkerError` if a member is named ``name``."""
        if name in self.members:
            raise DuplicateWorkerError(name)

    def admit(self, member: Member) -> None:
        """``member`` joins, holding no version until its first push."""
        self.check_name(member.name)
        self.members[member.name] = member
        self._versions[member] = None

    def remove(self, name: str) -> Removal:
        """``name`` leaves. Its slots stay quarantined until it settles."""
        member = self.members.pop(name, None)
        if member is None:
            raise UnknownWorkerError(name, self.members)
        self._versions.pop(member, None)
        return Removal(member=member, unsettled=member in self._unsettled)

    def versions(self) -> dict[str, int | None]:
        return {name: self._versions[m] for name, m in self.members.items()}

    # --- slots ------------------------------------------------------------------------

    def check_replan(self) -> None:
        """Raise :class:`AsyncRefitError` if workers may still read slots (no re-plan)."""
        if self.slots.quarantined():
            raise AsyncRefitError(
                "cannot re-plan while workers may still read slots: "
                f"{self.quarantined()}; remove those workers first"
            )

    def reset_slots(self, slots: int) -> None:
        """A new set of ``slots`` free slots (after a re-plan); none may be read."""
        self.check_replan()
        self.slots = SlotTable(slots)

    def has_free_slot(self) -> bool:
        """Whether a slot is neither taken nor read (else no push can start)."""
        return bool(self.slots.free())

    def take_slot(self) -> int:
        """Take the lowest free slot for a bucket (after the budget granted its bytes)."""
        return self.slots.take()

    def reading(self, slot: int, member: Member) -> None:
        """``member`` was sent the handle of ``slot`` and may read it from now on."""
        self.slots.reading(slot, member)

    def reads(self, slot: int, member: Member) -> bool:
        """Whether ``member`` may still be reading ``slot``."""
        return self.slots.reads(slot, member)

    def acked(self, slot: int, member: Member) -> bool:
        """``member`` acknowledged ``slot``'s bucket. True if the slot became free."""
        return self.slots.acked(slot, member)

    def finish_slot(self, slot: int) -> bool:
        """The bucket in ``slot`` is done (or failed). True if the slot is free now."""
        return self.slots.finish(slot)

    def quarantined(self) -> dict[int, frozenset[str]]:
        """Slots held back, with the names of the workers that may still read them."""
        return {
            slot: frozenset(m.name for m in readers)
            for slot, readers in self.slots.quarantined().items()
        }

    # --- a push -----------------------------------------------------------------------

    def check_version(self, version: int) -> None:
        """Raise :class:`VersionError` unless ``version`` is new."""
        if self.highest_begun is not None and version <= self.highest_begun:
            if self.highest_begun == self.last_version:
                raise VersionError(version, self.highest_begun)
            raise VersionError(version, self.highest_begun, failed=True)

    def begin(self, version: int) -> list[Member]:
        """A push of ``version`` begins: every member holds no complete version now.

        Returns the members to push to.
        """
        self.check_version(version)
        self._before = (self.highest_begun, dict(self._versions))
        self.highest_begun = version
        members = list(self.members.values())
        for member in members:
            self._versions[member] = None
        return members

    def restored(self, member: Member) -> None:
        """``member`` confirmed that it holds again what it held before this push began
        (it was told that no byte of the push was written: see
        :class:`~asyncrefit.abc.RestoringWorker`)."""
        if member in self._versions:
            self._versions[member] = self._before[1].get(member)

    def take_back(self, version: int) -> None:
        """No worker holds anything of ``version``, the push in progress (each one
        :meth:`restored`): its number may be pushed again."""
        if self.highest_begun == version:
            self.highest_begun = self._before[0]

    def committed(self, member: Member, version: int) -> None:
        if member in self._versions:
            self._versions[member] = version

    def complete(self, version: int) -> None:
        """Every member committed ``version``."""
        self.last_version = version

    def settled(self, member: Member) -> list[int]:
        """``member`` reads no slot any more (it confirmed an abort, or it is dead).

        Returns the slots that became free, whose budget the caller gives back.
        """
        self._unsettled.pop(member, None)
        return self.slots.worker_done(member)

    def aborting(self, member: Member, version: int) -> None:
        """An abort of ``version`` is being sent to ``member``.

        Until it confirms (also if the call is cut off), a member that may read a
        slot owes a confirmation: its slots stay quarantined and the abort is retried.
        """
        if self.slots.reads_any(member):
            self._unsettled[member] = version

    def unsettled(self) -> list[tuple[Member, int]]:
        """Members that owe an abort confirmation, with the version to abort."""
        return list(self._unsettled.items())

    def is_member(self, member: Member) -> bool:
        return self.members.get(member.name) is member
