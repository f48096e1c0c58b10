"""Gathering a sharded ``DTensor`` into a bucket slot, bounded in time and memory.

Every rank of the tensor's mesh takes part in each gather (all-gathers over the mesh
dimensions that shard it), in the same order: the caller guarantees that order (the
coordinator drives every rank's source through every bucket in plan order).

What is written into the destination is the full tensor, row-major, in the
destination's dtype. Shards are cast before they travel, so an fp32 master weight
bound for a bf16 engine moves half the bytes. Where the layout allows (one sharded
mesh dimension, dimension 0, shards of equal size) the all-gather writes straight
into the destination; otherwise it goes through one temporary of about the tensor's
size. A tensor that needs no gather (replicated, or sharded over mesh dimensions of
one rank) is copied, and cast, in one pass. Each collective is waited for at most
``timeout`` seconds.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._exceptions import GatherError

if TYPE_CHECKING:
    import torch


def chunk_sizes(n: int, world: int) -> list[int]:
    """The sizes ``torch.chunk`` (and so ``Shard``) cuts ``n`` rows into for ``world`` ranks."""
    if n == 0:
        return [0] * world
    size = -(-n // world)
    return [max(0, min(size, n - i * size)) for i in range(world)]


@dataclass(frozen=True, slots=True)
class _Level:
    """One mesh dimension that shards a tensor dimension, and the split it made."""

    mesh_dim: int
    dim: int
    sizes: tuple[int, ...]  # the size along ``dim`` that each rank of the level holds


def _levels(tensor: Any) -> list[_Level]:
    """The sharding levels of a DTensor, outermost first (in mesh-dimension order)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise GatherError("this rank is not in the parameter's device mesh")
    sizes = list(tensor.shape)
    levels = []
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise GatherError(
                f"placement {placement!r} is not supported (only Shard(d) and Replicate); "
                "push such a layout through a conversion source"
            )
        d = placement.dim if placement.dim >= 0 else placement.dim + tensor.ndim
        split = chunk_sizes(sizes[d], mesh.size(mesh_dim))
        levels.append(_Level(mesh_dim=mesh_dim, dim=d, sizes=tuple(split)))
        sizes[d] = split[coordinate[mesh_dim]]
    return levels


def _wait(work: Any, timeout: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise GatherError(f"{what} failed: {exc}") from exc


def _all_gather(
    out: torch.Tensor, shard: torch.Tensor, group: Any, timeout: float, what: str
) -> None:
    import torch.distributed as dist

    # all_gather_single is the newer name (torch 2.13) of all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, shard, group=group, async_op=True)
    _wait(work, timeout, what)


def gather_into(tensor: Any, out: torch.Tensor, *, timeout: float, name: str = "") -> None:
    """Write the full value of ``tensor`` (a DTensor, or a plain tensor) into ``out``.

    ``out`` has the tensor's global shape, is contiguous, and may have another
    (floating-point) dtype: the shards are cast to it first. A collective over the
    mesh dimensions that shard the tensor runs on every rank. Raises
    :class:`GatherError` for an unsupported placement or a collective that failed or
    did not finish within ``timeout`` seconds.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        out.copy_(tensor)
        return
    levels = _levels(tensor)
    local: torch.Tensor = tensor.to_local()
    if all(len(level.sizes) == 1 for level in levels):
        # Nothing to gather (replicated, or every sharding mesh dimension has one
        # rank: a world of one): one copy, cast in it, no temporary, no collective.
        out.copy_(local)
        return
    mesh = tensor.device_mesh
    what = f"gathering {name or 'a parameter'}"
    # Undo the splits innermost first; the last one undone writes into ``out``. Shards
    # are cast to ``out``'s dtype before they travel: fewer bytes on the wire.
    for i, level in enumerate(reversed(levels)):
        world = len(level.sizes)
        last = i == len(levels) - 1
        group = mesh.get_group(level.mesh_dim)
        if world == 1:
            continue
        even = len(set(level.sizes)) == 1
        if last and even and level.dim == 0:
            shard = local if local.dtype == out.dtype else local.to(out.dtype)
            _all_gather(out.view(-1), shard.contiguous().view(-1), group, timeout, what)
            return
        local = _gather_level(local, level, group, timeout, what, out if last else None, out.dtype)
        if last:
            return
    out.copy_(local)


def _gather_level(
    local: torch.Tensor,
    level: _Level,
    group: Any,
    timeout: float,
    what: str,
    out: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Gather one level of uneven (or non-leading) shards, padded to equal sizes.

    The shard is cast into its padded copy. Into ``out`` along dimension 0, ranks whose
    shard is full size gather straight into their rows of ``out``, the others into a
    shard-sized temporary; otherwise all gather into one buffer that is then cut into
    place (a temporary of about the tensor's size).
    """
    import torch
    import torch.distributed as dist

    d, sizes = level.dim, level.sizes
    chunk = max(sizes)
    padded_shape = list(local.shape)
    padded_shape[d] = chunk
    shard = local
    if local.shape[d] != chunk or not local.is_contiguous() or local.dtype != dtype:
        shard = torch.empty(padded_shape, dtype=dtype, device=local.device)
        shard.narrow(d, 0, local.shape[d]).copy_(local)
        if local.shape[d] != chunk:
            shard.narrow(d, local.shape[d], chunk - local.shape[d]).zero_()
    world = len(sizes)
    if out is not None and d == 0:
        outputs: list[torch.Tensor] = []
        offset = 0
        for size in sizes:
            if size == chunk:
                outputs.append(out.narrow(0, offset, chunk))
            else:
                outputs.append(torch.empty(padded_shape, dtype=dtype, device=local.device))
            offset += size
        work = dist.all_gather(outputs, shard, group=group, async_op=True)
        _wait(work, timeout, what)
        offset = 0
        for size, piece in zip(sizes, outputs, strict=True):
            if size != chunk and size:
                out.narrow(0, offset, size).copy_(piece.narrow(0, 0, size))
            offset += size
        return out
    gathered = torch.empty([world, *padded_shape], dtype=dtype, device=local.device)
    _all_gather(gathered.view(-1), shard.view(-1), group, timeout, what)
    del shard
    full_shape = list(local.shape)
    full_shape[d] = sum(sizes)
    target = out if out is not None else torch.empty(full_shape, dtype=dtype, device=local.device)
    offset = 0
    for rank, size in enumerate(sizes):
        if size:
            target.narrow(d, offset, size).copy_(gathered[rank].narrow(d, 0, size))
        offset += size
    return target


def gather_rows_into(
    tensor: Any, lo: int, hi: int, out: torch.Tensor, *, timeout: float, name: str = ""
) -> None:
    """Write rows ``lo:hi`` (dimension 0) of ``tensor``'s full value into ``out``.

    ``out`` is contiguous, of shape ``[hi - lo, *tensor.shape[1:]]``, in any floating
    dtype. A ``DTensor`` sharded along dimension 0 over one mesh dimension (FSDP2's
    ``Shard(0)``, even or not; other mesh dimensions replicated or of one rank) sends
    only those rows: each rank holding some of them broadcasts them, cast, straight
    into their place in ``out``, so no rank needs more than ``out``. Any other layout
    is gathered whole into a temporary first (about the tensor's size). Every rank of
    the mesh must call it alike. Raises :class:`GatherError` as :func:`gather_into`.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        out.copy_(tensor[lo:hi])
        return
    levels = _levels(tensor)
    split = [level for level in levels if len(level.sizes) > 1]
    local: torch.Tensor = tensor.to_local()
    if not split:
        out.copy_(local[lo:hi])
        return
    if len(split) > 1 or split[0].dim != 0:
        full = torch.empty(tuple(tensor.shape), dtype=out.dtype, device=out.device)
        gather_into(tensor, full, timeout=timeout, name=name)
        out.copy_(full[lo:hi])
        return
    level = split[0]
    mesh = tensor.device_mesh
    group = mesh.get_group(level.mesh_dim)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # _levels checked it
    mine = coordinate[level.mesh_dim]
    what = f"gathering rows {lo}:{hi} of {name or 'a parameter'}"
    start = 0
    for rank, size in enumerate(level.sizes):
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            region = out[a - lo : b - lo]
            if rank == mine:
                region.copy_(local[a - start : b - start])
            work = dist.broadcast(
                region, src=dist.get_global_rank(group, rank), group=group, async_op=True
            )
            _wait(work, timeout, what)
        start += size
