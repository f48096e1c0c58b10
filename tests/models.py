"""Small models for tests: module-level factories, so spawned workers can build them."""

from __future__ import annotations

import torch


def make_mlp() -> torch.nn.Module:
    """A two-layer MLP (~33k float32 parameters), the same for every seed-less call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def make_mlp_wide() -> torch.nn.Module:
    """Like :func:`make_mlp` but the first layer is wider: a shape mismatch."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))


def make_mixed() -> torch.nn.Module:
    """Parameters of several dtypes and a zero-size one."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(33, 7))
    m.b = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
    m.c = torch.nn.Parameter(torch.randn(5, 5).to(torch.float16))
    m.empty = torch.nn.Parameter(torch.empty(0, 4))
    m.d = torch.nn.Parameter(torch.randn(3).double())
    return m


def make_mlp_fp8() -> torch.nn.Module:
    """:func:`make_mlp` as an engine of its FP8 checkpoint holds it: the first layer's
    weight in ``float8_e4m3fn`` with its 128 x 128 block scales (``weight_scale_inv``),
    the rest in float32 (zeros: the trainer's pushes fill them)."""
    m = torch.nn.Module()
    first = torch.nn.Module()
    first.weight = torch.nn.Parameter(
        torch.zeros(256, 64, dtype=torch.float8_e4m3fn), requires_grad=False
    )
    first.weight_scale_inv = torch.nn.Parameter(torch.zeros(2, 1), requires_grad=False)
    first.bias = torch.nn.Parameter(torch.zeros(256))
    second = torch.nn.Module()
    second.weight = torch.nn.Parameter(torch.zeros(64, 256))
    second.bias = torch.nn.Parameter(torch.zeros(64))
    m.add_module("0", first)
    m.add_module("2", second)
    return m


def make_mlp_bf16() -> torch.nn.Module:
    """:func:`make_mlp` held in bfloat16: an engine fed from fp32 master weights."""
    return make_mlp().to(torch.bfloat16)


class ValueHeadPolicy(torch.nn.Module):
    """A PPO-style trainer model: the policy under wrapper prefixes, plus a value head.

    Its parameters are named ``module._orig_mod.0.weight`` (DDP around
    ``torch.compile``) and ``v_head.weight``; the engine holds only :func:`make_mlp`'s.
    """

    def __init__(self) -> None:
        super().__init__()
        inner = torch.nn.Module()
        inner._orig_mod = make_mlp()
        self.module = inner
        self.v_head = torch.nn.Linear(64, 1)
