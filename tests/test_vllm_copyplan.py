"""The copy plan learned from a model's own loader, on a vLLM-like toy model.

The toy loads the way vLLM's models do: q/k/v into one fused ``qkv_proj`` (stacked),
gate/up into ``gate_up_proj``, one rank's slice of a row-parallel ``o_proj`` (rank 1
of 2), a padded vocabulary, a tied head (no tensor of its own), and one tensor whose
loader scales its values (no copy: it must be left to the reload). The plan applied
to a checkpoint must give, bitwise, what the loader gives.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from asyncrefit.vllm._copyplan import apply, learn, mismatches

H, V, VPAD, INTER = 8, 10, 12, 6


class Toy(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

        self.embed = param(VPAD, H)  # padded vocabulary
        self.qkv_proj = param(3 * H, H)
        self.o_proj = param(H, H // 2)  # rank 1 of 2 of a row-parallel layer
        self.gate_up_proj = param(2 * INTER, H)
        self.norm = param(H)
        self.scaled = param(H)
        self.lm_head = self.embed  # tied

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
        for name, w in weights:
            key = name.split(".")[0]
            if key in stacked:
                _, shard = stacked[key]
                self.qkv_proj.data[shard * H : (shard + 1) * H].copy_(w)
            elif key in ("gate_proj", "up_proj"):
                shard = 0 if key == "gate_proj" else 1
                self.gate_up_proj.data[shard * INTER : (shard + 1) * INTER].copy_(w)
            elif key == "o_proj":
                self.o_proj.data.copy_(w.narrow(1, H // 2, H // 2))
            elif key == "embed":
                self.embed.data[:V].copy_(w)
            elif key == "scaled":
                self.scaled.data.copy_(w * 2)
            else:
                getattr(self, key).data.copy_(w)


SHAPES = {
    "embed.weight": (V, H),
    "q_proj.weight": (H, H),
    "k_proj.weight": (H, H),
    "v_proj.weight": (H, H),
    "o_proj.weight": (H, H),
    "gate_proj.weight": (INTER, H),
    "up_proj.weight": (INTER, H),
    "norm.weight": (H,),
    "scaled.weight": (H,),
}


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def test_plan_learned_from_the_loader_writes_what_the_loader_writes() -> None:
    model = Toy()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = learn(model, SHAPES)
    # learning left the parameters as they were (values, dtype, objects)
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[n])
    assert plan.staged == ("scaled.weight",)  # its loader scales: no copy
    targets = {c.target for c in plan.copies}
    assert targets == {"embed", "qkv_proj", "o_proj", "gate_up_proj", "norm"}
    o = next(c for c in plan.copies if c.source == "o_proj.weight")
    assert o.source_box == ((0, H), (H // 2, H)) and o.target_box == ((0, H), (0, H // 2))

    tensors = checkpoint(1)
    loaded = Toy()
    loaded.load_weights(tensors.items())
    written = Toy()
    apply(plan, dict(written.named_parameters()), tensors)
    for name, p in loaded.named_parameters():
        if name == "scaled":
            continue
        assert torch.equal(dict(written.named_parameters())[name], p), name
    assert mismatches(plan, dict(loaded.named_parameters()), tensors) == []
    # and a wrong plan is caught
    assert mismatches(plan, dict(loaded.named_parameters()), checkpoint(2))


def test_a_tensor_the_loader_refuses_is_staged_and_the_parameters_restored() -> None:
    model = Toy()
    data = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}

    def broken(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        next(iter(weights))
        raise RuntimeError("loader failed")

    plan = learn(model, SHAPES, load=broken)
    assert plan.copies == () and plan.staged == tuple(sorted(SHAPES))
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == data

    def interrupted(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        learn(model, SHAPES, load=interrupted)
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == data


# --- in vLLM's CPU engine --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")
@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_plan_learned_in_the_engine_matches_what_it_loaded(
    arch: str, tied: bool, tmp_path: Path
) -> None:
    """In a live engine (vLLM's CPU build), the plan learned from the model's own
    ``load_weights`` writes, from the checkpoint's tensors, exactly the bytes the engine
    loaded from them at start-up; and the engine still serves afterwards."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

    from .vllm_models import ENGINE_KWARGS, engine_processes, make_checkpoint

    path = make_checkpoint(tmp_path / arch, arch=arch, tied=tied)
    before = engine_processes()
    engine = LLM(model=str(path), **ENGINE_KWARGS)
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=[1, 2, 3, 4])
        first = engine.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        (found,) = engine.collective_rpc("asyncrefit_learn_copy_plan", args=(str(path),))
        print(arch, found)
        assert found["mismatches"] == []
        # On the CPU build every linear layer repacks its weight after loading (a
        # oneDNN copy): those tensors stay with the reload; the norms are block copies.
        assert found["copies"] > 0 and any("norm" in t for t in found["targets"])
        assert set(found["staged"]) | {c for c in found["sources"]} >= set(found["all"])
        again = engine.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert again == first  # learning restored every parameter
    finally:
        engine.llm_engine.engine_core.shutdown()
        deadline = time.monotonic() + 60
        while engine_processes() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        ctx = getattr(getattr(engine.llm_engine.engine_core, "resources", None), "ctx", None)
        if ctx is not None and not ctx.closed:
            ctx.destroy(linger=0)
