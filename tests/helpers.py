"""Helpers shared by tests: what this test process owns on the machine."""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import torch

from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import LocalWorker
from asyncrefit.transport.shm import list_segments


def own_segments() -> list[str]:
    """Shared-memory segments created by this process (other runs may share /dev/shm)."""
    return [s for s in list_segments() if s.startswith(f"asyncrefit-{os.getpid()}-")]


def child_pids() -> set[int]:
    """Live child processes of this process (zombies excluded)."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            continue  # that thread ended meanwhile
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().split(")")[-1].split()[0] == "Z"
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                # multiprocessing's resource tracker lives as long as this process
                helper = b"resource_tracker" in f.read()
        except FileNotFoundError:
            continue
        if not zombie and not helper:
            alive.add(pid)
    return alive


def digests(module: torch.nn.Module) -> dict[str, str]:
    """A digest of each parameter's bytes, by name."""
    return {name: tensor_digest(p) for name, p in module.named_parameters()}


def step(module: torch.nn.Module, seed: int) -> None:
    """A stand-in for an optimizer step: change every parameter in place (any device)."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=device).to(p.dtype))


async def assert_hold(
    workers: Sequence[LocalWorker], module: torch.nn.Module, version: int
) -> None:
    """Every worker holds ``module``'s bytes, complete, as ``version``."""
    want = digests(module)
    for w in workers:
        assert await w.parameter_digests() == want, w.name
        assert await w.weight_version() == version, w.name


@asynccontextmanager
async def no_loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """Fail if anything reaches the running loop's exception handler inside the block.

    Callbacks that fail (``Exception in callback Future.set_result ...``) never raise
    into a task: they only reach the handler, which prints a traceback. Pending
    callbacks get a moment to run before the check.
    """
    loop = asyncio.get_running_loop()
    calls: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: calls.append(context))
    try:
        yield calls
        await anyio.sleep(0.05)
    finally:
        loop.set_exception_handler(previous)
    assert not calls, [c.get("message") for c in calls]
