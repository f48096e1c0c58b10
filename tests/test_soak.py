"""Soak: 100 pushes into 2 workers; nothing grows (the 1000-push run is a benchmark)."""

from __future__ import annotations

import pytest

from asyncrefit.tools.soak import run_soak

MIB = 2**20


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shared", [False, True], ids=["staged", "direct"])
async def test_hundred_pushes_leave_no_growth(shared: bool) -> None:
    result = await run_soak(100, 2, warmup=10, shared_parameters=shared)
    assert result["verified"]
    # Memory: noise of the allocator, not a per-push leak (0.5 MiB pushed each time).
    assert result["coordinator_rss"]["growth"] < 8 * MIB, result
    assert result["worker_rss_max"]["growth"] < 8 * MIB, result
    # Descriptors, segments and processes do not move at all.
    for key in ("coordinator_fds", "worker_fds_max", "shm_segments", "child_processes"):
        assert result[key]["growth"] == 0, (key, result[key])
        assert result[key]["max"] == result[key]["first"], (key, result[key])
    assert result["child_processes"]["first"] >= 2
