"""A ``transformers`` model's parameters as its checkpoint's tensors, without copies.

``transformers`` (5.x) holds some parameters in another layout than its checkpoints:
a MoE model's experts are fused (``mlp.experts.gate_up_proj`` of shape ``[E, 2I, H]``
where the checkpoint, and so vLLM, has ``experts.<e>.w1.weight`` and ``w3`` per
expert), and some modules are renamed. ``save_pretrained`` turns the model back into
the checkpoint's tensors with ``revert_weight_conversion``, the reverse of the ops
``from_pretrained`` applied (``WeightConverter`` / ``WeightRenaming`` and their
``reverse_op``\\ s, listed per model type in ``transformers.conversion_mapping``).

:class:`CheckpointLayout` calls that very function once per parameter set, on *meta*
tensors of the trainer's shapes, under a :class:`~torch.overrides.TorchFunctionMode`
that lets only data-movement ops through and keeps every result a view of its input
(``contiguous`` and ``clone`` return their input): each checkpoint tensor then comes out
as a strided view of a trainer tensor (or several, side by side, for a ``cat``), whose
offset and strides say exactly which elements it reads. Nothing is copied to learn
that, and at a push the checkpoint tensors are views of the trainer's own tensors
(:mod:`asyncrefit.trainer._slices`). A conversion that transforms values, or that this
reading cannot follow, is a :class:`~asyncrefit.ConversionError` naming the tensor;
a model that transformers does not convert keeps its names and tensors as they are.

Supported: transformers 5.0 and newer (4.x keeps checkpoint names in memory: nothing
to convert).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._exceptions import ConversionError
from ._slices import Piece, Slices, is_plain, view_of

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Ops that only read or move elements, by ``__name__`` (methods and functions alike).
#: Any other op seen while converting fails the conversion: it may change values.
_MOVES = frozenset(
    {
        # views
        "chunk",
        "split",
        "split_with_sizes",
        "tensor_split",
        "unbind",
        "squeeze",
        "unsqueeze",
        "transpose",
        "swapaxes",
        "swapdims",
        "permute",
        "movedim",
        "moveaxis",
        "t",
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "narrow",
        "select",
        "__getitem__",
        "expand",
        "expand_as",
        "detach",
        "to",
        # copies, followed as the views they copy
        "contiguous",
        "clone",
        # side by side
        "cat",
        "concat",
        "concatenate",
        "stack",
        # reading metadata
        "__get__",
        "size",
        "dim",
        "ndimension",
        "numel",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "element_size",
        "__len__",
        "__iter__",
        "__repr__",
        "__format__",
        "_set_grad_enabled",
    }
)
_SIDE_BY_SIDE = frozenset({"cat", "concat", "concatenate", "stack"})


@dataclass(frozen=True, slots=True)
class Converted:
    """One checkpoint tensor: ``pieces`` of trainer tensors, side by side along ``dim``."""

    name: str
    pieces: tuple[Piece, ...]
    dim: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.pieces[0].shape)
        if len(self.pieces) > 1:
            shape[self.dim] = sum(p.shape[self.dim] for p in self.pieces)
        return tuple(shape)


def _reverter() -> Callable[[Any, dict[str, Any]], dict[str, Any]] | None:
    """transformers' ``revert_weight_conversion``, or ``None`` (4.x, or not installed)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion  # type: ignore[no-any-return, unused-ignore]


def is_transformers_model(module: object) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (without importing it)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - a broken install
        return False
    return isinstance(module, PreTrainedModel)


def _tracer() -> Any:
    """A TorchFunctionMode that keeps results views of their inputs (see the module)."""
    from torch.overrides import TorchFunctionMode

    class Tracer(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.unknown: set[str] = set()
            # id(result of a cat or stack) -> (result, dim, the pieces side by side)
            self.side_by_side: dict[int, tuple[torch.Tensor, int, list[torch.Tensor]]] = {}

        def __torch_function__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            name = getattr(func, "__name__", repr(func))
            if name not in _MOVES:
                self.unknown.add(name)
            if name in ("contiguous", "clone"):
                return args[0]
            if name == "to" and _changes_dtype(args, kwargs):
                self.unknown.add("to (a dtype)")
            result = func(*args, **kwargs)
            if name in _SIDE_BY_SIDE:
                tensors = list(args[0] if args else kwargs["tensors"])
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                if name == "stack":
                    tensors = [t.unsqueeze(dim) for t in tensors]
                dim = dim if dim >= 0 else dim + result.dim()
                self.side_by_side[id(result)] = (result, dim, tensors)
            return result

    return Tracer()


def _changes_dtype(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    import torch

    tensor = args[0]
    wanted = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.dtype)]
    wanted += [a.dtype for a in args[1:] if isinstance(a, torch.Tensor)]
    return any(d != tensor.dtype for d in wanted)


def trace(
    model: Any, params: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *, source: str
) -> tuple[Converted, ...] | None:
    """The checkpoint tensors of ``model``'s parameters ``params`` (name to shape and
    dtype, in the trainer's order), in the trainer's order of what they read; ``None``
    when transformers converts nothing (names and tensors stay as they are).

    Raises :class:`~asyncrefit.ConversionError` when the conversion fails, changes
    values, reads something other than trainer tensors, or leaves a trainer tensor out.
    """
    import torch

    revert = _reverter()
    if revert is None:
        return None
    roots = {
        name: torch.empty(shape, dtype=dtype, device="meta")
        for name, (shape, dtype) in params.items()
    }
    names = {id(t): name for name, t in roots.items()}
    tracer = _tracer()
    try:
        with tracer, torch.no_grad():
            out = revert(model, dict(roots))
    except Exception as exc:
        raise ConversionError(
            source,
            "*",
            f"transformers' revert_weight_conversion failed on the trainer's shapes: "
            f"{type(exc).__name__}: {exc}",
        ) from exc
    if set(out) == set(roots) and all(out[n] is roots[n] for n in roots):
        return None
    if tracer.unknown:
        raise ConversionError(
            source,
            "*",
            "transformers' conversion to checkpoint names uses ops that may change "
            f"values ({', '.join(sorted(tracer.unknown))}): asyncrefit only follows ops "
            "that move elements; push this model with checkpoint_names=False and a "
            "ConvertingSource",
        )

    def piece(tensor: torch.Tensor) -> Piece | None:
        base = tensor._base if tensor._base is not None else tensor
        name = names.get(id(base))
        if name is None:
            return None
        return Piece(
            source=name,
            source_shape=tuple(roots[name].shape),
            offset=int(tensor.storage_offset()),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
        )

    converted: list[Converted] = []
    for target, value in out.items():
        tensor = value[0] if isinstance(value, list) else value
        single = piece(tensor)
        if single is not None:
            converted.append(Converted(name=target, pieces=(single,)))
            continue
        joined = tracer.side_by_side.get(id(tensor))
        pieces = [] if joined is None else [piece(t) for t in joined[2]]
        if joined is None or not pieces or any(p is None for p in pieces):
            raise ConversionError(
                source,
                target,
                "transformers makes this checkpoint tensor by something other than "
                "views of the trainer's tensors, side by side: it cannot be read in place",
            )
        converted.append(
            Converted(name=target, pieces=tuple(p for p in pieces if p is not None), dim=joined[1])
        )
    order = {name: i for i, name in enumerate(params)}
    read = {p.source for c in converted for p in c.pieces}
    for name in params:
        if name not in read:
            raise ConversionError(
                source, name, "transformers' conversion gives no checkpoint tensor that reads it"
            )
    converted.sort(key=lambda c: (order[c.pieces[0].source], c.pieces[0].offset, c.name))
    return tuple(converted)


class CheckpointLayout:
    """A ``transformers`` model's parameters under its checkpoint's names and layout.

    Call it with the model's current parameters (``named_parameters()``, plain tensors
    or ``DTensor``\\ s): it returns the checkpoint's tensors, in the order of the trainer
    tensors they read: the trainer's tensors themselves where a name only changes,
    views of them for plain tensors (one expert of a fused expert tensor), and
    :class:`~asyncrefit.trainer._slices.Slices` where a checkpoint tensor is made of
    several trainer tensors or of a ``DTensor``. The layout is traced once per
    parameter set (names, shapes, dtypes); views are kept while their trainer tensor
    is the same object with the same storage.

    Error handling: :class:`~asyncrefit.ConversionError` (see :func:`trace`).
    """

    def __init__(self, model: Any, *, source: str = "trainer") -> None:
        self._model = model
        self._source = source
        self._key: tuple[tuple[str, tuple[int, ...], Any], ...] | None = None
        self._converted: tuple[Converted, ...] | None = None
        self._views: dict[str, tuple[Any, int, torch.Tensor]] = {}

    def __repr__(self) -> str:
        planned = "unplanned" if self._key is None else f"{len(self._converted or ())} tensors"
        return f"<CheckpointLayout of {type(self._model).__name__} {planned}>"

    def converted(self, tensors: Mapping[str, Any]) -> tuple[Converted, ...] | None:
        """The checkpoint tensors of ``tensors`` (traced anew if their set changed);
        ``None`` if transformers converts nothing."""
        key = tuple((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
        if key != self._key:
            params = {n: (shape, dtype) for n, shape, dtype in key}
            self._converted = trace(self._model, params, source=self._source)
            self._key = key
            self._views.clear()
            if self._converted is not None:
                logger.debug(
                    "trainer source %r: %d parameters are %d checkpoint tensors",
                    self._source,
                    len(params),
                    len(self._converted),
                )
        return self._converted

    def __call__(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        converted = self.converted(tensors)
        if converted is None:
            return dict(tensors)
        out: dict[str, Any] = {}
        views = self._views
        for c in converted:
            sources = [tensors[p.source] for p in c.pieces]
            first = sources[0]
            if len(sources) > 1 or not is_plain(first):
                out[c.name] = Slices(c.pieces, c.dim, sources, first.dtype)
                continue
            if c.pieces[0].whole:
                out[c.name] = first
                continue
            cached = views.get(c.name)
            ptr = first.data_ptr()
            if cached is not None and cached[0] is first and cached[1] == ptr:
                out[c.name] = cached[2]
                continue
            view = view_of(first, c.pieces[0])
            views[c.name] = (first, ptr, view)
            out[c.name] = view
        return out
