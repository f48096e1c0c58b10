"""A vLLM worker's LoRA adapters pushed in memory: one endpoint per declared adapter.

:class:`Adapters` serves :class:`~asyncrefit.vllm._wire.DeclareAdapter` and
:class:`~asyncrefit.vllm._wire.ToAdapter`. Declaring an adapter checks it against the
engine before any byte moves (:func:`adapter_specs`): LoRA is enabled, vLLM accepts the
peft config (its rank within ``max_lora_rank``, no DoRA, no bias, ...), every tensor is
the ``lora_A`` (``r x in``) or ``lora_B`` (``out x r``) of a linear layer of the
checkpoint whose module the model's LoRA supports, each layer has both, and the dtype
is the engine's LoRA dtype. Each adapter then has its own
:class:`~asyncrefit._worker._endpoint.Endpoint` (its own versions) over an
:class:`AdapterSink`: a push's tensors are copied aside on the CPU, where vLLM keeps
its adapters, and nothing the engine serves changes until the commit, which builds the
adapter as vLLM's loader does (``LoRAModel.from_lora_tensors``) at every rank, and
only once every rank could, installs it in place of the old one in vLLM's LoRA cache.
vLLM may evict it from that cache like any adapter; asked for it again, it makes it
again from the tensors of the installed version (:meth:`Adapters.guard`), never from
files.

This module imports torch and vLLM: only vLLM worker processes import it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .._checksum import verify_checksum
from .._core._plan import ParamSpec
from .._device import DeviceId
from .._exceptions import AsyncRefitError, EngineConfigError, UpdateStateError
from .._wire._errors import error_reply
from .._wire._messages import (
    Aborted,
    AbortUpdate,
    Done,
    GetVersion,
    ReleaseHandles,
    Reply,
    SpecsReply,
    VersionReply,
)
from .._worker._endpoint import Endpoint
from .._worker._layout import Declared
from .._worker._state import VersionState
from ..transport._base import Handle, Importer, dtype_name, torch_dtype
from ._lora import LoRAAdapter, module_of
from ._wire import DeclareAdapter, InstallAdapter, RemoveAdapter, ToAdapter

logger = logging.getLogger(__name__)


class AdapterLostError(AsyncRefitError):
    """The old adapter was taken out, and the new one could not be put in: the engine
    holds no version of the adapter."""


def lora_manager(runner: Any) -> Any:
    """The model runner's LoRA manager (vLLM's ``LRUCacheWorkerLoRAManager``);
    :class:`EngineConfigError` if the engine was started without LoRA."""
    manager = getattr(runner, "lora_manager", None)
    if manager is None or getattr(manager, "_adapter_manager", None) is None:
        raise EngineConfigError(
            "the vLLM engine serves no LoRA adapters: start it with enable_lora=True "
            "(and max_lora_rank at least the adapter's rank)"
        )
    return manager


def _peft_helper(adapter: LoRAAdapter, manager: Any) -> Any:
    from vllm.lora.peft_helper import PEFTHelper

    config = dict(adapter.config)
    config["vllm_max_position_embeddings"] = manager.max_position_embeddings
    try:
        helper = PEFTHelper.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {adapter.name!r}: its config: {exc}") from exc
    try:
        helper.validate_legal(manager.lora_config)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {adapter.name!r}: {exc}") from exc
    return helper


def _expected_modules(manager: Any) -> set[str]:
    """The module names (last component) the model's LoRA layers take, as vLLM's own
    loader expects them (packed modules by their parts: ``q_proj`` for ``qkv_proj``)."""
    adapters = manager._adapter_manager
    packed = adapters.packed_modules_mapping
    expected: set[str] = set()
    for module in adapters.supported_lora_modules:
        expected.update(packed.get(module, [module]))
    return expected


def _lora_dtype(manager: Any) -> torch.dtype:
    """The dtype vLLM keeps adapters in (``lora_dtype``, resolved by vLLM from "auto")."""
    dtype = manager.lora_config.lora_dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise EngineConfigError(f"the engine's lora_dtype is {dtype!r}, not a dtype")
    return dtype


def adapter_specs(
    adapter: LoRAAdapter, manager: Any, checkpoint: dict[str, ParamSpec]
) -> tuple[ParamSpec, ...]:
    """The specs this engine takes ``adapter`` in, after checking it (see the module).

    ``checkpoint`` is the base model's specs (its checkpoint's names and shapes).
    Raises :class:`ValueError` naming the adapter and the first tensor that does not fit.
    """
    helper = _peft_helper(adapter, manager)
    expected = _expected_modules(manager)
    dtype = _lora_dtype(manager)
    where = f"LoRA adapter {adapter.name!r}"
    halves: dict[str, set[str]] = {}
    specs = []
    for name, shape in sorted(adapter.tensors.items()):
        found = module_of(name)
        if found is None:
            raise ValueError(
                f"{where}: tensor {name!r} is no LoRA weight of a linear layer "
                "(base_model.model.<module>.lora_A.weight or lora_B.weight)"
            )
        module, half = found
        base = checkpoint.get(f"{module}.weight")
        if base is None or len(base.shape) != 2:
            raise ValueError(f"{where}: tensor {name!r}: the model has no linear layer {module!r}")
        if module.rsplit(".", 1)[-1] not in expected:
            raise ValueError(
                f"{where}: tensor {name!r}: the model's LoRA does not take module {module!r} "
                f"(it takes {sorted(expected)})"
            )
        rank = int(helper.get_rank_and_scaling(module)[0])
        out, inner = base.shape
        want = (rank, inner) if half == "lora_A" else (out, rank)
        if tuple(shape) != want:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {list(shape)}; rank {rank} of "
                f"{module!r} ({out} x {inner}) makes it {list(want)}"
            )
        halves.setdefault(module, set()).add(half)
        specs.append(ParamSpec(name=name, shape=tuple(shape), dtype=dtype_name(dtype)))
    for module, got in sorted(halves.items()):
        if got != {"lora_A", "lora_B"}:
            raise ValueError(f"{where}: module {module!r} has {sorted(got)[0]} alone")
    return tuple(specs)


def _same_adapter(a: LoRAAdapter, b: LoRAAdapter) -> bool:
    """The same adapter as vLLM serves it: id, tensors, and the config's fields vLLM
    reads (not, say, the peft version or the base model's path it was trained from)."""
    from dataclasses import fields

    from vllm.lora.peft_helper import PEFTHelper

    read = {f.name for f in fields(PEFTHelper)}

    def served(config: Any) -> dict[str, Any]:
        return {k: v for k, v in config.items() if k in read}

    return a.id == b.id and a.tensors == b.tensors and served(a.config) == served(b.config)


class _HeldUntilCommit(VersionState):
    """An adapter's versions: a bucket loaded is set aside, not served, so the served
    adapter (the complete version) stays until it is installed."""

    def loading(self, version: int, bucket: int) -> None:
        self.check_loading(version)
        self.loaded.add(bucket)

    def lost(self) -> None:
        """The adapter was taken out: no version is held (an abort says written)."""
        self.dirty, self.complete = True, None


class AdapterSink:
    """Where one adapter's buckets go: copies on the CPU, built at the commit and
    installed once every rank built it (:meth:`install`).

    Resource handling: a bucket's tensors are copied out of the trainer's buffer (the
    copies waited for) and every view of it dropped before the ack. The copies of a
    version are dropped at its abort; once installed they are kept (:attr:`served`,
    about the adapter's size, on the CPU) until the next version is installed or the
    adapter is taken out. Error handling: a commit missing a tensor raises
    :class:`~asyncrefit.UpdateStateError`, one vLLM cannot build leaves the old
    adapter serving; :class:`AdapterLostError` if the old one was taken out and the new
    one could not be put in.
    """

    def __init__(
        self, adapter: LoRAAdapter, specs: tuple[ParamSpec, ...], runner: Callable[[], Any]
    ) -> None:
        self.adapter = adapter
        self._declared = Declared(
            specs={s.name: s for s in specs},
            unknown=f"names {{name!r}}, which LoRA adapter {adapter.name!r} does not hold",
            own="expected",
        )
        self._runner = runner
        self._staged: dict[str, torch.Tensor] | None = None
        self._ready: tuple[int, int, Any, dict[str, torch.Tensor]] | None = None
        #: The tensors of the version installed (``None``: none is), kept as received:
        #: vLLM may evict the adapter from its cache and load it again (see
        #: :meth:`Adapters.guard`).
        self.served: dict[str, torch.Tensor] | None = None

    def declared(self) -> Declared:
        return self._declared

    def begin(self, version: int) -> None:
        self._staged = {}

    def receiving(self, bucket: int) -> None:
        if self._staged is None:
            raise UpdateStateError(f"bucket {bucket} arrived before the adapter's push began")

    def opening(self, handle: Handle) -> None:
        pass

    def write(
        self,
        bucket: int,
        handle: Handle,
        buffer: torch.Tensor,
        importer: Importer,
        writing: Callable[[], None],
    ) -> bytes:
        assert self._staged is not None
        copies: list[tuple[str, torch.Tensor]] = []
        for e in handle.entries:
            src = buffer[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype))
            copies.append((e.name, src.view(e.shape).to("cpu", copy=True)))
            del src
        importer.finish(handle)
        importer.settle()
        del buffer
        verify_checksum(bucket, handle.checksum, (t for _, t in copies))
        writing()  # set aside: the served adapter is unchanged until the commit
        self._staged.update(copies)
        return b""

    def commit(self, version: int, buckets: int) -> bool:
        """Build the adapter from the tensors set aside (nothing served changes yet);
        :meth:`install` puts it in."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise UpdateStateError(f"version {version} of the adapter was never begun")
        missing = sorted(self._declared.specs.keys() - staged.keys())
        if missing:
            raise UpdateStateError(
                f"version {version} of LoRA adapter {self.adapter.name!r} lacks "
                f"{len(missing)} tensors ({missing[0]!r}, ...)"
            )
        lora = build(self.adapter, staged, self._runner())
        self._ready = (version, buckets, lora, staged)
        return False  # complete once installed (every rank built it)

    def install(self, version: int) -> int:
        """Swap the version built at the commit in; returns its bucket count."""
        ready, self._ready = self._ready, None
        if ready is None or ready[0] != version:
            raise UpdateStateError(f"version {version} of the adapter was not committed")
        _, buckets, lora, tensors = ready
        self.served = None
        install(self.adapter, lora, self._runner())
        self.served = tensors
        return buckets

    def remove(self) -> None:
        """Take the adapter out of the engine (it serves none)."""
        self._ready = None
        self.served = None
        adapters = lora_manager(self._runner())._adapter_manager
        adapters.remove_adapter(self.adapter.id)

    def abort(self, version: int) -> None:
        self._staged = None
        self._ready = None

    def aborted(self, complete: int | None, written: bool) -> Aborted:
        return Aborted(version=complete, written=written)

    def release(self) -> None:
        pass


def build(
    adapter: LoRAAdapter, tensors: dict[str, torch.Tensor], runner: Any, *, check_room: bool = True
) -> Any:
    """``adapter``'s ``LoRAModel`` made of ``tensors`` (left as they are) as vLLM's own
    loader makes it from files (its config checked, its weights in the LoRA dtype, on
    the CPU), and room for it checked: all that can fail before the engine changes."""
    from vllm.lora.lora_model import LoRAModel

    manager = lora_manager(runner)
    adapters = manager._adapter_manager
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=adapter.id,
        tensors={name: t.clone() for name, t in tensors.items()},  # vLLM scales in place
        peft_helper=_peft_helper(adapter, manager),
        device="cpu",
        dtype=_lora_dtype(manager),
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    if not check_room:
        return lora
    held = adapters.list_adapters()
    pinned: set[int] = set(getattr(adapters._registered_adapters, "pinned_items", ()))
    if adapter.id not in held and len(pinned - {adapter.id}) >= adapters.capacity:
        raise EngineConfigError(
            f"no room for LoRA adapter {adapter.name!r}: the engine holds "
            f"max_cpu_loras={adapters.capacity} adapters, all pinned"
        )
    return lora


def install(adapter: LoRAAdapter, lora: Any, runner: Any) -> None:
    """Put ``lora`` (made by :func:`build`) in place of ``adapter``'s old version in
    vLLM's LoRA cache, evicting the least recently used adapter if the cache is full
    (as vLLM does). Not pinned: evicted later, it is made again from what was pushed
    (see :meth:`Adapters.guard`). Raises :class:`AdapterLostError` if the old one was
    taken out and the new one could not be put in."""
    adapters = lora_manager(runner)._adapter_manager
    removed = adapters.remove_adapter(adapter.id)
    try:
        if len(adapters) >= adapters.capacity:
            adapters.remove_oldest_adapter()
        adapters.add_adapter(lora)
    except Exception as exc:
        adapters.remove_adapter(adapter.id)
        if removed:
            raise AdapterLostError(
                f"LoRA adapter {adapter.name!r}: the old version was taken out and the new "
                f"one could not be put in ({type(exc).__name__}: {exc}); none is served"
            ) from exc
        raise


class _AdapterEndpoint(Endpoint[Aborted]):
    """An adapter's endpoint: versions held until installed (see ``_HeldUntilCommit``);
    it serves :class:`~._wire.InstallAdapter` and :class:`~._wire.RemoveAdapter` too."""

    sink: AdapterSink

    def __init__(self, sink: AdapterSink, device: DeviceId) -> None:
        super().__init__(sink, device)
        self.state: _HeldUntilCommit = _HeldUntilCommit()

    def handle(self, request: object) -> Reply | Aborted:
        try:
            match request:
                case InstallAdapter(version=version):
                    self.install(version)
                    return Done()
                case RemoveAdapter():
                    self.sink.remove()
                    self.state.lost()
                    self.abandon()
                    return Done()
        except Exception as exc:
            logger.debug("%r: request %r failed", self, request, exc_info=True)
            return error_reply(exc)
        return super().handle(request)

    def install(self, version: int) -> None:
        self.state.check_loading(version)
        try:
            buckets = self.sink.install(version)
        except AdapterLostError:
            self.state.lost()
            raise
        self.complete(version, buckets)


class Adapters:
    """The adapters declared on one rank, by name, each with its own endpoint.

    ``runner`` returns vLLM's model runner (which holds the LoRA manager), ``specs``
    the base model's checkpoint specs by name, ``device`` this rank's device.
    """

    def __init__(
        self,
        runner: Callable[[], Any],
        specs: Callable[[], dict[str, ParamSpec]],
        device: DeviceId,
    ) -> None:
        self._runner = runner
        self._specs = specs
        self._device = device
        self._endpoints: dict[str, _AdapterEndpoint] = {}

    def __repr__(self) -> str:
        return f"<Adapters {sorted(self._endpoints)}>"

    def handle(self, request: DeclareAdapter | ToAdapter) -> object:
        """Serve one adapter request; failures become an error reply (never raises)."""
        try:
            if isinstance(request, DeclareAdapter):
                return SpecsReply(specs=self.declare(request.adapter))
            endpoint = self._endpoints.get(request.adapter)
            if endpoint is not None:
                return endpoint.handle(request.request)
            # Never declared here: it holds no version, and nothing of it is open.
            match request.request:
                case GetVersion():
                    return VersionReply(version=None)
                case AbortUpdate():
                    return Aborted(version=None, written=False)
                case ReleaseHandles():
                    return Done()
            raise UpdateStateError(
                f"LoRA adapter {request.adapter!r} was not declared on this rank"
            )
        except Exception as exc:
            logger.debug("adapter request %r failed", request, exc_info=True)
            return error_reply(exc)

    def declare(self, adapter: LoRAAdapter) -> tuple[ParamSpec, ...]:
        known = self._endpoints.get(adapter.name)
        if known is not None:
            if not _same_adapter(known.sink.adapter, adapter):
                raise ValueError(
                    f"LoRA adapter {adapter.name!r} was declared on this engine with another "
                    "id, config or tensors: push it under another name"
                )
            return known.specs()
        for other in self._endpoints.values():
            if other.sink.adapter.id == adapter.id:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r}: id {adapter.id} is "
                    f"{other.sink.adapter.name!r}'s on this engine"
                )
        runner = self._runner()
        specs = adapter_specs(adapter, lora_manager(runner), self._specs())
        self.guard()
        sink = AdapterSink(adapter, specs, self._runner)
        self._endpoints[adapter.name] = _AdapterEndpoint(sink, self._device)
        return specs

    def guard(self) -> None:
        """Make vLLM's LoRA manager, asked to load an adapter declared here (the first
        request after vLLM evicted it from its cache), make it from the tensors of the
        version installed, not look for files at its
        :attr:`~asyncrefit.vllm.LoRAAdapter.path` (which fails the engine's step, and
        with it the engine). Without a version (not pushed yet, or taken out after a
        failed install), it is made of zeros: the base model's output, with a warning.
        Idempotent; nothing without LoRA."""
        manager: Any = getattr(self._runner(), "lora_manager", None)
        load = getattr(manager, "_load_adapter", None)
        if manager is None or load is None or getattr(load, "asyncrefit_guard", False):
            return

        def guarded(lora_request: Any) -> Any:
            endpoint = self._endpoints.get(getattr(lora_request, "lora_name", ""))
            if endpoint is None or endpoint.sink.adapter.path != lora_request.lora_path:
                return load(lora_request)
            adapter, tensors = endpoint.sink.adapter, endpoint.sink.served
            if tensors is None:
                logger.warning(
                    "LoRA adapter %r has no version on this rank (not pushed yet, or taken "
                    "out after a failed push): its requests get the base model's output",
                    adapter.name,
                )
                tensors = {
                    spec.name: torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype))
                    for spec in endpoint.specs()
                }
            return build(adapter, tensors, self._runner(), check_room=False)

        guarded.asyncrefit_guard = True  # type: ignore[attr-defined]
        manager._load_adapter = guarded

    def release(self) -> None:
        """Drop every adapter's cached mappings (the adapters stay served)."""
        for endpoint in self._endpoints.values():
            endpoint.release_handles()

    def abandon(self) -> None:
        """Give up every pending adapter version (its copies set aside are dropped)."""
        for endpoint in self._endpoints.values():
            pending = endpoint.state.pending
            if pending is not None:
                endpoint.abort(pending)
