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


def layer_of(name: str) -> int | None:
    """The layer a tensor or parameter belongs to: the first number in its dotted
    name (``model.layers.3.mlp.up_proj.weight`` -> 3), ``None`` for one outside the
    numbered layers (embeddings, final norm, head)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def learn(
    model: torch.nn.Module,
    shapes: Mapping[str, Sequence[int]],
    *,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
    processed: Callable[[str], bool] | None = None,
    group: Callable[[str], object] = layer_of,
) -> CopyPlan:
    """Learn where each of the checkpoint tensors ``shapes`` lands in ``model``.

    ``load`` loads ``(name, tensor)`` pairs into the model (default: its
    ``load_weights``); ``processed(parameter name)`` says whether the parameter's
    layer derives state from it after loading (its sources are then staged).

    Memory is bounded by a group of layers, not the model: the tensors are learned
    a group at a time (``group`` of a name, by default its layer), with the
    parameters of that group swapped for float64 and every other parameter for an
    empty tensor, so a loader that writes outside the group fails and its tensor is
    staged. A tensor that lands nowhere is staged too. Every parameter's data is
    restored afterwards, also when loading raises.
    """
    load = load if load is not None else model.load_weights  # type: ignore[assignment]
    assert load is not None
    params = dict(model.named_parameters(remove_duplicate=True))
    saved = {name: p.data for name, p in params.items()}
    device = next(iter(saved.values())).device if saved else torch.device("cpu")
    groups: dict[object, list[str]] = {}
    for name in shapes:
        groups.setdefault(group(name), []).append(name)
    copies: list[BlockCopy] = []
    staged: set[str] = set()
    total = 0
    try:
        with torch.no_grad():
            for key, names in groups.items():
                members = [n for n in params if group(n) == key]
                for name, p in params.items():
                    if name in members:
                        p.data = torch.full(
                            saved[name].shape, -1.0, dtype=torch.float64, device=device
                        )
                    else:
                        p.data = torch.empty(0, dtype=torch.float64, device=p.device)
                found, refused = _learn_group(
                    load, names, shapes, {n: params[n] for n in members}, processed, device
                )
                copies.extend(found.copies)
                staged.update(found.staged, refused)
                total += found.source_elements
    finally:
        for name, p in params.items():
            p.data = saved[name]
    landed = {c.source for c in copies}
    staged.update(n for n in shapes if n not in landed)
    kept = tuple(c for c in copies if c.source not in staged)
    return CopyPlan(
        copies=kept,
        staged=tuple(sorted(staged)),
        copied_elements=sum(c.numel for c in kept),
        source_elements=total,
    )


def _learn_group(
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    names: list[str],
    shapes: Mapping[str, Sequence[int]],
    params: Mapping[str, torch.nn.Parameter],
    processed: Callable[[str], bool] | None,
    device: torch.device,
) -> tuple[CopyPlan, set[str]]:
    bases: list[int] = []
    total = 0
    for name in names:
        bases.append(total)
        total += math.prod(shapes[name])
    if total >= 2**53:
        raise ValueError("too many elements to encode exactly in float64")
    refused: set[str] = set()
    # One tensor at a time: a tensor the loader refuses (a layer whose weight was
    # repacked after loading, so its parameter no longer has the checkpoint's shape; a
    # parameter outside this group) is left to the reload; the others are learned.
    for name, base in zip(names, bases, strict=True):
        n = math.prod(shapes[name])
        values = torch.arange(base, base + n, dtype=torch.float64, device=device)
        try:
            load([(name, values.view(tuple(shapes[name])))])
        except Exception:
            refused.add(name)
        del values
    readback = {name: p.data for name, p in params.items()}
    plan = _read(readback, names, bases, shapes, total, processed or (lambda _: False))
    return plan, refused


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
    for target, values in readback.items():
        edges = torch.tensor(bases, dtype=torch.float64, device=values.device)
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
    strides = torch.tensor(
        [math.prod(shape[d + 1 :]) for d in range(len(shape))], dtype=torch.int64
    )
    first = sum(s * st for s, st in zip(start, strides.tolist(), strict=True))
    expected = _grid(extent, strides, values.device) + first
    if not torch.equal(expected, local):
        return None
    return BlockCopy(source=source, source_box=source_box, target=target, target_box=target_box)


def _grid(extent: Sequence[int], strides: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The row-major positions of a block of ``extent`` in a tensor of ``strides``,
    relative to the block's first element (without materializing the whole tensor)."""
    grid = torch.zeros((), dtype=torch.int64, device=device)
    for d, n in enumerate(extent):
        axis = torch.arange(n, dtype=torch.int64, device=device) * int(strides[d])
        grid = grid.unsqueeze(-1) + axis
    return grid


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
