"""The demo: train a small transformer, push after every step, verify bitwise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrefit._demo import run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_demo_pushes_verify() -> None:
    result = await run_demo(workers=2, steps=2, progress=False)

    assert result["verified"] is True
    assert result["workers"] == 2
    assert result["parameters"] > 1_000_000
    pushes = result["pushes"]
    assert [p["version"] for p in pushes] == [1, 2]
    for push in pushes:
        assert push["verified"] is True
        assert push["logits_changed"] is True
        assert push["buckets"] > 1
        per_worker = push["handle_bytes_per_worker"]
        assert len(per_worker) == 2
        assert len(set(per_worker.values())) == 1  # filtered: the same for every worker
        assert all(all(c.values()) for c in push["checks"].values())


def test_demo_cli_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrefit.cli", "demo", "--json", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout holds exactly one JSON object
    assert result["verified"] is True
    assert result["steps"] == 1
    assert [p["version"] for p in result["pushes"]] == [1]
