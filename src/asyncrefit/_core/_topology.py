"""The topology of a refit: sources, plan, slots, and which source serves which worker.

A :class:`Topology` is an immutable value, computed by :func:`plan_topology` without
any I/O. Computing it validates everything that can be checked before a byte moves
(the sources agree on the parameter set, the budget holds the largest bucket, every
worker's device is served, every worker declares exactly the planned parameters). The
coordinator then prepares the sources' buffers for it and only then swaps it in:
a failed or cancelled re-plan leaves nothing half-committed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from .._device import DeviceId
from .._dtypes import castable
from .._exceptions import (
    BudgetTooSmallError,
    ParameterMismatchError,
    PlanError,
    UnknownDeviceError,
)
from .._protocols import RestoringWorker, SourceInfo
from ._ledger import Member
from ._plan import ParamSpec, Plan, plan_buckets, validate_worker


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """What a push follows; replaced whole, never changed in place."""

    infos: tuple[SourceInfo, ...]
    plan: Plan
    slots: int
    slot_bytes: int
    routes: Mapping[Member, int]  # the index of the source serving each member
    #: The members their source writes directly (see :class:`~asyncrefit.abc.WritingSource`).
    direct: frozenset[Member] = frozenset()
    #: The direct members that can take a begin back (:class:`~asyncrefit.abc.RestoringWorker`).
    restoring: frozenset[Member] = frozenset()

    @property
    def exporting_sources(self) -> tuple[int, ...]:
        """The sources that export buckets in a push: those serving a staged member,
        and every rank of a sharded trainer (none when every member is written directly)."""
        used = {s for m, s in self.routes.items() if m not in self.direct}
        used |= {i for i, info in enumerate(self.infos) if info.gathers}
        return tuple(sorted(used))

    def direct_groups(self) -> dict[int, tuple[Member, ...]]:
        """The directly written members, by the index of the source that writes them."""
        groups: dict[int, list[Member]] = {}
        for member, source in self.routes.items():
            if member in self.direct:
                groups.setdefault(source, []).append(member)
        return {s: tuple(ms) for s, ms in groups.items()}

    def with_direct(self, members: Iterable[Member]) -> Topology:
        """This topology with ``members`` written directly by their sources.

        With no member staged (and no sharded trainer), no slot is needed.
        """
        direct = frozenset(members)
        staged = any(m not in direct for m in self.routes)
        gathers = any(info.gathers for info in self.infos)
        restoring = frozenset(m for m in direct if isinstance(m.worker, RestoringWorker))
        return replace(
            self,
            direct=direct,
            restoring=restoring,
            slots=self.slots if staged or gathers else 0,
        )

    @property
    def begins_ahead(self) -> bool:
        """Whether a push may begin its workers before it read the trainer's tensors:
        every member is written directly and can take its begin back (no source
        exports, so nothing but the writes follows the begins)."""
        return (
            bool(self.routes)
            and len(self.restoring) == len(self.routes)
            and not any(info.gathers for info in self.infos)
        )

    @property
    def used_sources(self) -> tuple[int, ...]:
        """The sources a push drives: those serving a member (the first one when none
        does), and every rank of a sharded trainer (its gathers need every rank)."""
        used = set(self.routes.values()) | {i for i, info in enumerate(self.infos) if info.gathers}
        return tuple(sorted(used)) or (0,)

    @property
    def gathers(self) -> bool:
        """Whether some source's exports are collectives with other sources."""
        return any(info.gathers for info in self.infos)

    def with_member(self, member: Member) -> Topology:
        """This topology with ``member`` routed and validated (raises as planning does)."""
        source = route(self.infos, member)
        validate_worker(self.plan.specs, member.name, member.specs)
        split = self.plan.split
        if split:
            whole = sorted(s.name for s in member.specs if s.name in split and not s.parts)
            if whole:
                raise ParameterMismatchError(
                    member.name,
                    whole[0],
                    "it is sent in parts (it is larger than a bucket), and this worker "
                    "takes it only whole",
                )
        return replace(self, routes=MappingProxyType({**self.routes, member: source}))

    def without(self, member: Member) -> Topology:
        routes = {m: s for m, s in self.routes.items() if m is not member}
        return replace(
            self,
            routes=MappingProxyType(routes),
            direct=self.direct - {member},
            restoring=self.restoring - {member},
        )

    def devices_to_export(self, source: int, *, every_device: bool) -> list[DeviceId]:
        """The devices ``source`` exports handles for: its members' (all, with
        ``every_device``, for the broadcast-all baseline)."""
        mine = {m.device for m, s in self.routes.items() if s == source and m not in self.direct}
        info = self.infos[source]
        if every_device and info.devices is not None:
            mine |= {DeviceId(node=info.node, device=d) for d in info.devices}
        return sorted(mine)


def route(infos: Sequence[SourceInfo], member: Member) -> int:
    """The first source that serves ``member``'s device."""
    for i, info in enumerate(infos):
        if info.serves(member.device):
            return i
    raise UnknownDeviceError(
        member.name,
        member.device,
        [f"{i.node}/{'*' if i.devices is None else ','.join(sorted(i.devices))}" for i in infos],
    )


def wire_specs(trainer: Sequence[ParamSpec], members: Iterable[Member]) -> tuple[ParamSpec, ...]:
    """The trainer's parameters in the dtypes the workers hold them in: what is sent.

    A parameter no worker declares keeps the trainer's dtype (validation then finds the
    worker that lacks it). Raises :class:`ParameterMismatchError` if two workers hold a
    parameter in different dtypes, or if the trainer's dtype cannot be cast to the
    workers' (see :func:`~asyncrefit._dtypes.castable`).
    """
    held: dict[str, tuple[str, str]] = {}  # name -> (dtype, the first worker holding it)
    for member in members:
        for spec in member.specs:
            first = held.setdefault(spec.name, (spec.dtype, member.name))
            if first[0] != spec.dtype:
                raise ParameterMismatchError(
                    member.name,
                    spec.name,
                    f"dtype {spec.dtype} on the worker, {first[0]} on worker {first[1]!r}",
                )
    wire = []
    for spec in trainer:
        dtype, worker = held.get(spec.name, (spec.dtype, ""))
        scales = _scales_of(spec.name, held) if dtype.startswith("float8") else None
        if scales is not None and not spec.dtype.startswith("float8"):
            raise ParameterMismatchError(
                worker,
                spec.name,
                f"{dtype} with scales ({scales!r}) on the worker, {spec.dtype} on the "
                "trainer: a cast would leave the scales out; quantize on the trainer "
                "(LocalTrainer(..., quantization=asyncrefit.quantization.Fp8Blocks(...)))",
            )
        if not castable(spec.dtype, dtype):
            raise ParameterMismatchError(
                worker,
                spec.name,
                f"dtype {dtype} on the worker cannot be packed from {spec.dtype} on the "
                "trainer (only floating-point dtypes are cast)",
            )
        wire.append(spec if dtype == spec.dtype else replace(spec, dtype=dtype))
    return tuple(wire)


def _scales_of(name: str, held: Mapping[str, object]) -> str | None:
    """The name of the scales a worker holds with FP8 weight ``name``, if any."""
    base = name.removesuffix(".weight")
    for scales in (f"{name}_scale_inv", f"{name}_scale", f"{base}.weight_scale"):
        if scales in held:
            return scales
    return None


def splittable(members: Sequence[Member]) -> frozenset[str]:
    """The parameters every worker takes in parts (see :attr:`ParamSpec.parts`)."""
    if not members:
        return frozenset()
    names: set[str] | None = None
    for member in members:
        own = {s.name for s in member.specs if s.parts}
        names = own if names is None else names & own
    return frozenset(names or ())


def plan_topology(
    infos: Sequence[SourceInfo],
    members: Iterable[Member],
    *,
    budget_bytes: int,
    bucket_bytes: int,
    alignment: int,
) -> Topology:
    """Plan buckets and slots for ``infos`` and route and validate every member.

    The plan is in the workers' dtypes (:func:`wire_specs`): a trainer holding fp32
    master weights packs them cast to a bf16 engine's dtype. Raises :class:`PlanError`
    (sources disagree, budget too small for a source that stages, a worker's
    parameters do not match or cannot be cast to) or :class:`UnknownDeviceError`; pure.
    """
    members = list(members)
    if not infos:
        raise PlanError("there is no trainer source")
    specs = infos[0].specs
    for info in infos[1:]:
        if info.specs != specs:
            raise PlanError(
                f"trainer sources {infos[0].name!r} and {info.name!r} hold different parameter sets"
            )
    staged = any(info.stages for info in infos)
    # Parts go into staging slots: only when every source stages (a zero-copy source's
    # parameters are its buckets' memory, one tensor each) and can pack rows.
    split = all(info.stages and info.splits for info in infos)
    parts = splittable(members) if split else frozenset()
    plan = plan_buckets(
        wire_specs(specs, members), bucket_bytes, alignment=alignment, splittable=parts
    )
    slot_bytes = max(1, plan.max_bucket_bytes)
    if staged and slot_bytes > budget_bytes:
        largest = max(plan.buckets, key=lambda b: b.nbytes)
        what = f"bucket {largest.index}"
        if len(largest.entries) == 1:
            entry = largest.entries[0]
            what = f"parameter {entry.label!r}"
            if entry.part is None and entry.name in parts:
                what += ", one row of which is larger than a bucket"
            elif entry.part is None:
                refusing = sorted(
                    m.name
                    for m in members
                    if not any(s.name == entry.name and s.parts for s in m.specs)
                )
                if refusing:
                    what += f", which worker {refusing[0]!r} takes only whole"
        raise BudgetTooSmallError(budget_bytes, slot_bytes, what)
    topology = Topology(
        infos=tuple(infos),
        plan=plan,
        # Without staging (zero-copy sources only) the budget bounds no memory: every
        # bucket may be in flight.
        slots=max(
            1, min(budget_bytes // slot_bytes if staged else len(plan.buckets), len(plan.buckets))
        ),
        slot_bytes=slot_bytes,
        routes=MappingProxyType({}),
    )
    for member in members:
        topology = topology.with_member(member)
    return topology
