"""The Ray examples, run as a new user runs them: ``python examples/<name>.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrefit.transport.shm import list_segments

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def test_ray_fsdp_example_refits_from_two_fsdp2_rank_actors() -> None:
    before = set(list_segments())
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "examples/ray_fsdp.py"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "trainer group: 2 ranks" in done.stdout
    assert "verified: 2 actors hold version 3, bit for bit" in done.stdout, done.stdout[-4000:]
    # segments the run left behind (their creators, its actors, are gone by now)
    left = [s for s in set(list_segments()) - before if not _alive(int(s.split("-")[1]))]
    assert left == [], left
