"""Trainer-side conversions before planning: dtype casts on pack, renaming and selection.

The plan is in the engine's dtypes (what the workers declare): fp32 master weights are
cast to a bf16 engine in the pack copy. Trainer names are mapped to the engine's (wrapper
prefixes stripped, value heads left out) before the set is validated against every
worker, so a mismatch is found before any byte moves.
"""

from __future__ import annotations

import pytest
import torch

from asyncrefit import (
    WRAPPER_PREFIXES,
    LocalTrainer,
    NameMap,
    ParameterMismatchError,
    PlanError,
    RefitCoordinator,
    SharedParameterTrainer,
    cpu_device,
    strip_wrappers,
)
from asyncrefit.local import spawn_local_workers

from .fakes import FakeWorker
from .helpers import digests, step
from .models import ValueHeadPolicy, make_mlp, make_mlp_bf16

pytestmark = pytest.mark.timeout(60)

KIB = 1024


def cast_digests(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """Digests of ``module``'s parameters cast to ``dtype`` (``module`` is unchanged)."""
    copy = make_mlp()
    copy.load_state_dict(module.state_dict())
    return digests(copy.to(dtype))


# --- dtype cast on pack ---------------------------------------------------------------


@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero-copy"])
async def test_fp32_master_weights_arrive_in_a_bf16_engine_bitwise(zero_copy: bool) -> None:
    model = make_mlp()
    trainer = SharedParameterTrainer(model) if zero_copy else LocalTrainer(model)
    async with spawn_local_workers(make_mlp_bf16, 2) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=64 * KIB, verify=True
        ) as refit:
            assert refit.plan is not None
            assert {e.dtype for b in refit.plan.buckets for e in b.entries} == {"bfloat16"}
            for version in (1, 2, 3):
                step(model, version)
                report = await refit.push(version)
                want = cast_digests(model, torch.bfloat16)
                for w in workers:
                    assert await w.parameter_digests() == want
                    assert await w.weight_version() == version
                # Bytes are counted as sent: in the engine's dtype.
                assert report.bytes == sum(p.numel() * 2 for p in model.parameters())
    # The trainer's own parameters stay fp32, in the training loop's hands.
    assert all(p.dtype == torch.float32 for p in model.parameters())


async def test_an_integer_trainer_tensor_is_never_cast_to_a_float_engine() -> None:
    model = make_mlp()
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    tensors["0.bias"] = torch.arange(256, dtype=torch.int32)
    worker = FakeWorker.like("w", cpu_device(0), model)
    with pytest.raises(ParameterMismatchError, match=r"'0\.bias'.*cannot be packed from int32"):
        async with RefitCoordinator(trainer=tensors, workers=[worker], budget_bytes=64 * KIB):
            pass
    assert worker.calls == []


async def test_workers_holding_a_parameter_in_two_dtypes_are_refused() -> None:
    model = make_mlp()
    w0 = FakeWorker.like("w0", cpu_device(0), model)
    w1 = FakeWorker.like("w1", cpu_device(1), make_mlp_bf16())
    with pytest.raises(ParameterMismatchError, match="bfloat16 on the worker, float32 on worker"):
        async with RefitCoordinator(trainer=model, workers=[w0, w1], budget_bytes=64 * KIB):
            pass
    assert w0.calls == w1.calls == []


# --- names and selection ------------------------------------------------------------------


def test_name_map_strips_wrappers_renames_and_selects() -> None:
    names = NameMap(
        strip_prefixes=WRAPPER_PREFIXES,
        rename=lambda n: None if n.startswith("ref.") else n.replace("transformer.", "model."),
        exclude=("*.v_head.*", "v_head.*"),
    )
    assert names("module._orig_mod.transformer.h.0.w") == "model.h.0.w"
    assert names("model._fsdp_wrapped_module.layers.1._checkpoint_wrapped_module.w") == (
        "model.layers.1.w"
    )
    assert names("v_head.weight") is None
    assert names("ref.layers.0.w") is None
    assert NameMap(include=("model.*",))("lm_head.weight") is None
    # a prefix is removed only where it starts a dotted component
    assert strip_wrappers()("submodule.weight") == "submodule.weight"


async def test_a_wrapped_trainer_with_a_value_head_pushes_into_an_unwrapped_engine() -> None:
    policy = ValueHeadPolicy()
    trainer = LocalTrainer(policy, names=strip_wrappers(exclude=["v_head.*"]))
    async with spawn_local_workers(make_mlp, 2) as workers:
        async with RefitCoordinator(
            trainer=trainer, workers=workers, budget_bytes=64 * KIB
        ) as refit:
            inner = policy.module._orig_mod
            assert isinstance(inner, torch.nn.Module)
            for version in (1, 2):
                step(policy, version)
                await refit.push(version)
                for w in workers:
                    assert await w.parameter_digests() == digests(inner)


async def test_an_unmapped_trainer_name_is_a_mismatch_before_any_byte_moves() -> None:
    worker = FakeWorker.like("w", cpu_device(0), make_mlp())
    # Prefixes stripped, but the value head is not left out: the engine has no such one.
    trainer = LocalTrainer(ValueHeadPolicy(), names=strip_wrappers())
    with pytest.raises(ParameterMismatchError, match=r"v_head\.bias") as info:
        async with RefitCoordinator(trainer=trainer, workers=[worker], budget_bytes=64 * KIB):
            pass
    assert info.value.worker == "w"
    assert worker.calls == []


async def test_two_trainer_parameters_mapping_to_one_name_is_a_plan_error() -> None:
    worker = FakeWorker.like("w", cpu_device(0), make_mlp())
    trainer = LocalTrainer(make_mlp(), names=lambda n: "0.weight")
    with pytest.raises(PlanError, match=r"'0\.weight' and '0\.bias' both map to '0\.weight'"):
        async with RefitCoordinator(trainer=trainer, workers=[worker], budget_bytes=64 * KIB):
            pass
    assert worker.calls == []
