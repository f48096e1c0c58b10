"""Soak: many pushes of a small model into local workers, watching for growth.

Samples, after every push, the coordinator's and each worker's resident memory and
open file descriptors, this process's shared-memory segments and its child processes.
Used by the soak test (100 pushes in CI) and ``benchmarks/soak.py`` (1000 pushes).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._core._coordinator import RefitCoordinator
from ..local import spawn_local_workers
from ..transport.shm import list_segments
from ._machine import rss_bytes
from ._verify import mismatches, module_digests


def soak_model() -> Any:
    """The soaked model: a small MLP (~0.5 MiB), the same in every process."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)
    )


#: What the soak samples after every push, in the order it reports them.
QUANTITIES = (
    "coordinator_rss",
    "worker_rss_max",
    "coordinator_fds",
    "worker_fds_max",
    "shm_segments",
    "child_processes",
)


def open_fds(pid: int) -> int:
    """Number of open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def children(pid: int) -> int:
    """Number of direct child processes of ``pid`` that are alive (not zombies)."""
    count = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = f.read().split()
        except FileNotFoundError:
            continue
        for kid in kids:
            try:
                with open(f"/proc/{kid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] != "Z":
                        count += 1
            except FileNotFoundError:
                pass
    return count


@dataclass(slots=True)
class Series:
    """One measured quantity over the pushes."""

    values: list[int] = field(default_factory=list)

    def summary(self, warmup: int) -> dict[str, int]:
        """First (after ``warmup`` pushes), last and max, and last minus first."""
        steady = self.values[warmup:] or self.values
        return {
            "first": steady[0],
            "last": steady[-1],
            "max": max(steady),
            "growth": steady[-1] - steady[0],
        }


async def run_soak(
    pushes: int, workers: int = 2, *, warmup: int = 10, shared_parameters: bool = False
) -> dict[str, Any]:
    """Push ``pushes`` versions of :func:`soak_model` into ``workers`` local workers.

    ``shared_parameters=True`` starts the workers with exported parameters, so every
    push is a direct write.

    Every push is a real optimizer-like change of every parameter; the last version is
    verified bitwise on every worker. Returns a dict of series summaries keyed by
    quantity (:data:`QUANTITIES`), plus ``pushes``,
    ``seconds`` and ``verified``.
    """
    import torch

    model = soak_model()
    me = os.getpid()
    series = {k: Series() for k in QUANTITIES}
    start = time.perf_counter()
    async with spawn_local_workers(
        soak_model, workers, shared_parameters=shared_parameters
    ) as pool:
        pids = [w.pid for w in pool if w.pid is not None]
        async with RefitCoordinator(trainer=model, workers=pool, budget_bytes=1 << 19) as refit:
            for version in range(1, pushes + 1):
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.999).add_(1e-3)
                await refit.push(version)
                series["coordinator_rss"].values.append(rss_bytes(me)[0])
                series["worker_rss_max"].values.append(max(rss_bytes(p)[0] for p in pids))
                series["coordinator_fds"].values.append(open_fds(me))
                series["worker_fds_max"].values.append(max(open_fds(p) for p in pids))
                series["shm_segments"].values.append(
                    sum(1 for s in list_segments() if s.startswith(f"asyncrefit-{me}-"))
                )
                series["child_processes"].values.append(children(me))
                await anyio.lowlevel.checkpoint()
            wrong = await mismatches(pool, module_digests(model))
            verified = not any(wrong.values())
    result: dict[str, Any] = {k: s.summary(warmup) for k, s in series.items()}
    result.update(
        pushes=pushes,
        workers=workers,
        shared_parameters=shared_parameters,
        seconds=time.perf_counter() - start,
    )
    result["verified"] = verified
    return result
