"""Tiny models for the vLLM tests, made with ``transformers``: nothing is downloaded.

The trainer is a ``transformers`` Llama or Qwen2 (Hugging Face parameter names); the
engine loads the same checkpoint. ``tied=True`` ties the output head to the input
embeddings (``tie_word_embeddings``), as Llama-3.2-1B/3B, Qwen2-0.5B/1.5B and Gemma do:
the checkpoint then has no ``lm_head.weight``, and neither has the trainer's
``named_parameters()``. Greedy decoding is written out (argmax of the full
forward pass) so that no generation config (an EOS token, say) makes the trainer stop
where the engine, started without a tokenizer, does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from asyncrefit.vllm import engine_args

# head_dim 64 (128 / 2 heads): vLLM's CPU attention rejects small head sizes.
CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    # Wider than the default 0.02: logits far apart, so greedy tokens do not flip on
    # the last-bit differences between vLLM's CPU kernels and transformers.
    "initializer_range": 0.1,
}

PROMPTS: list[list[int]] = [[1, 2, 3, 4], [7, 8, 9], [100, 200, 300, 400, 5]]

#: Engine arguments for a small CPU engine: little memory, no compilation.
ENGINE_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "max_model_len": 512,
    "gpu_memory_utilization": 0.1,
    "kv_cache_memory_bytes": 64 << 20,
    "enforce_eager": True,
    "seed": 0,
    **engine_args(),
}


def make_checkpoint(path: Path, seed: int = 0, *, arch: str = "llama", tied: bool = False) -> Path:
    """Save a random tiny Llama or Qwen2 (float32, safetensors) into ``path``."""
    torch.manual_seed(seed)
    config = {**CONFIG, "tie_word_embeddings": tied}
    model: Any
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**config))  # type: ignore[no-untyped-call, unused-ignore]
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**config))  # type: ignore[no-untyped-call, unused-ignore]
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    model.save_pretrained(path)  # float32: the default dtype
    return path


def load_trainer(path: Path) -> torch.nn.Module:
    """The trainer's copy: the checkpoint the engine started from."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """A large, deterministic change of every parameter (a stand-in for training)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def prefixed(block_size: int) -> list[list[int]]:
    """PROMPTS behind one shared prefix longer than two KV blocks (a system prompt)."""
    prefix = [(37 * i + 11) % 500 + 1 for i in range(2 * block_size + 40)]
    assert len(prefix) + max(map(len, PROMPTS)) + 16 <= ENGINE_KWARGS["max_model_len"]
    return [prefix + p for p in PROMPTS]


def block_size(engine: Any) -> int:
    config = engine.vllm_config if hasattr(engine, "vllm_config") else engine.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching  # vLLM's default: the case RL runs
    return int(config.cache_config.block_size)


@torch.no_grad()
def greedy(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], tokens: int
) -> list[list[int]]:
    """The trainer's greedy continuation of every prompt."""
    out = []
    device = next(model.parameters()).device
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], device=device)
        new: list[int] = []
        for _ in range(tokens):
            logits = model(input_ids=ids).logits[0, -1]
            token = int(logits.argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        out.append(new)
    return out


@torch.no_grad()
def greedy_gaps(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
) -> list[list[float]]:
    """How far below the best logit each token of ``continuations`` is, the model fed
    the continuation itself (teacher forcing): all zeros for its own greedy tokens.

    Another engine's greedy tokens in a low precision may part from ``greedy``'s at a
    near tie, and then follow another prefix; their gaps stay at the rounding's size,
    while a stale weight puts its tokens far below the best.
    """
    gaps = []
    device = next(model.parameters()).device
    for prompt, continuation in zip(prompts, continuations, strict=True):
        ids = torch.tensor([[*prompt, *continuation]], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        picked = torch.tensor(list(continuation), device=device)[:, None]
        chosen = logits.gather(1, picked)[:, 0]
        gaps.append((logits.max(dim=1).values - chosen).tolist())
    return gaps


def engine_processes() -> set[int]:
    """This process's live descendants (vLLM's engine core and its workers), without
    multiprocessing's resource tracker."""
    found: set[int] = set()
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for children in _children_files(pid):
            try:
                with open(children) as f:
                    kids = {int(p) for p in f.read().split()}
            except FileNotFoundError:
                continue
            todo.extend(kids - found)
            found |= kids
    return {p for p in found if _alive(p) and not _helper(p)}


def _helper(pid: int) -> bool:
    # multiprocessing's resource tracker, started by vLLM, lives as long as this process
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except FileNotFoundError:
        return False


def _children_files(pid: int) -> Iterator[str]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in tasks:
        yield f"/proc/{pid}/task/{tid}/children"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
