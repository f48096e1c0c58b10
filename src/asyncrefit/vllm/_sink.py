"""The sink of a vLLM engine: a bucket's tensors into ``load_weights``, inside a reload.

:class:`ReloadSink` is the :class:`~asyncrefit._worker._endpoint.Sink` of
:class:`~asyncrefit.vllm.worker.ChannelWeightTransferEngine`. The endpoint validates
and opens a bucket's handle; the sink copies the tensors out of the trainer's buffer
into tensors of this worker (vLLM's layerwise reload keeps a layer's tensors until all
of that layer arrived, possibly in a later bucket, and the trainer reuses the buffer
once the bucket is acked), then feeds them, under their checkpoint names, to the
model's ``load_weights``. It owns the layerwise reload (``start`` .. ``finish``): a
commit is accepted only if no layer would be left serving stale weights
(:func:`~asyncrefit.vllm._reload.review` / :func:`~asyncrefit.vllm._reload.check`),
and an abort puts partly loaded layers back.

This module imports torch and vLLM: only vLLM worker processes import it.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from .._checksum import verify_checksum
from .._core._plan import ParamSpec
from .._device import DeviceId
from .._exceptions import AsyncRefitError, UpdateStateError
from .._wire._messages import Aborted
from .._worker._layout import Declared
from ..transport._base import Handle, Importer, dtype_name, torch_dtype
from ..transport.destinations import Destinations
from . import _reload
from ._compat import checkpoint_files
from ._direct import DirectExport, export, synchronize

logger = logging.getLogger(__name__)


#: safetensors' dtype names, as torch names them.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
#: Dtypes a checkpoint tensor is sent in the serving dtype from (the engine casts them).
_SERVED_FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})


def checkpoint_specs(vllm_config: Any) -> tuple[ParamSpec, ...]:
    """The parameters the engine's model accepts: its checkpoint's names and shapes.

    vLLM fuses parameters (``q_proj``, ``k_proj``, ``v_proj`` into ``qkv_proj``) and
    shards them across ranks, so the model's own parameters are not what a trainer
    sends. What the model's ``load_weights`` accepts is what it was loaded from: the
    tensors of its safetensors checkpoint, found the way vLLM's default loader found
    them. The dtype is the one the engine serves in (``model_config.dtype``), except
    where the checkpoint holds a tensor in another kind of dtype (the ``float8_e4m3fn``
    weights of an FP8 checkpoint, integer-packed weights) or a quantized model holds it
    in ``float32`` (its scales): those are sent as the checkpoint has them, as a cast
    would change what they mean. Raises :class:`AsyncRefitError` for other checkpoint
    formats.
    """
    from safetensors import safe_open
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model_config = vllm_config.model_config
    loader = DefaultModelLoader(vllm_config.load_config)
    # The same file selection (index filtering included) as the load at start-up.
    files, use_safetensors = checkpoint_files(loader, model_config)
    if not use_safetensors:
        raise AsyncRefitError(
            f"the checkpoint of {model_config.model!r} is not in safetensors format: "
            "asyncrefit reads the parameter names a vLLM model accepts from it"
        )
    serving = dtype_name(model_config.dtype)
    quantized = getattr(model_config, "quantization", None) is not None
    specs: dict[str, ParamSpec] = {}
    for path in sorted(files):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                shape = tuple(int(d) for d in piece.get_shape())
                own = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                dtype = serving
                if own is not None and (
                    own not in _SERVED_FLOATS or (quantized and own == "float32")
                ):
                    dtype = own
                specs[name] = ParamSpec(name=name, shape=shape, dtype=dtype)
    return tuple(specs[n] for n in sorted(specs))


@contextmanager
def _no_mtp_check() -> Iterator[None]:
    # A bucket holds part of the model; an MTP model must not check completeness.
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:  # pragma: no cover - older vLLM
        yield
        return
    with disable_mtp_completeness_check():
        yield


@dataclass
class Faults:
    """Faults to inject, each once (see
    :meth:`asyncrefit.vllm.worker.RefitWorkerExtension.asyncrefit_inject_faults`)."""

    fail_finalize: bool = False
    abort_delay: float = 0.0


class Target(Protocol):
    """What the sink loads into: vLLM's weight-transfer engine (its update target).

    Read at every use: vLLM may point the engine at another model between updates.
    """

    model: Any
    model_config: Any
    vllm_config: Any
    device: Any


class ReloadSink:
    """Feeds validated buckets to the model's ``load_weights`` inside a layerwise reload,
    or exports the model's parameters for a trainer to write directly.

    Direct versions (:meth:`destinations`, :meth:`begin_direct`): the first call of
    :meth:`destinations` learns this rank's copy plan and exports the parameters it
    writes (see :mod:`asyncrefit.vllm._direct`), or records why it cannot; a direct
    version opens no reload, and is complete when vLLM's update is finished. A begin is
    refused if an exported parameter moved since (the trainer never writes memory the
    model left); an abort leaves what was written, and says so.

    ``reloading`` is whether vLLM's layerwise reload is open (:meth:`start` ..
    :meth:`finish`): a version is begun and its buckets are taken only then. The
    commit of a version is checked (:meth:`commit`) and kept until :meth:`finish`
    finalizes the reload; only then is the version complete.

    Resource handling: a bucket's tensors are copied out of the opened buffer, the
    copies waited for on the host (an ordered handle included: no token is passed
    back) and every view of the buffer dropped, before any tensor reaches the model;
    no view is kept across buckets.

    Error handling: a begin or a bucket outside a reload raises
    :class:`~asyncrefit.UpdateStateError`; a copy that fails its checksum
    raises :class:`~asyncrefit.IntegrityError` before it is loaded; a commit that would
    leave a layer stale raises :class:`~asyncrefit.StaleWeightsError`. Aborting a
    reload whose layers were partly loaded restores the layers that had not received
    all their tensors. If finalizing fails, the layers it did not reach get their
    previous tensors back and the error propagates (the version stays incomplete).
    """

    def __init__(self, target: Target, device: DeviceId | None = None) -> None:
        self._target = target
        self._device = device
        #: vLLM's weight update is open (``start`` .. ``finish``).
        self.open = False
        #: vLLM's layerwise reload is open (a staged version begun .. finalized or ended).
        self.reloading = False
        self.faults = Faults()
        # The version the trainer writes directly, and this rank's export for it
        # (learned once per model; a string says why there is none).
        self._direct: int | None = None
        self._export: DirectExport | str | None = None
        self._exported_model: Any = None
        self._generation = 0
        self._declared: Declared | None = None
        self._commit: tuple[int, int] | None = None
        self._shared: list[_reload.SharedLayer] = []
        self._repacked: list[_reload.RepackedExperts] = []

    def __repr__(self) -> str:
        return f"<ReloadSink reloading={self.reloading} commit={self._commit}>"

    # --- the sink --------------------------------------------------------------------

    def declared(self) -> Declared:
        if self._declared is None:
            specs = checkpoint_specs(self._target.vllm_config)
            self._declared = Declared(
                specs={s.name: s for s in specs},
                unknown="names {name!r}, which the model does not load",
                own="expected",
            )
        return self._declared

    def begin(self, version: int) -> None:
        """A staged version begins: vLLM's layerwise reload opens."""
        if not self.open:
            raise UpdateStateError(f"version {version} begun outside a weight update")
        if self._direct is not None:
            raise UpdateStateError(f"version {version} begun twice in one weight update")
        if not self.reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self._target.model)
            self.reloading = True

    def begin_direct(self, version: int) -> None:
        """A version the trainer writes into :meth:`destinations` begins (no reload)."""
        if not self.open:
            raise UpdateStateError(f"version {version} begun outside a weight update")
        if self._direct is not None or self.reloading:
            raise UpdateStateError(f"version {version} begun twice in one weight update")
        if not isinstance(self._export, DirectExport):
            raise UpdateStateError(f"version {version} begun direct, but nothing is exported")
        if self._exported_model is not self._target.model or self._moved():
            raise UpdateStateError(
                f"version {version} begun direct, but the engine's parameters moved since "
                "they were exported (a reloaded model): plan again (a new RefitCoordinator)"
            )
        synchronize(self._target.model)  # no kernel reads the parameters from here on
        self._direct = version

    def destinations(self) -> Destinations | None:
        """This rank's parameters as a trainer writes them directly (``None``: it
        cannot be; the engine's log says why), learned at the first call for a model.

        Learning swaps the parameters while it runs: asked outside an update, between
        the engine's steps (``collective_rpc``), it runs while nothing is served.
        """
        model = self._target.model
        moved = isinstance(self._export, DirectExport) and self._moved()
        if self._exported_model is not model or moved:
            if self.open:
                raise UpdateStateError("destinations are exported outside weight updates only")
            if isinstance(self._export, DirectExport):
                self._export.close()
            self._generation += 1
            self._export = self._learn(model)
            self._exported_model = model
        return self._export.destinations if isinstance(self._export, DirectExport) else None

    def _moved(self) -> bool:
        """Whether a parameter the export covers no longer lives where it was exported."""
        assert isinstance(self._export, DirectExport)
        return self._export.moved()

    def _learn(self, model: Any) -> DirectExport | str:
        if self._device is None:
            return "no device was given to the sink"
        specs = self.declared().specs
        try:
            found = export(model, specs, self._device, generation=self._generation)
        except Exception as exc:  # a model the plan cannot be learned for: stay staged
            logger.warning("direct writes off: learning the copy plan failed", exc_info=True)
            return f"learning the copy plan failed: {exc}"
        if isinstance(found, str):
            logger.info("direct writes off for this rank: %s", found)
        else:
            if found.destinations.kind == "shm":
                # The segment keeps its name while this worker lives (another
                # coordinator may open it); its name goes as the worker exits. A worker
                # killed outright leaves it to the sweep (its name carries the pid).
                atexit.register(found.close)
            plan = found.plan
            logger.info(
                "direct writes on: %d block copies into %d parameters (%d tensors)",
                len(plan.copies),
                len({c.target for c in plan.copies}),
                len(specs),
            )
        return found

    @property
    def why_not(self) -> str | None:
        """Why this rank is not written directly (``None``: it is, or was not asked)."""
        return self._export if isinstance(self._export, str) else None

    def close(self) -> None:
        """Unlink what :meth:`destinations` exported (the parameters stay where they are)."""
        if isinstance(self._export, DirectExport):
            self._export.close()

    def receiving(self, bucket: int) -> None:
        if not self.reloading:
            raise UpdateStateError(f"bucket {bucket} arrived outside a staged weight update")

    def opening(self, handle: Handle) -> None:
        pass  # no view outlives a bucket: nothing to drop

    def write(
        self,
        bucket: int,
        handle: Handle,
        buffer: torch.Tensor,
        importer: Importer,
        writing: Callable[[], None],
    ) -> bytes:
        device = self._target.device
        weights: list[tuple[str, torch.Tensor]] = []
        for e in handle.entries:
            src = buffer[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype))
            weights.append((e.name, src.view(e.shape).to(device, copy=True)))
            del src
        # Waited for on the host even for an ordered handle: the copies above must
        # have read the buffer before the ack (no token is passed back from here).
        importer.finish(handle)
        importer.settle()
        del buffer  # no view of the trainer's buffer is held from here on
        verify_checksum(bucket, handle.checksum, (t for _, t in weights))  # before loading
        writing()  # the model's bytes change now
        with torch.no_grad(), _no_mtp_check():
            cast(Any, self._target.model).load_weights(weights)
        return b""

    def commit(self, version: int, buckets: int) -> bool:
        if self._direct is not None:
            if self._direct != version:
                raise UpdateStateError(f"version {version} is not being written")
            if isinstance(self._export, DirectExport):
                # On a GPU: the trainer's writes ran (the event it recorded after them).
                self._export.shared.wait_for_writes()
            self._commit = (version, buckets)
            return False  # complete once vLLM's update is finished (finish)
        # Layers that share tensors with written ones must be renewed after the
        # finalize: refuse now if one of them cannot be.
        found = _reload.review(self._target.model)
        _reload.check(found)
        self._shared = list(found.shared)
        self._repacked = list(found.repacked)
        self._commit = (version, buckets)
        return False  # complete once the reload is finalized (finish)

    def abort(self, version: int) -> None:
        if self.faults.abort_delay > 0:
            delay, self.faults.abort_delay = self.faults.abort_delay, 0.0
            time.sleep(delay)
        self._commit = None
        self._direct = None  # what the trainer wrote stays (the abort says written)
        if self.reloading:
            self.end_reload()

    def aborted(self, complete: int | None, written: bool) -> Aborted:
        return Aborted(version=complete, written=written)

    def release(self) -> None:
        pass  # no view is kept: the importers close their mappings

    # --- the reload session ------------------------------------------------------------

    def start(self) -> None:
        """vLLM's weight update opens (a reload left open must be ended first); the
        version's begin says how it is written (:meth:`begin`, :meth:`begin_direct`)."""
        self._commit = None
        self._direct = None
        self._shared = []
        self._repacked = []
        self.open = True

    def finish(self) -> tuple[int, int] | None:
        """End vLLM's update: finalize the reload if a commit was accepted (a direct
        version needs nothing more); that commit ``(version, buckets)``.

        Returns ``None`` without a commit: a reload still open (``reloading``) must then
        be ended as an abort (:meth:`end_reload`).
        """
        commit, self._commit = self._commit, None
        direct, self._direct = self._direct, None
        shared, self._shared = self._shared, []
        repacked, self._repacked = self._repacked, []
        self.open = False
        if commit is not None and direct is not None:
            if self.faults.fail_finalize:
                self.faults.fail_finalize = False
                raise RuntimeError("injected fault: finishing a direct update failed")
            synchronize(self._target.model)
            return commit
        if not self.reloading or commit is None:
            return None
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        target = self._target
        self.reloading = False
        try:
            if self.faults.fail_finalize:
                self.faults.fail_finalize = False
                raise RuntimeError("injected fault: finalize_layerwise_reload failed")
            finalize_layerwise_reload(target.model, target.model_config)  # type: ignore[no-untyped-call, unused-ignore]
            _reload.repack(repacked)
            _reload.refresh(shared)
        except BaseException:
            _reload.restore_unfinished(target.model)
            # The version stays pending and written: no complete version here, and
            # the abort that follows reports bytes written (the engine is relabelled).
            raise
        return commit

    def end_reload(self) -> None:
        """End a layerwise reload without a commit; no layer is left half-loaded.

        Layers that received only part of their tensors get their previous tensors
        back; the rest is finalized as vLLM does (layers that received nothing keep
        their previous tensors, complete ones were processed when they completed).
        """
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, layerwise

        model = self._target.model
        self.reloading = False
        self._shared = []
        self._repacked = []
        found = _reload.review(model)
        restore = getattr(layerwise, "_place_kernel_tensors", None)
        restored: set[int] = set()
        for layer in model.modules():
            info = layerwise.get_layerwise_info(layer)
            partial = (
                info.can_load()
                and info.kernel_tensors is not None
                and 0 < info.load_numel < (info.load_numel_total or 0)
            )
            if partial and restore is not None:
                restore(layer, info)
                info.reset()  # type: ignore[no-untyped-call, unused-ignore]
                restored.add(id(layer))
        try:
            finalize_layerwise_reload(model, self._target.model_config)  # type: ignore[no-untyped-call, unused-ignore]
        except BaseException:
            _reload.restore_unfinished(model)
            raise
        # Whatever was written stays: layers sharing it must not serve older copies,
        # and expert kernels must read it in their own layout.
        # (A layer given its previous tensors back has them packed already.)
        repacked = [r for r in found.repacked if id(r.layer) not in restored]
        _reload.repack(repacked, strict=False)
        _reload.refresh(found.shared, strict=False)
