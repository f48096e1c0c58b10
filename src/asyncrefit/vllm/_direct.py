"""Direct writes into a vLLM engine: its parameters exported as destinations, by a copy plan.

A trainer on the engine's node can write a rank's parameters itself (see
:mod:`asyncrefit.transport.destinations`) once the rank says where each checkpoint
tensor goes in them. :func:`export` learns that from the model's own loaders
(:func:`asyncrefit.vllm._copyplan.learn`), then exports the parameters the plan
writes: in place by CUDA IPC on a GPU, moved into one shared-memory segment on the
CPU. Each block copy of the plan becomes one destination entry (the parameter's
block, and the block of the checkpoint tensor that goes there).

A rank is exported only when the plan covers every checkpoint tensor with plain
block copies into parameters that nothing derives state from after loading, in the
dtype the trainer sends: otherwise :func:`export` says why, and the rank keeps vLLM's
staged reload for all of its tensors (a layer whose weights are repacked after
loading, as every linear layer of vLLM's CPU build is, needs that reload to run).

This module imports torch and vLLM: only vLLM worker processes import it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._core._plan import ParamSpec
from .._device import DeviceId
from .._dtypes import dtype_name
from .._exceptions import TransportError
from ..transport.destinations import (
    DestinationEntry,
    Destinations,
    SharedParameters,
    share_parameters,
)
from ._copyplan import CopyPlan, learn

logger = logging.getLogger(__name__)

#: Post-load methods that leave a layer's weight as loaded on a GPU (no derived copy).
KEEPS_WEIGHTS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


@dataclass
class DirectExport:
    """A rank's parameters as exported for direct writes, and the plan that placed them.

    :meth:`close` unlinks a CPU segment's name (the parameters keep their memory).
    """

    destinations: Destinations
    plan: CopyPlan
    shared: SharedParameters
    #: Each parameter written, as exported: the module holding it, its attribute
    #: there, the parameter, and where its memory was (``data_ptr``).
    places: tuple[tuple[torch.nn.Module, str, torch.nn.Parameter, int], ...]

    def moved(self) -> bool:
        """Whether a parameter exported is no longer where it was: replaced in its
        module, or its memory moved (``param.data = ...``). One dictionary look-up per
        parameter, with no walk of the model: asked at every direct begin."""
        return any(
            owner._parameters.get(attr) is not param or param.data_ptr() != ptr
            for owner, attr, param, ptr in self.places
        )

    def close(self) -> None:
        self.shared.close()


def derives(model: torch.nn.Module, cpu: bool) -> Callable[[str], bool]:
    """Whether anything derives state from a parameter after loading: the predicate
    :func:`learn` takes, by parameter name.

    Every module holding the parameter counts (a tied head holds the embedding's).
    On a GPU, the unquantized linear and embedding methods read the weight as loaded;
    on the CPU build a layer does only when its GEMM is torch's own ``linear`` (vLLM
    packs a copy for oneDNN otherwise).
    """
    from ._reload import _processing

    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    params = dict(model.named_parameters(remove_duplicate=True))

    def processed(target: str) -> bool:
        for alias in aliases.get(id(params[target]), [target]):
            layer = model.get_submodule(alias.rpartition(".")[0])
            method = _processing(layer)
            if method is None:
                continue
            if cpu:
                keeps = getattr(layer, "cpu_linear", None) is torch.nn.functional.linear
            else:
                keeps = method in KEEPS_WEIGHTS
            if not keeps:
                return True
        return False

    return processed


def export(
    model: torch.nn.Module,
    specs: Mapping[str, ParamSpec],
    device: DeviceId,
    *,
    generation: int = 0,
) -> DirectExport | str:
    """Learn the copy plan of ``model`` for the checkpoint tensors ``specs`` and export
    the parameters it writes; or the reason this rank cannot be written directly.

    Run it while the engine serves nothing (between steps): the parameters are
    swapped for float64 while the plan is learned, a group of layers at a time, and
    on the CPU they are moved into shared memory.
    """
    params = dict(model.named_parameters(remove_duplicate=True))
    where = {p.device.type for p in params.values()}
    if where - {"cpu", "cuda"} or len(where) != 1:
        return f"its parameters are on {sorted(where)}"
    processed = derives(model, "cpu" in where)
    # Before learning anything: a parameter that something derives state from after
    # loading cannot be written in place (every linear layer of vLLM's CPU build).
    derived = [n for n in params if processed(n)]
    if derived:
        shown = ", ".join(derived[:3]) + (", ..." if len(derived) > 3 else "")
        return (
            f"{len(derived)} of its {len(params)} parameters are processed after loading "
            f"({shown}): they need vLLM's reload"
        )
    plan = learn(model, {n: s.shape for n, s in specs.items()}, processed=processed)
    if plan.staged:
        shown = ", ".join(plan.staged[:3]) + (", ..." if len(plan.staged) > 3 else "")
        return (
            f"{len(plan.staged)} of its {len(specs)} checkpoint tensors are not plain "
            f"copies into its parameters ({shown}): they need vLLM's reload"
        )
    targets: dict[str, torch.nn.Parameter] = {}
    for c in plan.copies:
        p = params[c.target]
        want = specs[c.source].dtype
        if dtype_name(p.dtype) != want:
            return f"parameter {c.target!r} is {dtype_name(p.dtype)}, the trainer sends {want}"
        targets[c.target] = p
    try:  # on the CPU, each parameter is re-pointed into the segment
        shared = share_parameters(targets, device, generation=generation)
    except TransportError as exc:
        return str(exc)
    base = {e.name: e for e in shared.destinations.entries}
    entries = []
    for c in plan.copies:
        if c.numel == 0:
            continue
        view = targets[c.target].data[tuple(slice(a, b) for a, b in c.target_box)]
        place = base[c.target]
        shape = specs[c.source].shape
        whole = all(a == 0 and b == n for (a, b), n in zip(c.source_box, shape, strict=True))
        entries.append(
            DestinationEntry(
                name=c.source,
                region=place.region,
                offset=int(view.storage_offset()) * view.element_size(),
                shape=tuple(view.shape),
                dtype=place.dtype,
                strides=None if view.is_contiguous() else tuple(view.stride()),
                source_box=None if whole else c.source_box,
            )
        )
    found = Destinations(
        kind=shared.destinations.kind,
        device=device,
        regions=shared.destinations.regions,
        entries=tuple(entries),
        generation=generation,
        event=shared.destinations.event,
    )
    found.check()
    places = []
    for name, param in targets.items():
        owner, _, attr = name.rpartition(".")
        places.append((model.get_submodule(owner), attr, param, param.data_ptr()))
    return DirectExport(destinations=found, plan=plan, shared=shared, places=tuple(places))


def synchronize(model: Any) -> None:
    """Wait for every kernel of this rank's GPU (before or after a trainer's writes)."""
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type == "cuda":
        torch.cuda.synchronize(first.device)
