"""The vLLM examples, run as a new user runs them: ``python examples/<name>.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrefit.transport.shm import list_segments

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def run_example(name: str, timeout: float = 360.0) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<name>`` from the repository root with this interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with subprocess.Popen(
        [sys.executable, f"examples/{name}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
            pytest.fail(f"{name} ran past {timeout} s:\n{out[-4000:]}")
    left = [s for s in list_segments() if s.startswith(f"asyncrefit-{process.pid}-")]
    assert not left, f"{name} left shared memory segments behind: {left}"
    return subprocess.CompletedProcess(process.args, process.returncode, out, None)


def test_megatron_convert_example_pushes_converted_weights_into_vllm() -> None:
    done = run_example("megatron_convert.py")
    assert done.returncode == 0, done.stdout[-4000:]
    assert "all pushes verified" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.strip().endswith("]")]
    assert sum(" ok [" in row for row in rows) == 3, done.stdout[-4000:]


def test_moe_example_pushes_a_transformers_moe_model_into_vllm() -> None:
    done = run_example("vllm_moe.py")
    assert done.returncode == 0, done.stdout[-4000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, done.stdout[-4000:]
    assert all(line.endswith("engine tokens == trainer tokens: True") for line in steps)


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="vLLM's CPU FP8 kernels need AMX (this CPU has none)",
)
def test_fp8_example_pushes_quantized_weights_that_equal_an_fp8_checkpoint() -> None:
    done = run_example("vllm_fp8.py")
    assert done.returncode == 0, done.stdout[-4000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, done.stdout[-4000:]
    assert "checkpoint: True" in done.stdout


def test_lora_example_pushes_an_adapter_that_equals_it_loaded_from_files() -> None:
    pytest.importorskip("peft")
    done = run_example("vllm_lora.py")
    assert done.returncode == 0, done.stdout[-4000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [s.split(",")[0] for s in steps] == [
        f"step {i}: pushed adapter version {i}" for i in (1, 2, 3)
    ], done.stdout[-4000:]
    assert "loaded from files: True" in done.stdout
    assert "base model tokens unchanged: True" in done.stdout
