"""A toy Megatron layout for the conversion tests: TP=2 shards, fused QKV and gate_up.

The engine side is a Llama under Hugging Face names. The trainer side holds, per
tensor-parallel rank, Megatron-Core's names and layout:

- ``linear_qkv``: the query groups of the rank, one after the other; each group is its
  ``heads / kv_heads`` query heads, then its key head, then its value head (``head_dim``
  rows each). Ranks hold consecutive groups.
- ``linear_fc1``: the rank's slice of ``gate_proj`` rows, then its slice of ``up_proj``.
- ``linear_proj`` and ``linear_fc2`` are row-parallel (split along their input), the
  embedding and the output layer vocab-parallel (split along rows); norms replicated.

Module-level factories, so that spawned worker processes can build the engine side.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from asyncrefit import ParamSpec

TP = 2
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 48
LAYERS = 2
VOCAB = 64
GROUP = HEADS // KV_HEADS  # query heads per key/value head

Shards = list[dict[str, torch.Tensor]]  # one dict of Megatron tensors per TP rank


def hf_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The engine's parameters, in the order the conversion yields them."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (FFN, HIDDEN)),
            (p + "mlp.up_proj.weight", (FFN, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, FFN)),
        ]
    out += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return out


def hf_specs(dtype: str = "float32") -> list[ParamSpec]:
    return [ParamSpec(name=n, shape=s, dtype=dtype) for n, s in hf_shapes()]


def hf_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Random full tensors under the engine's names."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in hf_shapes()}


def make_engine_model() -> torch.nn.Module:
    """The engine side: a module with the Hugging Face names, zeroed."""
    root = torch.nn.Module()
    for name, shape in hf_shapes():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root


def to_megatron(hf: Mapping[str, torch.Tensor]) -> Shards:
    """Shard full tensors into the TP=2 Megatron layout described above."""
    ranks: Shards = [{} for _ in range(TP)]
    groups = KV_HEADS // TP

    def rows(t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.chunk(TP, dim=0))

    def cols(t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.chunk(TP, dim=1))

    for r, shard in enumerate(rows(hf["model.embed_tokens.weight"])):
        ranks[r]["embedding.word_embeddings.weight"] = shard.clone()
    for i in range(LAYERS):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].view(KV_HEADS, GROUP, HEAD_DIM, HIDDEN)
        k = hf[p + "self_attn.k_proj.weight"].view(KV_HEADS, 1, HEAD_DIM, HIDDEN)
        v = hf[p + "self_attn.v_proj.weight"].view(KV_HEADS, 1, HEAD_DIM, HIDDEN)
        fused = torch.cat([q, k, v], dim=1)  # [groups, GROUP + 2, head_dim, hidden]
        gate, up = rows(hf[p + "mlp.gate_proj.weight"]), rows(hf[p + "mlp.up_proj.weight"])
        o, down = cols(hf[p + "self_attn.o_proj.weight"]), cols(hf[p + "mlp.down_proj.weight"])
        for r in range(TP):
            mine = fused[r * groups : (r + 1) * groups]
            ranks[r][m + "self_attention.linear_qkv.weight"] = mine.reshape(-1, HIDDEN).clone()
            ranks[r][m + "self_attention.linear_qkv.layer_norm_weight"] = hf[
                p + "input_layernorm.weight"
            ].clone()
            ranks[r][m + "self_attention.linear_proj.weight"] = o[r].clone()
            ranks[r][m + "mlp.linear_fc1.weight"] = torch.cat([gate[r], up[r]]).clone()
            ranks[r][m + "mlp.linear_fc1.layer_norm_weight"] = hf[
                p + "post_attention_layernorm.weight"
            ].clone()
            ranks[r][m + "mlp.linear_fc2.weight"] = down[r].clone()
    for r, shard in enumerate(rows(hf["lm_head.weight"])):
        ranks[r]["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        ranks[r]["output_layer.weight"] = shard.clone()
    return ranks


def _layer(shards: Shards, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    yield p + "input_layernorm.weight", shards[0][m + "self_attention.linear_qkv.layer_norm_weight"]
    qkv = torch.cat(  # the all-gather of the fused projection
        [s[m + "self_attention.linear_qkv.weight"] for s in shards]
    ).view(KV_HEADS, GROUP + 2, HEAD_DIM, HIDDEN)
    yield p + "self_attn.q_proj.weight", qkv[:, :GROUP].reshape(-1, HIDDEN)
    yield p + "self_attn.k_proj.weight", qkv[:, GROUP].reshape(-1, HIDDEN)
    yield p + "self_attn.v_proj.weight", qkv[:, GROUP + 1].reshape(-1, HIDDEN)
    del qkv
    yield (
        p + "self_attn.o_proj.weight",
        torch.cat([s[m + "self_attention.linear_proj.weight"] for s in shards], dim=1),
    )
    yield p + "post_attention_layernorm.weight", shards[0][m + "mlp.linear_fc1.layer_norm_weight"]
    halves = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
    yield p + "mlp.gate_proj.weight", torch.cat([g for g, _ in halves])
    yield p + "mlp.up_proj.weight", torch.cat([u for _, u in halves])
    del halves
    yield (
        p + "mlp.down_proj.weight",
        torch.cat([s[m + "mlp.linear_fc2.weight"] for s in shards], dim=1),
    )


def export_hf_weights(shards: Shards) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-Bridge style: ``(hf_name, full tensor)`` for the whole model, in order."""
    yield (
        "model.embed_tokens.weight",
        torch.cat([s["embedding.word_embeddings.weight"] for s in shards]),
    )
    for i in range(LAYERS):
        yield from _layer(shards, i)
    yield "model.norm.weight", shards[0]["decoder.final_layernorm.weight"]
    yield "lm_head.weight", torch.cat([s["output_layer.weight"] for s in shards])


def convert(shards: Shards, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Per bucket: the tensors of ``names`` only (converting a whole layer at most)."""
    wanted = set(names)
    for name, tensor in export_hf_weights(shards):
        if name in wanted:
            yield name, tensor
