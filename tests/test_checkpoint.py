"""A ``transformers`` model pushed under its checkpoint's names and layout.

The reference is transformers' own ``revert_weight_conversion`` (what
``save_pretrained`` writes) on the real tensors: the checkpoint tensors asyncrefit reads
as slices of the trainer's tensors must equal it bitwise, name for name, for every
architecture, without a copy of the trainer's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from asyncrefit import (
    ConversionError,
    LocalTrainer,
    NameMap,
    ParameterMismatchError,
    RefitCoordinator,
    cpu_device,
)
from asyncrefit.trainer import _checkpoint
from asyncrefit.trainer._checkpoint import CheckpointLayout
from asyncrefit.trainer._slices import Slices, copy_plain

from .fakes import FakeWorker
from .helpers import own_segments

pytest.importorskip("transformers.core_model_loading")

from .moe_models import (
    ARCHS,
    checkpoint_tensors,
    checkpoint_zeros,
    fused_expert_bytes,
    make_model,
    train_step,
)

pytestmark = pytest.mark.timeout(120)


def value(tensor: Any) -> torch.Tensor:
    """The value of a checkpoint tensor as the layout gives it (a view or slices)."""
    if isinstance(tensor, Slices):
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
        tensor.copy_into(out, copy_plain)
        return out
    assert isinstance(tensor, torch.Tensor)
    return tensor


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# --- the layout equals transformers' own conversion ----------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_tensors_equal_transformers_save_conversion(arch: str) -> None:
    model = make_model(arch)
    named = dict(model.named_parameters())
    layout = CheckpointLayout(model)
    got = layout(named)
    want = checkpoint_tensors(model)
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert same(value(tensor).detach(), want[name]), name
    storages = {p.untyped_storage().data_ptr() for p in named.values()}
    for name, tensor in got.items():
        # read in place: a view of a trainer tensor, never a copy
        assert isinstance(tensor, torch.Tensor), name
        assert tensor.untyped_storage().data_ptr() in storages, name
    if arch == "llama":
        assert layout.converted(named) is None  # nothing converted: the trainer's names
        assert all(got[n] is named[n] for n in named)
    else:
        assert len(got) > len(named)  # fused experts come out one per expert


def test_views_are_kept_and_follow_in_place_steps_and_replaced_tensors() -> None:
    model = make_model("mixtral")
    layout = CheckpointLayout(model)
    first = layout(dict(model.named_parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, seed=1)
    second = layout(dict(model.named_parameters()))
    assert all(second[n] is first[n] for n in first)  # traced once, views kept
    want = checkpoint_tensors(model)
    assert all(same(value(t).detach(), want[n]) for n, t in second.items())
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach() * 2)
    third = layout(dict(model.named_parameters()))
    want = checkpoint_tensors(model)
    assert all(same(value(t).detach(), want[n]) for n, t in third.items())
    w1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    assert third[w1] is not second[w1]  # a replaced tensor gets new views


def test_a_changed_parameter_set_is_traced_again() -> None:
    model = make_model("qwen3_moe")
    layout = CheckpointLayout(model)
    before = layout(dict(model.named_parameters()))
    named = dict(model.named_parameters())
    named.pop("lm_head.weight")
    after = layout(named)
    assert set(before) - set(after) == {"lm_head.weight"}


# --- what cannot be read in place is a typed error --------------------------------------


def fake_reverter(convert: Any) -> Any:
    return lambda model, state: convert(state)


def test_an_op_that_changes_values_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        _checkpoint, "_reverter", lambda: fake_reverter(lambda sd: {"w.weight": sd["w"] * 2})
    )
    layout = CheckpointLayout(object(), source="policy")
    with pytest.raises(ConversionError, match="mul") as info:
        layout({"w": torch.ones(4, 4)})
    assert info.value.source == "policy"


def test_a_copy_that_is_not_a_slice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def gather(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"w.weight": sd["w"][[0, 2]]}  # advanced indexing copies

    monkeypatch.setattr(_checkpoint, "_reverter", lambda: fake_reverter(gather))
    with pytest.raises(ConversionError, match=r"'w\.weight'"):
        CheckpointLayout(object())({"w": torch.ones(4, 4)})


def test_a_trainer_tensor_that_nothing_reads_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        _checkpoint, "_reverter", lambda: fake_reverter(lambda sd: {"a.weight": sd["a"]})
    )
    with pytest.raises(ConversionError) as info:
        CheckpointLayout(object())({"a": torch.ones(2), "b": torch.ones(2)})
    assert info.value.parameter == "b"


def test_tensors_side_by_side_are_read_piece_by_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint that fuses what the model splits (``cat``, ``stack``)."""

    def fuse(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "qkv.weight": torch.cat([sd["q"], sd["k"].t(), sd["v"]], dim=0).contiguous(),
            "pair.weight": torch.stack([sd["a"], sd["b"]], dim=1),
        }

    monkeypatch.setattr(_checkpoint, "_reverter", lambda: fake_reverter(fuse))
    gen = torch.Generator().manual_seed(0)
    named = {
        "q": torch.randn(4, 3, generator=gen),
        "k": torch.randn(3, 2, generator=gen),
        "v": torch.randn(2, 3, generator=gen),
        "a": torch.randn(5, 2, generator=gen),
        "b": torch.randn(5, 2, generator=gen),
    }
    got = CheckpointLayout(object())(named)
    want = fuse(named)
    assert set(got) == set(want)
    for name in want:
        assert isinstance(got[name], Slices)
        assert same(value(got[name]), want[name]), name
    rows = got["qkv.weight"]
    assert isinstance(rows, Slices)
    assert same(value(rows.rows(3, 7)), want["qkv.weight"][3:7])  # a part across pieces


# --- pushes ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
async def test_moe_pushes_under_checkpoint_names_with_a_budget_below_one_fused_tensor(
    arch: str,
) -> None:
    model = make_model(arch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    workers = [
        FakeWorker(name=f"w{i}", device=cpu_device(i), parameters=checkpoint_zeros(arch))
        for i in range(2)
    ]
    budget = fused_expert_bytes(model) // 2
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=budget, verify=True
    ) as refit:
        for version in (1, 2, 3):
            train_step(model, optimizer, seed=version)
            report = await refit.push(version)
            want = checkpoint_tensors(model)
            for w in workers:
                assert set(w.parameters) == set(want)
                assert all(same(w.parameters[n], t) for n, t in want.items()), w.name
            assert report.peak_budget_bytes <= budget
            assert report.bytes == sum(t.nbytes for t in want.values())
    assert own_segments() == []


async def test_names_apply_to_the_checkpoint_names() -> None:
    model = make_model("qwen3_moe")
    params = checkpoint_zeros("qwen3_moe")
    del params["lm_head.weight"]  # an engine that does not take the head
    worker = FakeWorker(name="w0", device=cpu_device(0), parameters=params)
    trainer = LocalTrainer(model, names=NameMap(exclude=("lm_head.*",)))
    async with RefitCoordinator(trainer=trainer, workers=[worker], budget_bytes=1 << 20) as refit:
        await refit.push(1)
    want = checkpoint_tensors(model)
    assert all(same(worker.parameters[n], want[n]) for n in params)


async def test_in_memory_names_are_refused_by_a_checkpoint_engine() -> None:
    """``checkpoint_names=False``: today's behaviour, and its error, before any byte."""
    model = make_model("mixtral")
    worker = FakeWorker(name="w0", device=cpu_device(0), parameters=checkpoint_zeros("mixtral"))
    trainer = LocalTrainer(model, checkpoint_names=False)
    with pytest.raises(ParameterMismatchError, match="experts"):
        async with RefitCoordinator(trainer=trainer, workers=[worker], budget_bytes=1 << 22):
            pass
    assert worker.calls == []
