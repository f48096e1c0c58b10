"""Layers that share tensors across vLLM's layerwise reload, without an engine.

A toy model runs through vLLM's own reload (``record_metadata_for_reloading`` at
construction, processing as start-up does, ``initialize_layerwise_reload``, loads
through the wrapped weight loaders, ``finalize_layerwise_reload``): a tied head whose
processing packs a copy of the shared weight (vLLM's unquantized embedding method,
which on the CPU build builds the oneDNN gemm handle) keeps the start-up copy unless
:func:`asyncrefit.vllm._reload.refresh` runs; processing asyncrefit cannot renew is
refused with :class:`~asyncrefit.StaleWeightsError`.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncrefit import StaleWeightsError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )
    from vllm.platforms import current_platform

    from asyncrefit.vllm import _reload

pytestmark = pytest.mark.timeout(60)

VOCAB, HIDDEN = 64, 32
CONFIG = SimpleNamespace(dtype=torch.float32)


class Packing(QuantizeMethodBase):
    """Processing asyncrefit does not know: keeps a private copy of the weight."""

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        pass

    def apply(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        target: Any = layer
        target.packed = target.weight.detach().clone()


class Layer(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter, method: QuantizeMethodBase) -> None:
        super().__init__()
        self.weight = weight
        self.quant_method = method


class Toy(torch.nn.Module):
    """``embed`` and ``head``; ``tied``: the head holds the embedding's Parameter."""

    def __init__(self, head_method: QuantizeMethodBase, tied: bool = True) -> None:
        super().__init__()
        weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN), requires_grad=False)
        self.embed = Layer(weight, UnquantizedEmbeddingMethod())
        own = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.head = Layer(weight if tied else own, head_method)
        record_metadata_for_reloading(self)  # as vLLM does when it builds a model
        for layer in (self.embed, self.head):  # as start-up does after loading
            layer.quant_method.process_weights_after_loading(layer)


def finalize(model: Toy) -> None:
    finalize_layerwise_reload(model, CONFIG)  # type: ignore[no-untyped-call, unused-ignore]


def push_embedding(model: Toy, new: torch.Tensor) -> None:
    """One reload that writes ``embed.weight`` only, as a tied model's load does."""
    initialize_layerwise_reload(model)
    param: Any = model.embed.weight
    param.weight_loader(param, new)  # wrapped by the reload: processes the layer at once


def head_output(model: Toy, x: torch.Tensor) -> torch.Tensor:
    """The logits the engine computes: the head's processed gemm on the CPU build."""
    head = model.head
    out: torch.Tensor = head.quant_method.apply(head, x)
    return out


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the packed copy is the CPU build's")
def test_a_tied_head_keeps_its_packed_copy_unless_refreshed() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, HIDDEN)
    for renew in (False, True):
        model = Toy(UnquantizedEmbeddingMethod())
        new = torch.randn(VOCAB, HIDDEN)
        push_embedding(model, new)
        found = _reload.review(model)
        assert [(s.name, s.sources) for s in found.shared] == [("head", ("embed",))]
        assert found.unfed == ()
        _reload.check(found)
        finalize(model)
        assert model.head.weight is model.embed.weight  # the tie survives ...
        assert torch.equal(model.head.weight, new)  # ... and holds the new values
        if renew:
            _reload.refresh(found.shared)
            torch.testing.assert_close(head_output(model, x), x @ new.T)
        else:  # vLLM alone: the head computes with the start-up weight
            assert not torch.allclose(head_output(model, x), x @ new.T, atol=1e-3)


def test_a_tied_head_whose_processing_cannot_be_renewed_is_refused() -> None:
    model = Toy(Packing())
    push_embedding(model, torch.randn(VOCAB, HIDDEN))
    found = _reload.review(model)
    with pytest.raises(StaleWeightsError) as info:
        _reload.check(found)
    assert info.value.layer == "head"
    assert info.value.sources == ("embed",)
    assert "Packing" in str(info.value) and "'embed'" in str(info.value)
    with pytest.raises(StaleWeightsError):
        _reload.refresh(found.shared)
    _reload.refresh(found.shared, strict=False)  # an abort only logs it
    finalize(model)


def test_a_processed_layer_the_update_cannot_reach_is_refused() -> None:
    # The head has its own tensor, which no loaded tensor feeds (a tie that its
    # processing broke, say): it would keep serving the start-up copy.
    model = Toy(UnquantizedEmbeddingMethod(), tied=False)
    push_embedding(model, torch.randn(VOCAB, HIDDEN))
    found = _reload.review(model)
    assert found.shared == ()
    assert found.unfed == (("head", "UnquantizedEmbeddingMethod"),)
    with pytest.raises(StaleWeightsError, match=r"'head'.*received no tensor"):
        _reload.check(found)
    finalize(model)


def test_restore_unfinished_leaves_no_layer_on_meta_and_the_next_reload_works() -> None:
    model = Toy(UnquantizedEmbeddingMethod())
    old = model.embed.weight.detach().clone()
    initialize_layerwise_reload(model)
    assert model.embed.weight.is_meta and model.head.weight.is_meta
    _reload.restore_unfinished(model)  # a finalize that never ran
    assert torch.equal(model.embed.weight, old)
    assert model.head.weight is model.embed.weight
    new = torch.randn(VOCAB, HIDDEN)
    push_embedding(model, new)  # initialize_layerwise_reload starts afresh
    finalize(model)
    assert torch.equal(model.head.weight, new)
