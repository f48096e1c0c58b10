"""Test set-up: every async test runs on asyncio and on uvloop; nothing may leak."""

from __future__ import annotations

import asyncio
import glob
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping

import pytest

from asyncrefit.transport.shm import list_segments

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a Linux dependency
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def child_pids() -> set[int]:
    """Live child processes of this process (zombies excluded)."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids.update(int(p) for p in f.read().split())
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    alive.add(pid)
        except FileNotFoundError:
            pass
    return alive


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves shared-memory segments or child processes behind."""
    segments_before = set(list_segments())
    children_before = child_pids()
    yield
    multiprocessing.active_children()  # reap what exited
    leaked_segments = set(list_segments()) - segments_before
    leaked_children = child_pids() - children_before
    assert not leaked_segments, f"shared memory segments left behind: {leaked_segments}"
    assert not leaked_children, f"child processes left behind: {leaked_children}"
