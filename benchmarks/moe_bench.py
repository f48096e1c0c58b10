"""Push a transformers MoE model under its checkpoint's layout: time and memory.

    python benchmarks/moe_bench.py --repeats 5 --record

A Qwen3-MoE of ~215 MiB (fp32; 4 layers of 16 experts, each layer's fused
``gate_up_proj`` 32 MiB) is pushed into 2 local worker processes, wall clock around
``push`` (median and spread over the repeats, variants interleaved):

- ``checkpoint, budget < fused``: the checkpoint's per-expert tensors, read as slices
  of the fused tensors, with a staging budget of 3/4 of one fused tensor;
- ``checkpoint, budget 2x fused``: the same with a larger budget;
- ``in-memory names``: the baseline without conversion (``checkpoint_names=False``)
  into workers that hold the fused tensors, budget 2x one fused tensor (a budget below
  it is refused there);
- ``memcpy limit``: one copy of every byte the workers are written (the payload once
  per worker), in this process.

Per variant: the trainer's transient extra memory during a push (its resident peak
minus its resident size before, the staging slots mapped already) and the staging
peak. Workers are checked bitwise after each variant (not timed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit import LocalTrainer, RefitCoordinator
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import spawn_local_workers
from asyncrefit.tools._machine import machine_info, machine_line, reset_peak_rss, rss_bytes
from asyncrefit.tools._table import (
    Column,
    append_to_section,
    recorded_command,
    results_section,
    table,
)

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## MoE under the checkpoint's layout (`benchmarks/moe_bench.py`)"
WORKERS = 2


def make_moe() -> Any:
    """The benchmark's Qwen3-MoE (fp32), the same at every call."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_experts=16,
        num_experts_per_tok=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=4,
        vocab_size=4096,
    )
    return Qwen3MoeForCausalLM(config).eval()


def checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    state = {n: p.detach() for n, p in model.named_parameters()}
    return {n: t.contiguous() for n, t in revert_weight_conversion(model, state).items()}


def make_checkpoint_module() -> torch.nn.Module:
    """An engine-like worker: the checkpoint's tensors (per expert), zeroed, as a tree
    of modules whose parameter names are the checkpoint's."""
    root = torch.nn.Module()
    for name, tensor in checkpoint_state(make_moe()).items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(tensor)))
    return root


def _memcpy_seconds(nbytes: int, copies: int, repeats: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


async def _variant(
    model: Any,
    factory: Any,
    budget: int,
    checkpoint_names: bool,
    repeats: int,
) -> dict[str, Any]:
    async with spawn_local_workers(factory, WORKERS) as workers:
        trainer = LocalTrainer(model, checkpoint_names=checkpoint_names)
        async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=budget) as refit:
            await refit.push(1)  # warm: slots mapped, handles known
            seconds, extra, staging = [], [], []
            for version in range(2, repeats + 2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0001)
                reset_peak_rss()
                before, _ = rss_bytes()
                start = time.perf_counter()
                report = await refit.push(version)
                seconds.append(time.perf_counter() - start)
                _, peak = rss_bytes()
                extra.append(peak - before)
                staging.append(report.peak_budget_bytes)
            if checkpoint_names:
                want = {n: tensor_digest(t) for n, t in checkpoint_state(model).items()}
            else:
                want = {n: tensor_digest(p) for n, p in model.named_parameters()}
            for w in workers:
                got = await w.parameter_digests()
                if got != want:
                    raise SystemExit(f"moe_bench: worker {w.name} does not hold the push")
            return {
                "seconds": seconds,
                "extra_bytes": max(extra),
                "staging_bytes": max(staging),
                "buckets": report.buckets,
                "bytes": report.bytes,
                "budget": budget,
            }


def run(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = make_moe()
    fused = max(int(p.nbytes) for n, p in model.named_parameters() if "experts" in n)
    payload = sum(int(p.nbytes) for p in model.parameters())
    plan = [
        ("checkpoint, budget < fused", make_checkpoint_module, fused * 3 // 4, True),
        ("checkpoint, budget 2x fused", make_checkpoint_module, 2 * fused, True),
        ("in-memory names", make_moe, 2 * fused, False),
    ]
    results: dict[str, dict[str, Any]] = {}
    for _ in range(2):  # two rounds, interleaved; each round's pushes are its repeats
        for name, factory, budget, checkpoint_names in plan:
            got = anyio.run(_variant, model, factory, budget, checkpoint_names, repeats)
            kept = results.setdefault(name, {**got, "seconds": []})
            kept["seconds"] += got["seconds"]
            kept["extra_bytes"] = max(kept["extra_bytes"], got["extra_bytes"])
    results["memcpy limit"] = {
        "seconds": _memcpy_seconds(payload, WORKERS, 2 * repeats),
        "extra_bytes": 0,
        "staging_bytes": 0,
        "buckets": 0,
        "bytes": payload,
        "budget": 0,
    }
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "workers": WORKERS,
        "payload_bytes": payload,
        "fused_tensor_bytes": fused,
        "variants": results,
    }


def format_table(result: dict[str, Any]) -> str:
    limit = statistics.median(result["variants"]["memcpy limit"]["seconds"])
    columns = [
        Column("variant", 30, left=True),
        Column("median ms", 10, ".1f"),
        Column("min-max ms", 16),
        Column("x limit", 8, ".2f"),
        Column("budget MiB", 11, ".2f"),
        Column("staging MiB", 12, ".2f"),
        Column("extra MiB", 10, ".2f"),
        Column("buckets", 8),
    ]
    rows = []
    for name, v in result["variants"].items():
        s = v["seconds"]
        rows.append(
            [
                name,
                statistics.median(s) * 1e3,
                f"{min(s) * 1e3:.1f}-{max(s) * 1e3:.1f}",
                limit / statistics.median(s),
                v["budget"] / 2**20,
                v["staging_bytes"] / 2**20,
                v["extra_bytes"] / 2**20,
                v["buckets"],
            ]
        )
    head = (
        f"{machine_line(result['machine'])}\n"
        f"Qwen3-MoE fp32, {result['payload_bytes'] / 2**20:.1f} MiB, one fused expert "
        f"tensor {result['fused_tensor_bytes'] / 2**20:.1f} MiB, "
        f"{result['workers']} worker processes\n"
    )
    return head + "\n".join(table(columns, rows, gap=1, rule=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per round (5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--record", action="store_true", help=f"append to {RESULTS.name}")
    args = parser.parse_args(argv)
    result = run(args.repeats)
    text = format_table(result)
    print(json.dumps(result, indent=2) if args.json else text)
    if args.record:
        m = result["machine"]
        title = f"{result['date'][:10]}: {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
        command = recorded_command("benchmarks/moe_bench.py", argv)
        append_to_section(RESULTS, SECTION, results_section(title, command, text, result))
    return 0


if __name__ == "__main__":  # worker processes are spawned
    sys.exit(main())
