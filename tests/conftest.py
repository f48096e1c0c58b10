"""Test set-up: every async test runs on asyncio and on uvloop; nothing may leak."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping

import pytest

from asyncrefit.transport import SharedMemoryExporter

from .helpers import child_pids, own_segments

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


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves shared-memory segments or child processes behind."""
    segments_before = set(own_segments())
    children_before = child_pids()
    yield
    multiprocessing.active_children()  # reap what exited
    leaked_segments = set(own_segments()) - segments_before
    leaked_children = child_pids() - children_before
    assert not leaked_segments, f"shared memory segments left behind: {leaked_segments}"
    assert not leaked_children, f"child processes left behind: {leaked_children}"


@pytest.fixture
def exporter() -> Iterator[SharedMemoryExporter]:
    """A shared-memory exporter, closed (segments unlinked) after the test."""
    ex = SharedMemoryExporter()
    try:
        yield ex
    finally:
        ex.close()
