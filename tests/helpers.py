"""Helpers shared by tests: what this test process owns on the machine."""

from __future__ import annotations

import glob
import os

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
