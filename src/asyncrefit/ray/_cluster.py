"""Where an actor runs (its Ray node) and cleaning up after actors that died there.

Shared-memory segments live in one node's ``/dev/shm``; a trainer actor that is
killed (``ray.kill``, SIGKILL, OOM) cannot unlink its own. Segment names carry the
creating process's pid, so a small task scheduled on that node can remove them once
the process is gone.
"""

from __future__ import annotations

import logging
import os
import time
from functools import cache
from typing import Any

import anyio

from .._device import DeviceId
from ..transport import shm

_SWEEP_POLL = 0.05

logger = logging.getLogger(__name__)


def current_node_id() -> str:
    """The Ray node id of this process (a driver or an actor); Ray must be initialized."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def ray_device(device: str, *, node: str | None = None) -> DeviceId:
    """``DeviceId(node=<Ray node id>, device=device)``: how Ray actors name devices.

    ``node`` defaults to this process's Ray node. ``device`` is a virtual CPU device
    (``"cpu:0"``) or a GPU's UUID.
    """
    return DeviceId(node=node if node is not None else current_node_id(), device=device)


def _gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (it does not exist, or it is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def sweep_dead_process_segments(pid: int | None, wait_s: float) -> list[str]:
    """On this machine: once ``pid`` exited (waiting up to ``wait_s``), unlink its segments.

    Also sweeps every other segment whose creator is gone. Returns the names removed.
    Runs in a Ray task on the dead actor's node; synchronous, so it never runs on an
    event loop.
    """
    removed: list[str] = []
    if pid is not None:
        deadline = time.monotonic() + wait_s
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(_SWEEP_POLL)
        if _gone(pid):
            mine = f"{shm.PREFIX}-{pid}-"
            for name in shm.list_segments():
                if name.startswith(mine):
                    try:
                        os.unlink(os.path.join(shm.SHM_DIR, name))
                    except FileNotFoundError:
                        continue
                    removed.append(name)
    removed.extend(shm.sweep_stale_segments())
    return removed


@cache
def _sweep_task() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_retries=0)(sweep_dead_process_segments)


async def sweep_node_segments(
    node_id: str, *, pid: int | None = None, wait_s: float = 10.0
) -> list[str]:
    """Remove asyncrefit segments of dead processes on Ray node ``node_id``.

    With ``pid``, first waits up to ``wait_s`` for that process to exit, then removes
    its segments even if it is left a zombie. Runs as a zero-CPU Ray task pinned to
    the node; the caller only awaits its ``ObjectRef`` (bound it with
    ``anyio.fail_after``: a lost node never answers). Returns the names removed.

    Error handling: Ray's errors propagate (the node is gone, the task failed).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = _sweep_task().options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )
    removed = await task.remote(pid, wait_s)
    return [str(name) for name in removed]


async def sweep_dead_process(name: str, node_id: str, pid: int, within: float) -> bool:
    """Remove the segments of process ``pid`` (the actor called ``name``, found dead)
    from node ``node_id``, within ``within`` seconds; failures are logged. Returns
    whether the sweep ran."""
    try:
        with anyio.fail_after(within):
            removed = await sweep_node_segments(node_id, pid=pid, wait_s=max(0.0, within - 2.0))
    except Exception as exc:
        logger.warning("could not sweep the segments of %s on node %s: %s", name, node_id, exc)
        return False
    if removed:
        logger.info("removed %d segments of %s", len(removed), name)
    return True


async def sweep_cluster_segments() -> dict[str, list[str]]:
    """Remove asyncrefit segments of dead processes on every alive node of the cluster.

    For clean-up after a crash (a driver killed before its coordinator closed, actors
    killed). Returns the names removed, by node id. Bound it with ``anyio.fail_after``.
    """
    import ray

    nodes = await anyio.to_thread.run_sync(ray.nodes)
    alive = [str(n["NodeID"]) for n in nodes if n.get("Alive")]
    removed: dict[str, list[str]] = {}

    async def one(node: str) -> None:
        removed[node] = await sweep_node_segments(node)

    async with anyio.create_task_group() as tg:
        for node in alive:
            tg.start_soon(one, node)
    return removed
