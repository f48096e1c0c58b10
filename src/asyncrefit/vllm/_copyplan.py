"""A copy plan: where the elements of each checkpoint tensor land in an engine's parameters.

An engine's parameters are not the checkpoint's tensors: vLLM fuses ``q/k/v_proj``
into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``, keeps one rank's slice
under tensor parallelism, pads the vocabulary, stacks experts. Rather than read each
model's loading rules, :func:`learn` runs the model's own ``load_weights`` once on
tensors that *encode element positions* (float64, every element its own number),
with every parameter temporarily swapped for a float64 tensor filled with ``-1``, and
reads back where each number landed. Where the elements of a checkpoint tensor land
in a parameter as one rectangular block, taken from one rectangular block of the
tensor, the plan records a :class:`BlockCopy`; a tensor whose loading does anything
else (a transform of values, a reshape, a layer whose processing after loading
derives state from its weights) is listed in :attr:`CopyPlan.staged` and keeps
vLLM's own reload. :func:`apply` then writes a checkpoint's tensors into the
parameters by the plan: strided copies, casting on the way.

This is the ground for direct writes into a vLLM engine (issue 28); the plan is
verified bitwise against what the engine loaded (:func:`mismatches`) before it is
trusted. Learning holds the parameters as float64 for its duration (8 bytes an
element): on a GPU, learn per group of layers for a large model (not done yet).

This module imports torch only: it runs in vLLM's worker processes and in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """``target[target_box] = source[source_box]`` (same shape; a cast if dtypes differ)."""

    source: str
    source_box: Box
    target: str
    target_box: Box

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.source_box)


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The block copies learned, and the checkpoint tensors left to vLLM's reload."""

    copies: tuple[BlockCopy, ...]
    staged: tuple[str, ...]
    #: Elements of the checkpoint tensors that the block copies write (counted once
    #: per copy: a tied tensor written to two parameters counts twice).
    copied_elements: int
    #: Elements of every checkpoint tensor given to :func:`learn`.
    source_elements: int

    def summary(self) -> dict[str, Any]:
        return {
            "copies": len(self.copies),
            "sources": sorted({c.source for c in self.copies}),
            "staged": list(self.staged),
            "copied_elements": self.copied_elements,
            "source_elements": self.source_elements,
            "targets": sorted({c.target for c in self.copies}),
        }


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def learn(
    model: torch.nn.Module,
    shapes: Mapping[str, Sequence[int]],
    *,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
    processed: Callable[[str], bool] | None = None,
) -> CopyPlan:
    """Learn where each of the checkpoint tensors ``shapes`` lands in ``model``.

    ``load`` loads ``(name, tensor)`` pairs into the model (default: its
    ``load_weights``); ``processed(parameter name)`` says whether the parameter's
    layer derives state from it after loading (its sources are then staged). Every
    parameter's data is restored afterwards, also when loading raises.
    """
    load = load if load is not None else model.load_weights  # type: ignore[assignment]
    assert load is not None
    params = dict(model.named_parameters(remove_duplicate=True))
    saved = {name: p.data for name, p in params.items()}
    names = list(shapes)
    bases: list[int] = []
    total = 0
    for name in names:
        bases.append(total)
        total += math.prod(shapes[name])
    if total >= 2**53:
        raise ValueError("too many elements to encode exactly in float64")
    readback: dict[str, torch.Tensor] = {}
    refused: set[str] = set()
    try:
        with torch.no_grad():
            for p in params.values():
                p.data = torch.full(p.shape, -1.0, dtype=torch.float64, device=p.device)
            device = next(iter(saved.values())).device if saved else torch.device("cpu")
            # One tensor at a time: a tensor the loader refuses (a layer whose weight
            # was repacked after loading, so its parameter no longer has the
            # checkpoint's shape) is left to the reload; the others are learned.
            for name, base in zip(names, bases, strict=True):
                n = math.prod(shapes[name])
                values = torch.arange(base, base + n, dtype=torch.float64, device=device)
                try:
                    load([(name, values.view(tuple(shapes[name])))])
                except Exception:
                    refused.add(name)
            for name, p in params.items():
                readback[name] = p.data.detach().cpu()
    finally:
        for name, p in params.items():
            p.data = saved[name]
    plan = _read(readback, names, bases, shapes, total, processed or (lambda _: False))
    if not refused:
        return plan
    staged = set(plan.staged) | refused
    copies = tuple(c for c in plan.copies if c.source not in staged)
    return CopyPlan(
        copies=copies,
        staged=tuple(sorted(staged)),
        copied_elements=sum(c.numel for c in copies),
        source_elements=total,
    )


def _read(
    readback: Mapping[str, torch.Tensor],
    names: list[str],
    bases: list[int],
    shapes: Mapping[str, Sequence[int]],
    total: int,
    processed: Callable[[str], bool],
) -> CopyPlan:
    staged: set[str] = set()
    copies: list[BlockCopy] = []
    edges = torch.tensor(bases, dtype=torch.float64)
    for target, values in readback.items():
        written = values >= 0
        if not bool(written.any()):
            continue
        exact = written & (values == values.round()) & (values < total)
        source_id = torch.bucketize(values, edges, right=True) - 1
        ids = sorted({int(i) for i in torch.unique(source_id[written]).tolist()})
        if not bool((exact == written).all()):  # a value that is no position: transformed
            staged.update(names[i] for i in ids if 0 <= i < len(names))
            continue
        for i in ids:
            name = names[i]
            if processed(target):
                staged.add(name)
                continue
            copy = _block(values, source_id == i, bases[i], tuple(shapes[name]), name, target)
            if copy is None:
                staged.add(name)
            else:
                copies.append(copy)
    copies = [c for c in copies if c.source not in staged]
    return CopyPlan(
        copies=tuple(copies),
        staged=tuple(sorted(staged)),
        copied_elements=sum(c.numel for c in copies),
        source_elements=total,
    )


def _block(
    values: torch.Tensor,
    mask: torch.Tensor,
    base: int,
    shape: tuple[int, ...],
    source: str,
    target: str,
) -> BlockCopy | None:
    """The block copy that puts these positions there, or ``None`` if it is not one."""
    if values.dim() != len(shape):
        return None
    box = []
    for d in range(values.dim()):
        other = tuple(k for k in range(values.dim()) if k != d)
        hit = mask.any(dim=other) if other else mask
        where = torch.nonzero(hit).flatten()
        box.append((int(where[0]), int(where[-1]) + 1))
    target_box = tuple(box)
    region = _slices(target_box)
    if not bool(mask[region].all()):
        return None
    local = (values[region] - base).to(torch.int64)
    start = [int(x) for x in torch.unravel_index(local.min(), shape)]
    extent = [b - a for a, b in target_box]
    source_box = tuple((s, s + e) for s, e in zip(start, extent, strict=True))
    if any(b > n for (_, b), n in zip(source_box, shape, strict=True)):
        return None
    expected = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)[_slices(source_box)]
    if not torch.equal(expected, local):
        return None
    return BlockCopy(source=source, source_box=source_box, target=target, target_box=target_box)


def apply(
    plan: CopyPlan, params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Write ``tensors`` (checkpoint tensors by name) into ``params`` by ``plan``."""
    with torch.no_grad():
        for c in plan.copies:
            params[c.target][_slices(c.target_box)].copy_(tensors[c.source][_slices(c.source_box)])


def mismatches(
    plan: CopyPlan, params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> list[str]:
    """The targets where ``plan`` applied to ``tensors`` differs from ``params`` (what
    the engine loaded from the same tensors): empty when the plan is right."""
    wrong = []
    with torch.no_grad():
        for c in plan.copies:
            want = params[c.target][_slices(c.target_box)]
            got = tensors[c.source][_slices(c.source_box)].to(want.dtype)
            if not torch.equal(_bits(got), _bits(want)):
                wrong.append(f"{c.target}{list(c.target_box)} <- {c.source}")
    return wrong


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
