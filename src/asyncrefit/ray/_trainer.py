"""Trainer shards as Ray actors: the actor-side mixin and the coordinator's adapter."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio

from .._device import DeviceId
from .._exceptions import AsyncRefitError, SourceDiedError, SourceError, SourceRemoteError
from .._protocols import SourceInfo
from ..trainer._local import LocalTrainer, NamesLike, TensorsLike
from ..trainer._local import _reader as reader
from ..transport._base import Handle
from ._cluster import current_node_id, sweep_dead_process
from ._errors import source_errors
from ._group import GROUP_METHODS, GroupProbe, TrainerGroup, join, leave, probe
from ._order import BucketTurns
from ._worker import (
    check_actor_methods,
    check_async_methods,
    default_actor_name,
    is_awaitable_result,
)

if TYPE_CHECKING:
    from .._core._plan import Bucket, Plan
    from ..transport._base import Exporter
    from ..transport.destinations import Destinations

logger = logging.getLogger(__name__)

#: The methods a trainer actor serves; each must be ``async def``.
TRAINER_METHODS = (
    "refit_source_describe",
    "refit_source_prepare",
    "refit_source_export",
    "refit_source_close",
    "refit_source_attach",
    "refit_source_write",
    "refit_source_flush",
    "refit_source_detach",
)


def holds_dtensors(parameters: TensorsLike) -> bool:
    """Whether any of ``parameters`` (a module, a mapping, or a callable returning one,
    which is called once) is a ``DTensor``: a rank of a sharded trainer."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in reader(parameters)().values())


class RefitTrainerMixin:
    """Makes a Ray async actor a trainer shard that asyncrefit pushes from.

    Inherit it in your trainer actor class and call :meth:`init_refit_source` with the
    parameters to publish (from ``__init__``, or from a set-up method once the model
    is built)::

        class Trainer(RefitTrainerMixin):
            def __init__(self) -> None:
                self.model = make_model()
                self.init_refit_source(self.model, devices=["cpu:0"])

            async def train_step(self) -> float: ...

        actor = ray.remote(Trainer).options(num_cpus=1).remote()
        source = RayTrainerSource(actor)               # give this to RefitCoordinator

    Inside the actor a :class:`~asyncrefit.LocalTrainer` packs each bucket into a
    staging slot (shared memory by default) on its node; the coordinator is sent
    only small handles (segment names and layouts). The source's node is the actor's
    Ray node id, so only workers on that node (and, with ``devices``, on those
    devices) are routed to it. Give several shards (one per device, or per node)
    to one coordinator: each worker is served by the shard on its own device.

    A rank of a sharded trainer (FSDP2 ``fully_shard``, tensor parallel: its
    parameters are ``DTensor``\\ s) is served by a :class:`~asyncrefit.trainer.DTensorSource`
    instead: one trainer actor per rank, their process group formed by
    :func:`~asyncrefit.ray.init_trainer_group`. The coordinator then drives every
    rank's actor through every bucket in plan order, also a rank that serves no
    worker, and each rank gathers the bucket into its slot. Exports run on the actor
    in bucket order, whatever order Ray runs its calls in, so the ranks' gathers meet.

    Resource handling: packing runs in a thread, so the actor's loop keeps running
    (do not step the optimizer while a push is running). Slots are created by
    ``refit_source_prepare`` and unlinked by ``refit_source_close`` (the coordinator
    calls it on exit) or when the actor exits gracefully, which also destroys a
    process group joined through :func:`~asyncrefit.ray.init_trainer_group`. A killed
    actor's segments are removed by :class:`RayTrainerSource` when it finds the actor
    dead, and by any later exporter on that node (segment names carry the dead
    process's pid).

    Error handling: an export that waited for its bucket's turn when a new push began
    (or the source closed) raises :class:`~asyncrefit.AsyncRefitError`; a rank whose
    gather failed (a peer died or hangs) raises :class:`~asyncrefit.PackError` within
    the gather timeout (a :class:`~asyncrefit.SourceRemoteError` to the coordinator,
    which names a rank that died as the push's cause before its peers' failures).
    """

    _refit_source_: LocalTrainer | None = None
    _refit_exports_: BucketTurns | None = None
    _refit_in_group_: bool = False
    # The last description sent, and the token the driver names it by (see
    # refit_source_describe): unchanged, it is not sent again.
    _refit_described_: tuple[bytes, SourceInfo] | None = None
    _refit_trainer_methods: ClassVar[tuple[str, ...]] = TRAINER_METHODS + GROUP_METHODS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_async_methods(cls, cls._refit_trainer_methods)

    def init_refit_source(
        self,
        parameters: TensorsLike,
        *,
        devices: Iterable[str | DeviceId] | None = None,
        exporter: Exporter | None = None,
        name: str | None = None,
        names: NamesLike | None = None,
        sharded: bool | None = None,
        gather_timeout: float | None = None,
        node: str | None = None,
        checkpoint_names: bool = True,
    ) -> None:
        """Publish ``parameters`` (read afresh at every push) from this actor's node.

        ``devices`` limits the devices this shard serves (names such as ``"cpu:0"``
        or GPU UUIDs; default every device on the node). ``exporter`` picks the
        transport (default shared memory). ``names`` maps the trainer's parameter
        names to the engine's (a :class:`~asyncrefit.NameMap` such as
        :func:`~asyncrefit.strip_wrappers`, or a callable). ``name`` names the source
        in its own errors (default ``"trainer"``, or ``"rank-<rank>"`` for a rank).
        ``node`` is the node the slots live on (default this actor's Ray node id).
        ``checkpoint_names``: a ``transformers`` model is pushed under its checkpoint's
        names and layout (see :class:`~asyncrefit.LocalTrainer`).

        ``sharded`` picks the source: by default a rank of a sharded trainer (some
        parameter is a ``DTensor``; a callable is called once to look) is served by a
        :class:`~asyncrefit.trainer.DTensorSource`, anything else by a
        :class:`~asyncrefit.LocalTrainer`. ``sharded=True`` asks for a rank's source
        whatever the parameters are now (the model is sharded later, or this rank
        holds only plain tensors but must take part in every bucket), ``False`` for a
        plain one (a ``DTensor`` is then refused here). ``gather_timeout`` bounds each
        gather of a rank (default 60 s; keep it below the coordinator's ``timeout``).

        Error handling: ``ValueError`` for ``gather_timeout`` on a source that is
        not a rank's, or for ``sharded=False`` over ``DTensor`` parameters.
        """
        if sharded is None:
            sharded = holds_dtensors(parameters)
        elif not sharded and holds_dtensors(parameters):
            raise ValueError(
                "sharded=False, but some parameters are DTensors: a plain source cannot "
                "pack them (leave sharded unset)"
            )
        if gather_timeout is not None and not sharded:
            raise ValueError("gather_timeout applies to a sharded trainer's rank only")
        where = node if node is not None else current_node_id()
        if sharded:
            from ..trainer import DTensorSource

            self._refit_source_ = DTensorSource(
                parameters,
                exporter=exporter,
                devices=devices,
                node=where,
                name=name,
                names=names,
                timeout=60.0 if gather_timeout is None else gather_timeout,
                checkpoint_names=checkpoint_names,
            )
        else:
            self._refit_source_ = LocalTrainer(
                parameters,
                exporter=exporter,
                devices=devices,
                node=where,
                name="trainer" if name is None else name,
                names=names,
                checkpoint_names=checkpoint_names,
            )

    @property
    def refit_source(self) -> LocalTrainer:
        """The in-actor trainer source (a :class:`~asyncrefit.trainer.DTensorSource` for a rank)."""
        if self._refit_source_ is None:
            raise AsyncRefitError(
                f"{type(self).__name__}.init_refit_source(...) was not called in __init__"
            )
        return self._refit_source_

    def _refit_export_order(self) -> BucketTurns:
        if self._refit_exports_ is None:
            self._refit_exports_ = BucketTurns("an export")
        return self._refit_exports_

    async def refit_source_describe(
        self, known: bytes | None = None
    ) -> tuple[bytes, SourceInfo | None]:
        """Describe the source; the start of a push: its exports begin at bucket 0.

        Returns ``(token, info)``; when the source answered the very description it
        answered last time (a :class:`LocalTrainer` does while no name, shape or dtype
        changed) and the caller holds it (``known`` is its token), ``info`` is left out
        (``(known, None)``): the driver reuses its copy, and nothing is pickled.
        """
        source = self.refit_source
        await self._refit_export_order().restart()
        info = await source.describe()
        last = self._refit_described_
        if last is not None and last[1] is info:
            if known == last[0]:
                return last[0], None
            return last
        self._refit_described_ = (os.urandom(8), info)
        return self._refit_described_

    async def refit_source_prepare(
        self, plan: Plan, slots: int, slot_bytes: int, checksum: bool = False
    ) -> tuple[str, int]:
        """Allocate the slots; returns ``(Ray node id, pid)``: where they live, and their owner."""
        await self.refit_source.prepare(plan, slots, slot_bytes, checksum=checksum)
        return current_node_id(), os.getpid()

    async def refit_source_export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        """Pack ``bucket`` (after this push's bucket before it); one handle per device.

        ``devices`` may be empty: a rank that serves no worker still gathers.
        """
        source = self.refit_source
        async with self._refit_export_order().turn(bucket.index):
            return await source.export(bucket, slot, devices)

    async def refit_source_attach(
        self, worker: str, destinations: Destinations, plan: Plan
    ) -> bool:
        """Open ``worker``'s exported parameters: whether this source writes them."""
        return await self.refit_source.attach(worker, destinations, plan)

    async def refit_source_write(self, buckets: Sequence[Bucket], workers: Sequence[str]) -> None:
        """Write ``buckets`` into each of ``workers``' exported parameters."""
        await self.refit_source.write(buckets, workers)

    async def refit_source_flush(self, wait: bool = True) -> None:
        await self.refit_source.flush(wait=wait)

    async def refit_source_detach(self, worker: str) -> None:
        await self.refit_source.detach(worker)

    async def refit_source_close(self) -> None:
        source = self.refit_source
        await self._refit_export_order().restart()  # exports still waiting give up
        await source.aclose()

    # --- the trainers' process group (see init_trainer_group) ---------------------------

    async def refit_group_probe(self) -> GroupProbe:
        """This node's address, a free port on it, and whether this process is in a group."""
        await anyio.lowlevel.checkpoint()
        return probe()

    async def refit_group_join(self, rank: int, group: TrainerGroup, group_timeout: float) -> None:
        """Join ``group`` as ``rank`` (in a thread: it blocks until every rank joined)."""
        await anyio.to_thread.run_sync(join, rank, group, group_timeout)
        self._refit_in_group_ = True

    async def refit_group_leave(self) -> None:
        """Destroy this process's default group (if it has one)."""
        await anyio.to_thread.run_sync(leave)
        self._refit_in_group_ = False

    def __ray_shutdown__(self) -> None:
        # Ray calls this on a graceful exit, after pending tasks (not when killed).
        if self._refit_source_ is not None:
            self._refit_source_.exporter.close()
        if self._refit_in_group_:
            leave()
        parent = getattr(super(), "__ray_shutdown__", None)
        if parent is not None:
            parent()


class RayTrainerSource:
    """A :class:`~asyncrefit.abc.TrainerSource` backed by a Ray actor that uses
    :class:`RefitTrainerMixin`.

    Every call submits one actor task and awaits its ``ObjectRef`` on the caller's
    loop (never ``ray.get``). The source reports the actor's Ray node id, so the
    coordinator routes only workers on that node to it. ``name`` defaults to
    ``ClassName-<actor id prefix>`` and replaces the name the actor describes itself by.
    An actor whose class does not inherit :class:`RefitTrainerMixin` raises
    ``TypeError`` here.

    Resource handling: :meth:`aclose` asks the actor to unlink its segments. If the
    actor is dead (killed, crashed), its segments cannot be unlinked by it: a zero-CPU
    task on its node (recorded when the slots were prepared) removes them once its
    process is gone, bounded by ``sweep_timeout``. :meth:`aclose` is not shielded:
    bound it (the coordinator does, with its ``cleanup_timeout``). The actor itself
    belongs to the caller and is never killed here.

    Error handling: the actor dying raises :class:`SourceDiedError` naming it (during
    a push the coordinator raises :class:`~asyncrefit.PushError` with it as the
    cause, after aborting the workers; also when it was a rank of a sharded trainer
    whose peers' gathers failed first); an error inside the actor raises
    :class:`SourceRemoteError`. :meth:`aclose` logs errors instead of raising.
    """

    def __init__(self, actor: Any, *, name: str | None = None, sweep_timeout: float = 10.0) -> None:
        check_actor_methods(actor, TRAINER_METHODS, "asyncrefit.ray.RefitTrainerMixin")
        self._actor = actor
        self._name = name if name is not None else default_actor_name(actor)
        self._sweep_timeout = sweep_timeout
        self._process: tuple[str, int] | None = None
        self._on_device: set[str] = set()  # workers written directly on a GPU
        # The actor's last description (renamed) and its token: see describe.
        self._described: tuple[bytes, SourceInfo] | None = None

    def __repr__(self) -> str:
        return f"<RayTrainerSource {self._name!r} {self._actor!r}>"

    @property
    def name(self) -> str:
        return self._name

    @property
    def actor(self) -> Any:
        """The Ray actor handle."""
        return self._actor

    async def _call(self, method: str, *args: object) -> object:
        with source_errors(self._name):
            result: object = await getattr(self._actor, method).remote(*args)
        if is_awaitable_result(result):
            raise SourceRemoteError(
                self._name, "TypeError", f"{method} returned a {type(result).__name__}"
            )
        return result

    async def describe(self) -> SourceInfo:
        """The actor's description, renamed. While it is unchanged (the actor says so
        by the token of the last one) it is not sent again, and the same object is
        returned: the coordinator finds its plan current by identity."""
        last = self._described
        reply = await self._call("refit_source_describe", None if last is None else last[0])
        match reply:
            case (bytes() as token, None) if last is not None and token == last[0]:
                return last[1]
            case (bytes() as token, SourceInfo() as info):
                self._described = (token, dataclasses.replace(info, name=self._name))
                return self._described[1]
        raise SourceRemoteError(
            self._name,
            "TypeError",
            f"refit_source_describe returned {type(reply).__name__}, not (token, SourceInfo)",
        )

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        where = await self._call("refit_source_prepare", plan, slots, slot_bytes, checksum)
        if not isinstance(where, tuple) or len(where) != 2:
            raise SourceRemoteError(
                self._name, "TypeError", "refit_source_prepare did not return (node, pid)"
            )
        self._process = (str(where[0]), int(where[1]))  # whose segments to sweep if it dies

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        result = await self._call("refit_source_export", bucket, slot, tuple(devices))
        if not isinstance(result, tuple) or not all(isinstance(h, Handle) for h in result):
            raise SourceRemoteError(
                self._name, "TypeError", "refit_source_export did not return handles"
            )
        if len(result) != len(devices):
            raise SourceRemoteError(
                self._name,
                "ValueError",
                f"asked for {len(devices)} handles, got {len(result)}",
            )
        return result

    async def attach(self, worker: str, destinations: Destinations, plan: Plan) -> bool:
        """Have the actor open ``worker``'s exported parameters (same node only)."""
        result = await self._call("refit_source_attach", worker, destinations, plan)
        if not isinstance(result, bool):
            raise SourceRemoteError(self._name, "TypeError", "refit_source_attach: not a bool")
        if result and destinations.kind == "cuda_ipc":
            self._on_device.add(worker)
        return result

    async def write(self, buckets: Sequence[Bucket], workers: Sequence[str]) -> None:
        """One actor call per batch of buckets, whatever the number of workers written."""
        await self._call("refit_source_write", tuple(buckets), tuple(workers))

    async def flush(self, *, wait: bool = True) -> None:
        """End the writes issued on a GPU, as :meth:`LocalTrainer.flush
        <asyncrefit.trainer._direct.DirectWriter.flush>` (no call when no worker is on
        one)."""
        if self._on_device:
            await self._call("refit_source_flush", wait)

    async def detach(self, worker: str) -> None:
        self._on_device.discard(worker)
        await self._call("refit_source_detach", worker)

    async def aclose(self) -> None:
        """Unlink the actor's segments; sweep them from its node if it is dead. Idempotent."""
        # Not shielded: the caller bounds it (the coordinator with its cleanup_timeout).
        try:
            await self._call("refit_source_close")
        except SourceDiedError as exc:
            logger.warning("%s; removing its shared memory", exc)
            await self._sweep()
        except SourceError as exc:
            logger.warning("trainer source %s could not close: %s", self._name, exc)

    async def _sweep(self) -> None:
        if self._process is None:
            return  # never prepared: it created no segment through us
        node, pid = self._process
        await sweep_dead_process(self._name, node, pid, self._sweep_timeout)
