"""The benchmark: ``run_bench`` in-process on a small set, ``asyncrefit plan`` as a command."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrefit import LocalTrainer
from asyncrefit.planning import plan_buckets
from asyncrefit.tools._table import append_to_section
from asyncrefit.tools.bench import (
    llama_specs,
    module_from_specs,
    run_bench,
    synthetic_model,
    synthetic_specs,
)

MIB = 2**20


def test_synthetic_set_is_transformer_like_and_deterministic() -> None:
    specs = synthetic_specs(64)
    assert 190 <= len(specs) <= 210
    assert abs(sum(s.nbytes for s in specs) - 64 * MIB) < 0.01 * 64 * MIB
    assert {s.dtype for s in specs} == {"float32", "bfloat16"}
    assert {len(s.shape) for s in specs} == {1, 2}
    assert specs == synthetic_specs(64)
    model = synthetic_model(1)
    assert LocalTrainer(model).specs() == tuple(synthetic_specs(1))


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_run_bench_measures_every_variant() -> None:
    result = await run_bench(size_mib=16, repeats=1)
    json.dumps(result)  # JSON-ready
    for key in (
        "memcpy_gbps",
        "memcpy_contiguous_gbps",
        "refit_gbps",
        "ratio_to_memcpy",
        "handle_bytes_per_worker",
        "size_bytes",
    ):
        assert result[key] > 0, key
    assert abs(result["size_bytes"] - 16 * MIB) < 0.01 * 16 * MIB
    assert result["ratio_to_memcpy"] == pytest.approx(result["refit_gbps"] / result["memcpy_gbps"])
    a, b = result["baselines"]["broadcast_all"], result["baselines"]["one_in_flight"]
    for value in (a["gbps"], a["seconds"], b["gbps"], b["seconds"]):
        assert value > 0
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    datetime.datetime.fromisoformat(result["date"])

    variants = {v["key"]: v for v in result["variants"]}
    assert set(variants) == {
        "asyncrefit",
        "filtered_8_devices",
        "broadcast_all",
        "one_in_flight",
        "zero_copy",
        "verify",
    }
    assert result["refit_zero_copy_gbps"] > 0 and result["ratio_to_memcpy_zero_copy"] > 0
    assert all(v["verified"] for v in variants.values())
    assert variants["asyncrefit"]["slots"] == 2 and variants["one_in_flight"]["slots"] == 1
    assert variants["asyncrefit"]["buckets"] >= 4

    # Filtered dispatch: a worker's handle bytes do not depend on the devices exported.
    filtered = result["handle_bytes_per_worker"]
    assert result["filtered_8_devices"]["handle_bytes_per_worker"] == filtered
    # Broadcast all: every worker gets 8 handles per bucket. On the wire pickle writes
    # the layout they share once, so it is larger but not 8x; with each device's handle
    # serialized on its own (as for per-device shards made in other processes) it is.
    assert a["handle_bytes_per_worker"] > filtered
    assert a["handle_bytes_per_worker_independent"] > 5 * filtered


def test_plan_command_prints_the_buckets() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrefit.cli", "plan", "--size-mib", "64", "--bucket-mib", "16"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    plan = plan_buckets(synthetic_specs(64), 16 * MIB)
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"^\s+\d+\s+\d+\s", line)]
    assert [int(r[0]) for r in rows] == list(range(len(plan.buckets)))
    assert [int(r[1]) for r in rows] == [len(b.entries) for b in plan.buckets]
    assert sum(int(r[1]) for r in rows) == len(synthetic_specs(64))
    assert all(float(r[2]) <= 16 for r in rows)
    total = re.search(r"total: (\d+) buckets, (\d+) tensors, ([\d.]+) MiB payload", done.stdout)
    assert total is not None
    assert int(total.group(1)) == len(plan.buckets)
    assert float(total.group(3)) == pytest.approx(64, abs=0.01)


def test_plan_command_rejects_a_bad_bucket_size() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrefit.cli", "plan", "--bucket-mib", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "bucket_bytes must be positive" in done.stderr


def test_append_to_section_files_text_at_the_end_of_its_section(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    append_to_section(path, "## B", "\n### run 1\n")  # no file yet: created
    assert path.read_text() == "### run 1\n"
    path.write_text("# R\n\n## A\n\ntext a\n\n## B (x)\n\ntext b\n\n## C\n\ntext c\n")
    append_to_section(path, "## B", "\n### run 2\n")
    append_to_section(path, "## C", "\n### run 3\n")
    append_to_section(path, "## D", "\n## D\n")  # no such section: at the end
    assert path.read_text() == (
        "# R\n\n## A\n\ntext a\n\n## B (x)\n\ntext b\n\n### run 2\n\n## C\n\ntext c\n"
        "\n### run 3\n\n## D\n"
    )


def test_module_from_specs_holds_each_spec_under_its_name_in_order() -> None:
    specs = llama_specs(2, 11, 8, 21, dtype="float32")
    assert len(specs) == 3 + 2 * 9
    model = module_from_specs(specs, dtype=torch.bfloat16)
    got = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    assert got == [(s.name, s.shape, torch.bfloat16) for s in specs]
    assert not any(p.requires_grad or p.any() for p in model.parameters())
    meta = module_from_specs(specs, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert LocalTrainer(module_from_specs(specs)).specs() == tuple(specs)
