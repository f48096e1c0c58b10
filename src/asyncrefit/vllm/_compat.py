"""What differs between the vLLM releases asyncrefit supports (0.26 to 0.33), in one place.

vLLM's weight-transfer API (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``, the ``WeightTransferEngine`` a backend
implements) and its layerwise reload exist from 0.26 on. What changed since:

============================  ===========================  ==========================
                              0.26 (torch 2.11)            0.32 / 0.33 (torch 2.13)
============================  ===========================  ==========================
weight version label          none (outputs carry none)    ``finish_weight_update(
                                                           weight_version=)``,
                                                           ``set_weight_version``
``WeightTransferEngine``      ``trainer_send_weights``     ``trainer_send_weights``
                              is abstract                  is not
attention layers in the       ``isinstance(Attention,      ``is_deferred_attention_
reload                        MLAAttention)``              layer``
releasing the trainer         nothing in vLLM: the         ``shutdown_weight_transfer_
connection                    extension's own RPC          engine``
the loader's                  ``(folder, files,            a fourth value
``_prepare_weights``          use_safetensors)``
============================  ===========================  ==========================

asyncrefit keeps its own version on every worker (``VLLMWorker.weight_version()``), so
on 0.26 only vLLM's label is missing: requests' outputs and the engine carry none. The
connection is released through the extension's RPC on every release (one path).
Features are read from vLLM's classes, not from its version string, so a patched
build is judged by what it has. Imports vLLM lazily: importing this module does not.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch

#: The vLLM releases asyncrefit is tested with (the CPU tests run 0.32; the GPU tests
#: 0.26, the newest release built for torch 2.11).
SUPPORTED = ">=0.26,<0.34"


@dataclass(frozen=True, slots=True)
class Features:
    """What the installed vLLM has, where releases differ."""

    version: str
    #: The engine carries a weight-version label (``finish_weight_update(weight_version=)``
    #: on ``AsyncLLM``, ``set_weight_version`` on ``LLMEngine``), and outputs carry it.
    weight_versions: bool


@functools.cache
def features() -> Features:
    """The installed vLLM's :class:`Features` (read once per process)."""
    with warnings.catch_warnings():
        # vLLM's import touches deprecated torch attributes; they are vLLM's to fix.
        warnings.simplefilter("ignore")
        import vllm
        from vllm.v1.engine.async_llm import AsyncLLM

    finish = inspect.signature(AsyncLLM.finish_weight_update).parameters
    return Features(
        version=str(getattr(vllm, "__version__", "unknown")),
        weight_versions="weight_version" in finish and hasattr(AsyncLLM, "update_weight_version"),
    )


def is_attention(layer: torch.nn.Module) -> bool:
    """Whether vLLM's reload processes ``layer`` after every other layer (attention)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # 0.26
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        return isinstance(layer, (Attention, MLAAttention))
    return bool(is_deferred_attention_layer(layer))


def checkpoint_files(loader: Any, model_config: Any) -> tuple[list[str], bool]:
    """The checkpoint files vLLM's default ``loader`` loaded ``model_config`` from, and
    whether they are safetensors: the same selection (index filtering included) as the
    load at start-up."""
    prepared = loader._prepare_weights(model_config.model, None, model_config.revision, True, None)
    return list(prepared[1]), bool(prepared[2])  # 0.26: 3 values; 0.32: 4


def not_a_trainer_side(iterator: Any, trainer_args: Any) -> None:
    """``WeightTransferEngine.trainer_send_weights`` (abstract in 0.26): asyncrefit's
    coordinator sends the weights, never vLLM's trainer-side helper."""
    raise NotImplementedError(
        "asyncrefit's backend is driven by asyncrefit.RefitCoordinator, not by trainer_send_weights"
    )
