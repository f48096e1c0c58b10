"""A ``torch.distributed`` process group of the trainer actors, formed from the driver.

A sharded trainer (FSDP2, tensor parallel) needs its ranks in one process group: for
its own training collectives, and for the gathers of a refit (the ranks' sources
gather every bucket over the groups of their parameters' device mesh). With Ray the
ranks are trainer actors, started before anyone knows where rank 0 runs, so the
driver forms the group after the fact: :func:`init_trainer_group` asks rank 0's actor
for its node's address and a free port there, then has every actor join, concurrently.

The group is the default process group of each trainer actor's process
(``torch.distributed.init_process_group``), because ``fully_shard`` and
``init_device_mesh`` build on the default group. That process is the trainer's own:
inference engines (vLLM and its workers) run in other processes (actors of their
own), with their own default groups, and share neither a group nor a store with the
trainers; the store is rank 0's, on a port of its own. An actor whose process already
has a default group (an engine colocated in it, or a group formed by other code) is
refused before any actor joins: it is never joined or reused.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from .._exceptions import AsyncRefitError, SourceDiedError, one_error
from ._errors import source_errors
from ._worker import check_actor_methods, default_actor_name

#: The methods a trainer actor serves to join and leave the trainers' group.
GROUP_METHODS = ("refit_group_probe", "refit_group_join", "refit_group_leave")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerGroup:
    """A process group formed by :func:`init_trainer_group`: where its store is, and how big."""

    host: str
    port: int
    world_size: int
    backend: str | None

    @property
    def init_method(self) -> str:
        """``tcp://host:port``, as ``torch.distributed.init_process_group`` takes it."""
        return tcp_url(self.host, self.port)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupProbe:
    """What an actor tells before joining: its node's address, a free port, its state."""

    host: str
    port: int
    in_group: bool
    backend: str | None  # the backend of the group it is in already


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def probe() -> GroupProbe:
    """In an actor: this node's address, a port free on it now, and whether it is in a group."""
    import ray
    import torch.distributed as dist

    host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call, unused-ignore]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind(("", 0))
        port = int(s.getsockname()[1])
    joined = dist.is_available() and dist.is_initialized()
    return GroupProbe(
        host=host,
        port=port,
        in_group=joined,
        backend=str(dist.get_backend()) if joined else None,
    )


def join(rank: int, group: TrainerGroup, group_timeout: float) -> None:
    """In an actor: make ``group`` this process's default group (blocks until all joined)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise AsyncRefitError("this build of torch has no torch.distributed")
    if dist.is_initialized():
        raise AsyncRefitError(
            "this process already has a default process group: a trainer actor's group "
            "is formed once, in a process of its own (never an engine's)"
        )
    dist.init_process_group(
        backend=group.backend,
        init_method=group.init_method,
        rank=rank,
        world_size=group.world_size,
        timeout=datetime.timedelta(seconds=group_timeout),
    )


def leave() -> None:
    """In an actor: destroy this process's default group, if it has one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


async def init_trainer_group(
    actors: Sequence[Any],
    *,
    backend: str | None = None,
    host: str | None = None,
    port: int | None = None,
    group_timeout: float = 60.0,
) -> TrainerGroup:
    """Form one ``torch.distributed`` process group of ``actors``, rank ``i`` being ``actors[i]``.

    Every actor's class must inherit :class:`~asyncrefit.ray.RefitTrainerMixin`. The
    group's store listens on rank 0's node (its Ray node address, a port free there),
    unless ``host`` and ``port`` are given. ``backend`` is passed to
    ``init_process_group``: ``"gloo"`` on the CPU, ``"nccl"`` on GPUs; ``None`` (the
    default) lets torch pick (gloo for CPU tensors, and NCCL for CUDA tensors where
    CUDA is available). With NCCL, set each actor's CUDA device
    (``torch.cuda.set_device``) before it trains. Call it from the driver, before the
    actors shard their models (``fully_shard`` needs the group); then give the
    coordinator every actor's :class:`~asyncrefit.ray.RayTrainerSource`.

    The group becomes the default group of each actor's process (see the module's
    notes): an actor that is already in a group is refused before any actor joins.

    ``group_timeout`` is the group's timeout, as ``init_process_group`` takes it: it
    bounds joining and is the default bound of the group's collectives (the refit's
    gathers have their own, ``gather_timeout``).

    Resource handling: :func:`destroy_trainer_group` (or the actors' graceful exit)
    destroys it. On failure the actors that joined stay in the group: destroy it
    before trying again.

    Error handling: :class:`~asyncrefit.AsyncRefitError` for an actor already in a
    group; :class:`~asyncrefit.SourceDiedError` for an actor that died;
    :class:`~asyncrefit.SourceRemoteError` for a join that failed in an actor;
    ``TimeoutError`` when the group was not formed within ``group_timeout`` (plus a
    few seconds for Ray's calls).
    """
    if not actors:
        raise ValueError("no trainer actors to form a group of")
    if (host is None) != (port is None):
        raise ValueError("give both host and port, or neither")
    for actor in actors:
        check_actor_methods(actor, GROUP_METHODS, "asyncrefit.ray.RefitTrainerMixin")
    names = [default_actor_name(a) for a in actors]
    probes: list[GroupProbe | None] = [None] * len(actors)

    async def ask(i: int) -> None:
        with source_errors(names[i]):
            answer = await actors[i].refit_group_probe.remote()
        if not isinstance(answer, GroupProbe):
            raise AsyncRefitError(f"{names[i]}: refit_group_probe returned {answer!r}")
        probes[i] = answer

    async def enter(i: int, group: TrainerGroup) -> None:
        with source_errors(names[i]):
            await actors[i].refit_group_join.remote(i, group, group_timeout)

    with anyio.fail_after(group_timeout + 10.0):
        with one_error():
            async with anyio.create_task_group() as tg:
                for i in range(len(actors)):
                    tg.start_soon(ask, i)
        joined = [names[i] for i, p in enumerate(probes) if p is not None and p.in_group]
        if joined:
            raise AsyncRefitError(
                f"trainer actors {', '.join(joined)} already have a default process group; "
                "destroy it first (destroy_trainer_group), or form groups in fresh actors"
            )
        first = probes[0]
        assert first is not None
        group = TrainerGroup(
            host=first.host if host is None else host,
            port=first.port if port is None else port,
            world_size=len(actors),
            backend=backend,
        )
        with one_error():
            async with anyio.create_task_group() as tg:
                for i in range(len(actors)):
                    tg.start_soon(enter, i, group)
    return group


async def destroy_trainer_group(actors: Sequence[Any], *, within: float = 30.0) -> None:
    """Destroy the default process group of each of ``actors`` (those still alive).

    Bounded by ``within`` seconds; an actor that died is skipped. Error handling: an error
    raised in an alive actor raises :class:`~asyncrefit.SourceRemoteError`.
    """

    async def one(actor: Any) -> None:
        try:
            with source_errors(default_actor_name(actor)):
                await actor.refit_group_leave.remote()
        except SourceDiedError:
            pass  # its process, and its part of the group, are gone

    with anyio.fail_after(within), one_error():
        async with anyio.create_task_group() as tg:
            for actor in actors:
                tg.start_soon(one, actor)
