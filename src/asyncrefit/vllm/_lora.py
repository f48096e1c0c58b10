"""LoRA adapters pushed in memory: :class:`LoRAAdapter`, what the coordinator knows of one.

A trainer that trains only LoRA adapters (peft) pushes only the adapter's tensors, into
a vLLM engine started with ``enable_lora=True``, without writing files. A
:class:`LoRAAdapter` declares one adapter: the name and integer id requests name it by,
its peft LoRA config (rank, alpha, target modules, ...) and its tensors under the names
of a saved peft adapter (``base_model.model.<module>.lora_A.weight``). Each rank of the
engine checks the declaration against the engine before any byte moves (see
:mod:`asyncrefit.vllm._adapters`), receives the tensors of a push aside, and swaps the
new adapter in at the commit, all at once; the served adapter never mixes versions.

This module imports neither torch nor vLLM (vLLM's ``LoRARequest`` is imported by
:meth:`LoRAAdapter.request` alone).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._exceptions import AsyncRefitError

if TYPE_CHECKING:
    import torch

    from ..trainer._local import LocalTrainer

#: The start of an adapter's ``lora_path``: no file, the adapter's own key.
PATH_PREFIX = "asyncrefit-lora://"
#: A peft parameter of a LoRA layer: ``<module>.lora_A.<adapter>.weight``.
_PEFT_NAME = re.compile(r"^(?P<module>.+)\.(?P<ab>lora_[AB])\.(?P<adapter>[^.]+)\.weight$")
#: What a saved adapter calls it (and what vLLM loads): ``<module>.lora_A.weight``.
_SAVED_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<ab>lora_[AB])\.weight$")


def _json(value: Any) -> Any:
    """``value`` as JSON-like data (peft's config holds sets and enums)."""
    if isinstance(value, enum.Enum):
        return _json(value.value)
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_json(v) for v in value)
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    return value


def _saved_name(adapter: str, trainer_name: str) -> str | None:
    found = _PEFT_NAME.match(trainer_name)
    if found is None or found["adapter"] != adapter:
        return None
    return f"{found['module']}.{found['ab']}.weight"


def module_of(name: str) -> tuple[str, str] | None:
    """``(module, "lora_A" or "lora_B")`` of a saved adapter's tensor name (``None``:
    not a LoRA layer's weight)."""
    found = _SAVED_NAME.match(name)
    return None if found is None else (found["module"], found["ab"])


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One LoRA adapter that a trainer pushes into a vLLM engine, in memory.

    ``name`` and ``id`` are what requests name it by (``LoRARequest.lora_name`` and
    ``lora_int_id``; :meth:`request` makes one); ``config`` is its peft LoRA config as
    a dict (``r``, ``lora_alpha``, ``target_modules``, ...); ``tensors`` maps each
    tensor's name in a saved peft adapter (``base_model.model.<module>.lora_A.weight``)
    to its shape. :meth:`from_peft` reads all of it from a peft model.

    Push it with a coordinator of its own: ``workers`` are
    ``[w.lora(adapter) for w in vllm_workers]`` and the trainer
    ``adapter.source(peft_model)``. Each adapter on an engine has its own versions;
    the engine's own weights and each of its adapters are pushed one at a time (a
    push waits for the engine's current one to end).

    Raises :class:`ValueError` for an id below 1, an empty name or no tensors.
    """

    name: str
    id: int
    config: Mapping[str, Any]
    tensors: Mapping[str, tuple[int, ...]]
    #: The peft adapter (``"default"`` unless the model holds several).
    adapter: str = "default"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a LoRA adapter needs a name")
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 1:
            raise ValueError(f"LoRA adapter {self.name!r}: id must be an integer >= 1 (vLLM's)")
        if not self.tensors:
            raise ValueError(f"LoRA adapter {self.name!r} declares no tensors")
        object.__setattr__(self, "config", _json(dict(self.config)))
        object.__setattr__(
            self, "tensors", {n: tuple(int(d) for d in s) for n, s in self.tensors.items()}
        )

    @classmethod
    def from_peft(
        cls, model: torch.nn.Module, *, name: str, id: int, adapter: str = "default"
    ) -> LoRAAdapter:
        """The adapter ``adapter`` of a peft model (``get_peft_model(...)``): its
        config and its LoRA weights' names and shapes, as a saved adapter holds them.

        Raises :class:`AsyncRefitError` if the model has no such LoRA adapter.
        """
        configs = getattr(model, "peft_config", None)
        if not isinstance(configs, Mapping) or adapter not in configs:
            raise AsyncRefitError(
                f"the model has no peft adapter {adapter!r} "
                f"(it has {sorted(configs) if isinstance(configs, Mapping) else 'none'})"
            )
        config = configs[adapter]
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        if str(_json(as_dict.get("peft_type", "LORA"))).upper() != "LORA":
            raise AsyncRefitError(f"peft adapter {adapter!r} is not a LoRA adapter")
        tensors = {}
        for trainer_name, param in model.named_parameters():
            saved = _saved_name(adapter, trainer_name)
            if saved is not None:
                tensors[saved] = tuple(param.shape)
        if not tensors:
            raise AsyncRefitError(f"the model has no LoRA weights of peft adapter {adapter!r}")
        return cls(name=name, id=id, config=as_dict, tensors=tensors, adapter=adapter)

    def saved_name(self, trainer_name: str) -> str | None:
        """The name a saved adapter gives the trainer's parameter ``trainer_name``
        (``...q_proj.lora_A.default.weight`` becomes ``...q_proj.lora_A.weight``), or
        ``None`` for parameters of the base model and of other adapters: the name map
        of :meth:`source`."""
        return _saved_name(self.adapter, trainer_name)

    @property
    def path(self) -> str:
        """The ``lora_path`` of :meth:`request`: no file, only the adapter's own key
        (vLLM's prefix cache keys blocks by name and path)."""
        return f"{PATH_PREFIX}{self.name}"

    def source(self, model: torch.nn.Module | Any, **kwargs: Any) -> LocalTrainer:
        """A :class:`~asyncrefit.LocalTrainer` over ``model`` (a peft model) that
        sends this adapter's LoRA weights alone, under a saved adapter's names;
        ``kwargs`` go to ``LocalTrainer`` (``exporter``, ``devices``, ...)."""
        from ..trainer._local import LocalTrainer

        kwargs.setdefault("name", f"lora-{self.name}")
        return LocalTrainer(model, names=self.saved_name, checkpoint_names=False, **kwargs)

    def request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` that names this adapter in requests.

        Name it once a push of the adapter committed: until then (and after an install
        that failed at a rank took it out) the engine serves such requests with the
        base model's output, and logs a warning. (Named on an engine it was never
        declared on, vLLM looks for files at :attr:`path`, fails, and its engine dies.)
        """
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=self.name, lora_int_id=self.id, lora_path=self.path)
