"""The sharded benchmark scripts of ``benchmarks/`` run end to end at a tiny size.

``sharded_bench.py`` as it runs on the CPU; ``sharded_gpu_bench.py`` with ``--device
cpu`` (gloo and shared memory instead of NCCL and CUDA IPC): the GPU run's code path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def run_script(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=200, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_sharded_bench_verifies_both_variants_and_reports_each_rank() -> None:
    out = run_script(
        str(BENCHMARKS / "sharded_bench.py"), "--size-mib", "8", "--repeats", "1", "--json"
    )
    result = json.loads(out)
    plain, sharded = result["plain"], result["sharded"]
    assert plain["verified"] and sharded["verified"]
    assert result["tensors"] == 3 + 16 * 9 and result["uneven_tensors"] == 2 * 16 + 2
    assert plain["bytes"] == sharded["bytes"] == result["payload_bytes"]
    assert result["payload_bytes"] * 2 == result["trainer_bytes"]
    assert plain["buckets"] == sharded["buckets"] >= 4
    ranks = sharded["median_ranks"]
    assert len(ranks) == 2
    assert all(r["packs"] == sharded["buckets"] for r in ranks)
    assert all(0 < r["pack_seconds"] <= r["serve_seconds"] for r in ranks)
    assert (
        result["memory_bound_bytes"] == result["budget_bytes"] + result["largest_fp32_tensor_bytes"]
    )
    assert result["memcpy_gbps"] > 0 and result["sharded_over_plain"] > 0


def test_sharded_gpu_bench_runs_its_code_path_on_the_cpu(tmp_path: Path) -> None:
    out_json = tmp_path / "sharded_gpu.json"
    table = run_script(
        str(BENCHMARKS / "sharded_gpu_bench.py"),
        "--device",
        "cpu",
        "--layers",
        "2",
        "--hidden",
        "128",
        "--inter",
        "344",
        "--vocab",
        "999",
        "--bucket-mib",
        "1",
        "--repeats",
        "1",
        "--out",
        str(out_json),
    )
    result = json.loads(out_json.read_text())
    assert result["tensors"] == 3 + 2 * 9
    assert result["fp32_bytes"] == 2 * result["bytes"]
    assert result["placements"] == ["(Shard(dim=0),)"]
    for key in ("plain", "dtensor"):
        assert result[key]["verified"] and len(result[key]["ms_all"]) == 2  # 2 rounds of 1
        assert result[key]["bytes"] == result["bytes"]
    assert result["ratio"] == pytest.approx(result["dtensor"]["ms"] / result["plain"]["ms"])
    assert "cast cost: DTensor / plain push time" in table

    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# R\n\n## Sharded (DTensor) source on one GPU (x)\n\nabout\n\n## Z\n")
    run_script(
        str(BENCHMARKS / "sharded_gpu_bench.py"),
        "--record-from",
        str(out_json),
        "--results",
        str(results_md),
        "--command",
        "the command",
    )
    text = results_md.read_text()
    assert text.index("about") < text.index("`the command`") < text.index("## Z")
    assert "cast cost: DTensor / plain push time" in text
