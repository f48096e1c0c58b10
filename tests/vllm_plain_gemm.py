"""A vLLM worker extension whose CPU engine reads every linear weight as loaded.

vLLM's CPU build packs a copy of every linear layer's weight for oneDNN after loading
(``dispatch_cpu_unquantized_gemm``), so none of them can be written in place: a
push must run vLLM's reload for them, and asyncrefit's direct writes stay off (as they
should). vLLM itself keeps some layers on torch's own ``linear`` (MLA's ``kv_b_proj``);
this module, imported into every worker before the model is built (vLLM imports the
``worker_extension_cls``'s module first), makes every layer do so. The engine is
otherwise vLLM's as it is: its loaders, session, scheduler and prefix cache. It is how
the CPU tests reach the direct path into vLLM that a GPU engine takes with unquantized
weights; the GPU tests run it without this module.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers import utils

from asyncrefit.vllm.worker import RefitWorkerExtension


def _torch_linear(layer: Any, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


utils.dispatch_cpu_unquantized_gemm = _torch_linear


class PlainGemmRefitWorkerExtension(RefitWorkerExtension):
    """asyncrefit's worker extension, loaded from a module that keeps weights as loaded."""

    def test_move_a_parameter(self, name: str, replace: bool = False) -> None:
        """Give parameter ``name`` new memory (as reloading a model does); with
        ``replace``, a new parameter object in its module (the old one left as it was)."""
        model = self._asyncrefit_engine().model
        param = dict(model.named_parameters())[name]
        if replace:
            owner, _, attr = name.rpartition(".")
            new = torch.nn.Parameter(param.data.clone(), requires_grad=False)
            setattr(model.get_submodule(owner), attr, new)
        else:
            param.data = param.data.clone()


#: ``worker_extension_cls`` for a CPU engine written directly.
EXTENSION = f"{__name__}.{PlainGemmRefitWorkerExtension.__name__}"
