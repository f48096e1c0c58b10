"""Tiny ``transformers`` models whose in-memory layout is not their checkpoint's.

transformers 5 holds a MoE layer's experts fused (``mlp.experts.gate_up_proj`` of shape
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) where the checkpoint, and vLLM,
has one tensor per expert (``experts.<e>.w1.weight`` or ``gate_proj.weight``...).
Module-level factories, so that spawned worker processes can build the same shapes.
Nothing is downloaded: configs are written out here.
"""

from __future__ import annotations

from typing import Any

import torch

from .vllm_models import CONFIG

#: Dimensions every model shares: those of the dense vLLM test models (head_dim 64,
#: wide weights so that greedy tokens do not flip on last-bit differences).
COMMON: dict[str, Any] = dict(CONFIG)

#: MoE architectures vLLM's CPU build serves (4 experts, top-2).
VLLM_MOE = ("mixtral", "qwen3_moe", "qwen2_moe")
#: Every architecture the conversion is checked on (dense Llama converts nothing).
ARCHS = (*VLLM_MOE, "phimoe", "olmoe", "deepseek_v2", "llama")


#: Per architecture: transformers' config and model class names, and the config's
#: MoE arguments (4 experts, top-2).
_ARCH: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 128, "head_dim": 64},
    ),
    # with a shared expert beside the routed ones
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
    ),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_local_experts": 4}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "eos_token_id": 1}),
    # multi-head latent attention, a dense first layer, a shared expert
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 64,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
}


def make_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A random tiny ``arch`` model (float32), the same for the same seed."""
    import transformers

    config_name, model_name, moe = _ARCH[arch]
    if moe:
        moe = {"num_experts_per_tok": 2, **moe}
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**COMMON, **moe, **overrides})
    return getattr(transformers, model_name)(config).eval()


def checkpoint_tensors(model: Any) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for ``model``: transformers' own conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: t.contiguous() for n, t in revert_weight_conversion(model, state).items()}


def checkpoint_zeros(arch: str) -> dict[str, torch.Tensor]:
    """An engine's parameters for ``arch``: its checkpoint's names and shapes, zeroed."""
    return {n: torch.zeros_like(t) for n, t in checkpoint_tensors(make_model(arch)).items()}


def fused_expert_bytes(model: Any) -> int:
    """The size of the largest fused expert tensor (a budget below it must split it)."""
    return max(int(p.nbytes) for n, p in model.named_parameters() if ".experts." in n)


def train_step(model: Any, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One real optimizer step of a language-model loss on random tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=gen)
    ids = ids.to(next(model.parameters()).device)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
