"""vLLM's layerwise reload, and the layers it would leave serving old weights.

vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``) processes a layer
(``quant_method.process_weights_after_loading``: repacking, quantizing, building the
packed copy a kernel reads) when all of its tensors have arrived, and puts a layer that
received no tensor back as it was, with whatever its processing derived at start-up.
That is right for a layer whose tensors did not change. It is wrong for a layer that
received nothing but *shares* a tensor with a layer that was written: a tied
``lm_head`` holds the very ``Parameter`` of ``embed_tokens`` (the model's
``load_weights`` skips ``lm_head.*`` when the embeddings are tied, and the checkpoint
has no such tensor). The shared tensor gets the new values; what the head's processing
derived from it stays. On vLLM's CPU build that is the oneDNN handle the logits gemm
runs on, which packs its own copy of the weight: the engine keeps sampling through the
head it loaded at start-up. (vLLM lists tied parameters among the limitations of
layerwise reload.)

:func:`review` looks at the open reload after the last load: the layers that received
nothing but share tensors with written ones, and the layers that received nothing,
share nothing, yet have post-load processing (their tensors came from a checkpoint
tensor through something the reload does not repeat, such as a tie that processing
broke). :func:`check` refuses an update that would leave either kind stale, and
:func:`refresh` re-runs the processing of shared layers after the reload is finalized,
as start-up ran it: on the shared tensors, once the layer that owns them was processed.
Only processing known to derive its state from the tensors without changing them is
re-run (:data:`REDERIVABLE`); for any other the update fails with
:class:`~asyncrefit.StaleWeightsError` instead of reporting success.

MoE layers have one more step that the reload skips: once an expert kernel exists,
vLLM's weight update does not run the kernel's own repacking
(``fused_experts.process_weights_after_loading``), so on vLLM's CPU build the grouped
gemm would read the new weights in the checkpoint's layout as if they were packed.
:func:`repack` runs it for the MoE layers the update wrote, after the finalize, for the
kernels known to repack from the checkpoint's layout (:data:`REPACKING_EXPERTS`).

This module imports torch and vLLM: only vLLM worker processes import it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .._exceptions import StaleWeightsError
from ._compat import is_attention

logger = logging.getLogger(__name__)

__all__ = (
    "REDERIVABLE",
    "REPACKING_EXPERTS",
    "RepackedExperts",
    "Review",
    "SharedLayer",
    "check",
    "refresh",
    "repack",
    "restore_unfinished",
    "review",
)

#: Names of the processing classes (``quant_method`` types) whose
#: ``process_weights_after_loading`` only derives state from a layer's tensors (a
#: kernel's packed copy) and leaves the tensors as they are, so that running it again
#: on the updated tensors is what a fresh start-up would do. vLLM's unquantized
#: embedding method (the one of ``VocabParallelEmbedding`` and ``ParallelLMHead``) packs
#: the weight for the CPU gemm and does nothing elsewhere.
REDERIVABLE: frozenset[str] = frozenset({"UnquantizedEmbeddingMethod"})

#: Names of MoE expert kernels (``quant_method.moe_kernel.fused_experts`` types) whose
#: ``process_weights_after_loading`` repacks a layer's ``w13_weight`` and ``w2_weight``
#: into the kernel's own layout, from the checkpoint's layout, and that vLLM (0.32)
#: does not run again on a weight update (``_setup_kernel`` skips it once a kernel
#: exists): the engine's CPU build, whose grouped gemm then reads unpacked weights.
#: asyncrefit runs it again after the reload, as start-up did. Another expert kernel
#: that repacks is refused (:class:`~asyncrefit.StaleWeightsError`) rather than left
#: reading a stale packed copy.
REPACKING_EXPERTS: frozenset[str] = frozenset(
    {
        "CPUUnquantizedExperts",
        "X86CPUUnquantizedExperts",
        "ArmCPUUnquantizedExperts",
        "PowerCPUUnquantizedExperts",
    }
)

_StorageKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class SharedLayer:
    """A layer that received no tensor but shares tensors with ``sources``, which did."""

    name: str
    layer: torch.nn.Module
    sources: tuple[str, ...]


def _storage(tensor: torch.Tensor) -> _StorageKey | None:
    if tensor.is_meta:
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None  # e.g. the empty weight a CPU linear layer keeps after packing
    return str(tensor.device), storage.data_ptr()


def _tensors(layer: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from (p for p in layer._parameters.values() if p is not None)
    yield from (b for b in layer._buffers.values() if b is not None)


def _kernel_tensors(info: object) -> Iterator[torch.Tensor]:
    kernel = getattr(info, "kernel_tensors", None)
    if kernel is not None:
        params, buffers = kernel
        yield from params.values()
        yield from buffers.values()


@dataclass(frozen=True, slots=True)
class RepackedExperts:
    """A MoE layer written by this update whose expert kernel repacks its weights."""

    name: str
    layer: torch.nn.Module
    experts: object


def _repacking_experts(layer: torch.nn.Module) -> object | None:
    """The layer's MoE expert kernel if it repacks weights after loading, else ``None``."""
    method = getattr(layer, "quant_method", None)
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if experts is None:
        return None
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    own = type(experts).process_weights_after_loading
    return experts if own is not FusedMoEExperts.process_weights_after_loading else None


@dataclass(frozen=True, slots=True)
class Review:
    """What :func:`review` found: layers to renew, and layers that cannot follow."""

    shared: tuple[SharedLayer, ...] = ()
    unfed: tuple[tuple[str, str], ...] = ()  # (layer, its processing)
    repacked: tuple[RepackedExperts, ...] = ()


def review(model: torch.nn.Module) -> Review:
    """The layers of ``model`` that received no tensor in the open reload and either
    share a tensor (storage) with a layer that did, or have post-load processing.

    Call it after the last load and before ``finalize_layerwise_reload``: a layer
    processed while loading has its tensors back in place (its reload info is reset);
    one that received part of its tensors is processed by the finalize; one that
    received none gets its start-up tensors (``kernel_tensors``) back, which may be
    the written layer's own. Attention layers are processed by the finalize anyway.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    written: dict[_StorageKey, str] = {}
    untouched: list[tuple[str, torch.nn.Module, list[_StorageKey], bool]] = []
    repacked: list[RepackedExperts] = []
    for name, layer in model.named_modules():
        info = layerwise.get_layerwise_info(layer)
        if not info.can_load() or info.load_numel > 0:
            experts = _repacking_experts(layer)  # written (or without tensors: none)
            if experts is not None:
                repacked.append(RepackedExperts(name=name, layer=layer, experts=experts))
        if not info.can_load():
            tensors: Iterable[torch.Tensor] = _tensors(layer)  # processed while loading
        elif info.load_numel > 0:
            tensors = _kernel_tensors(info)  # the finalize processes it
        else:
            keys = [k for k in map(_storage, _kernel_tensors(info)) if k is not None]
            loadable = (info.load_numel_total or 0) > 0
            untouched.append((name, layer, keys, loadable))
            continue
        for key in map(_storage, tensors):
            if key is not None:
                written.setdefault(key, name)
    shared: list[SharedLayer] = []
    unfed: list[tuple[str, str]] = []
    for name, layer, keys, loadable in untouched:
        sources = sorted({written[k] for k in keys if k in written})
        if sources:
            shared.append(SharedLayer(name=name, layer=layer, sources=tuple(sources)))
            continue
        processing = _processing(layer)
        if loadable and processing is not None and not _is_attention(layer):
            unfed.append((name, processing))
    return Review(shared=tuple(shared), unfed=tuple(unfed), repacked=tuple(repacked))


def _is_attention(layer: torch.nn.Module) -> bool:
    return is_attention(layer)


def _processing(layer: torch.nn.Module) -> str | None:
    """The class name of what derives state from the layer's tensors after loading, or
    ``None`` if nothing does (no ``quant_method``, not a deferred attention layer)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if _is_attention(layer):
        return type(layer).__name__
    method = getattr(layer, "quant_method", None)
    if isinstance(method, QuantizeMethodBase):
        return type(method).__name__
    return None


def _unrenewable(s: SharedLayer) -> StaleWeightsError | None:
    processing = _processing(s.layer)
    if processing is None or processing in REDERIVABLE:
        return None
    shared = ", ".join(repr(n) for n in s.sources)
    return StaleWeightsError(
        s.name,
        f"it shares tensors with {shared}, which this update wrote, and its post-load "
        f"processing ({processing}) may keep a copy derived from them that asyncrefit "
        "cannot renew (it is not known to be safe to run again)",
        s.sources,
    )


def _unrepackable(r: RepackedExperts) -> StaleWeightsError | None:
    kind = type(r.experts).__name__
    if kind not in REPACKING_EXPERTS:
        return StaleWeightsError(
            r.name,
            f"its MoE expert kernel ({kind}) repacks the weights after loading, which "
            "vLLM does not repeat on a weight update, and asyncrefit does not know it to "
            "be safe to run again",
        )
    padded = getattr(r.experts, "_padded_intermediate_size", None)
    config = getattr(r.experts, "moe_config", None)
    size = getattr(config, "intermediate_size_per_partition", None)
    if callable(padded) and config is not None and padded(config) != size:
        return StaleWeightsError(
            r.name,
            f"its MoE expert kernel ({kind}) pads the intermediate size from {size} to "
            f"{padded(config)} when it repacks, which cannot be repeated on a weight update",
        )
    return None


def check(found: Review) -> None:
    """Raise :class:`StaleWeightsError` for the first layer that would serve stale
    weights after the update: a shared one :func:`refresh` cannot renew, one whose
    processed tensors the update did not reach, or MoE experts :func:`repack` cannot
    repack."""
    for r in found.repacked:
        error = _unrepackable(r)
        if error is not None:
            raise error
    for s in found.shared:
        error = _unrenewable(s)
        if error is not None:
            raise error
    for name, processing in found.unfed:
        raise StaleWeightsError(
            name,
            "it received no tensor of this update and shares none with a layer that "
            f"did, yet its post-load processing ({processing}) derived state from "
            "tensors it got from the checkpoint some other way (a tie broken by that "
            "processing?); the update cannot renew them",
        )


def _snapshot(layer: torch.nn.Module) -> list[tuple[str, int, int, int, tuple[int, ...]]]:
    named = list(layer._parameters.items()) + list(layer._buffers.items())
    return [
        (name, id(t), t.data_ptr(), t._version, tuple(t.shape))
        for name, t in named
        if t is not None
    ]


def refresh(shared: Iterable[SharedLayer], *, strict: bool = True) -> None:
    """Re-run the post-load processing of every layer in ``shared`` on its (updated)
    tensors; call it after ``finalize_layerwise_reload``.

    A layer without processing has nothing derived to renew. One whose processing is
    not in :data:`REDERIVABLE`, or changed the layer's tensors when run again, raises
    :class:`StaleWeightsError` (``strict``) or is logged (an abort, which leaves the
    worker without a complete version anyway).
    """
    for s in shared:
        try:
            _refresh_one(s)
        except StaleWeightsError:
            if strict:
                raise
            logger.error("layer %s may serve stale weights", s.name, exc_info=True)


def _refresh_one(s: SharedLayer) -> None:
    error = _unrenewable(s)
    if error is not None:
        raise error
    method = getattr(s.layer, "quant_method", None)
    if _processing(s.layer) is None or method is None:
        return  # nothing derived from the tensors: the shared values are all it uses
    before = _snapshot(s.layer)
    with torch.no_grad():
        method.process_weights_after_loading(s.layer)
    update_tp = getattr(s.layer, "update_param_tp_status", None)
    if callable(update_tp):  # as start-up does after processing
        update_tp()
    if _snapshot(s.layer) != before:
        raise StaleWeightsError(
            s.name,
            "running its post-load processing again, to renew what it derived from "
            "tensors this update wrote, changed the tensors themselves",
            s.sources,
        )
    logger.debug("layer %s: processing re-run on tensors shared with %s", s.name, s.sources)


def repack(layers: Iterable[RepackedExperts], *, strict: bool = True) -> None:
    """Run the expert kernel's repacking of every MoE layer written by the update, after
    ``finalize_layerwise_reload`` (which left their weights in the checkpoint's layout,
    see :data:`REPACKING_EXPERTS`). ``strict``: raise :class:`StaleWeightsError` for
    one that cannot be repacked (else logged: an abort, the worker holds no version)."""
    for r in layers:
        try:
            error = _unrepackable(r)
            if error is not None:
                raise error
            with torch.no_grad():
                r.experts.process_weights_after_loading(r.layer)  # type: ignore[attr-defined]
            logger.debug("layer %s: expert weights repacked", r.name)
        except StaleWeightsError:
            if strict:
                raise
            logger.error("layer %s may serve stale expert weights", r.name, exc_info=True)


def restore_unfinished(model: torch.nn.Module) -> None:
    """After a finalize that raised: give every layer the finalize did not reach its
    start-up tensors back, so that no layer is left on the meta device and the next
    reload starts afresh. The worker holds no complete version afterwards."""
    from vllm.model_executor.model_loader.reload import layerwise

    place = getattr(layerwise, "_place_kernel_tensors", None)
    for name, layer in model.named_modules():
        info = layerwise.get_layerwise_info(layer)
        if not info.can_load():
            continue
        try:
            if info.kernel_tensors is not None and place is not None:
                place(layer, info)
        except Exception:
            logger.exception("layer %s: restoring its tensors failed", name)
        info.reset()  # type: ignore[no-untyped-call, unused-ignore]
    layerwise.LOADING_LAYERS.clear()
