"""What vLLM loads into each of its workers: a weight-transfer engine and an extension.

Start the engine with :func:`asyncrefit.vllm.engine_args` (``worker_extension_cls`` is
:class:`RefitWorkerExtension`, ``weight_transfer_config`` names the ``"asyncrefit"``
backend). Importing this module (vLLM does, in every worker, when it resolves the
extension) registers :class:`ChannelWeightTransferEngine` with vLLM's
``WeightTransferEngineFactory``, before the worker loads its model and creates its
weight-transfer engine.

The engine reads requests from its own per-worker channel (see
:mod:`asyncrefit.vllm._wire`); vLLM's RPCs carry only a request id. Weights travel by
handle: the engine opens the handle for its own device, copies the bucket's tensors
out of the trainer's buffer, drops every view of it, and feeds the tensors, under their
checkpoint (Hugging Face) names, to the model's ``load_weights`` inside vLLM's
layerwise reload (``start_weight_update`` .. ``finish_weight_update``), which repacks
fused parameters (``qkv_proj``, ``gate_up_proj``) as a fresh load would, and can be
repeated for the engine's whole life. Layers that received nothing but share tensors
with written ones (a tied ``lm_head``) have their post-load processing re-run after the
reload (see :mod:`asyncrefit.vllm._reload`), or the commit fails.

This module imports torch and vLLM: only vLLM worker processes import it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from .._checksum import checksum
from .._device import DeviceId, local_node_id
from .._exceptions import AsyncRefitError, IntegrityError, TransportError
from .._layout import check_layout
from .._messages import (
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    DeviceReply,
    Done,
    ErrorReply,
    GetSpecs,
    GetVersion,
    LoadBucket,
    ReleaseHandles,
    Reply,
    ReportDevice,
    SpecsReply,
    VersionReply,
)
from .._plan import ParamSpec
from .._version import UpdateStateError, VersionState
from ..transport._base import Handle, Importer, dtype_name, make_importer, torch_dtype
from . import _reload
from ._wire import BACKEND, Aborted, BlockingChannel, Hello

logger = logging.getLogger(__name__)

__all__ = (
    "ChannelInitInfo",
    "ChannelTrigger",
    "ChannelWeightTransferEngine",
    "RefitWorkerExtension",
    "checkpoint_specs",
    "register",
)


@dataclass
class ChannelInitInfo(WeightTransferInitInfo):  # type: ignore[misc, unused-ignore]
    """``init_weight_transfer_engine`` info: the Unix socket to connect to."""

    channel: str
    timeout: float = 60.0


@dataclass
class ChannelTrigger(WeightTransferUpdateInfo):  # type: ignore[misc, unused-ignore]
    """``update_weights`` info: serve the request with this id from the channel."""

    request_id: int


def checkpoint_specs(vllm_config: Any) -> tuple[ParamSpec, ...]:
    """The parameters the engine's model accepts: its checkpoint's names and shapes.

    vLLM fuses parameters (``q_proj``, ``k_proj``, ``v_proj`` into ``qkv_proj``) and
    shards them across ranks, so the model's own parameters are not what a trainer
    sends. What the model's ``load_weights`` accepts is what it was loaded from: the
    tensors of its safetensors checkpoint, found the way vLLM's default loader found
    them. The dtype is the one the engine serves in (``model_config.dtype``): send
    tensors in that dtype. Raises :class:`AsyncRefitError` for other checkpoint formats.
    """
    from safetensors import safe_open
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model_config = vllm_config.model_config
    loader = DefaultModelLoader(vllm_config.load_config)
    # The same file selection (index filtering included) as the load at start-up.
    _, files, use_safetensors, _ = loader._prepare_weights(
        model_config.model, None, model_config.revision, True, None
    )
    if not use_safetensors:
        raise AsyncRefitError(
            f"the checkpoint of {model_config.model!r} is not in safetensors format: "
            "asyncrefit reads the parameter names a vLLM model accepts from it"
        )
    dtype = dtype_name(model_config.dtype)
    specs: dict[str, ParamSpec] = {}
    for path in sorted(files):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shape = tuple(int(d) for d in f.get_slice(name).get_shape())
                specs[name] = ParamSpec(name=name, shape=shape, dtype=dtype)
    return tuple(specs[n] for n in sorted(specs))


def _device_id(device: torch.device, rank: int) -> DeviceId:
    if device.type == "cuda":
        try:
            from .._cuda import cuda_device
        except ImportError:  # pragma: no cover - older asyncrefit without CUDA support
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            return DeviceId(node=local_node_id(), device=f"GPU-{uuid}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return cuda_device(index)
    # CPU workers share the machine: each rank is its own virtual device.
    return DeviceId(node=local_node_id(), device=f"{device.type}:{rank}")


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
class _Faults:
    """Faults to inject, each once (see :meth:`RefitWorkerExtension.asyncrefit_inject_faults`)."""

    fail_finalize: bool = False
    abort_delay: float = 0.0


class ChannelWeightTransferEngine(  # type: ignore[misc, unused-ignore]
    WeightTransferEngine[ChannelInitInfo, ChannelTrigger]
):
    """vLLM's weight-transfer engine for asyncrefit: one channel per worker.

    ``init_transfer_engine`` connects to the coordinator-side adapter's socket;
    ``start_weight_update`` starts vLLM's layerwise reload; every ``update_weights``
    serves one request read from the channel (begin, load a bucket, commit, abort);
    ``finish_weight_update`` finalizes the reload and makes the committed version
    complete. Requests outside a session arrive through
    :meth:`RefitWorkerExtension.asyncrefit_serve`.

    Resource handling: a bucket's tensors are copied out of the trainer's buffer into
    tensors of this worker, and every view of the buffer is dropped, before the bucket
    is loaded and acknowledged; mappings of shared buffers are cached across pushes and
    closed by ``ReleaseHandles`` and :meth:`shutdown`.

    Error handling: a request that fails is answered with an error reply on the
    channel; ``update_weights`` itself does not raise (vLLM would leave the session
    half-open). A bucket whose tensors are not the checkpoint's (name, shape, dtype),
    without a handle for this worker's device, or whose copy fails its checksum
    (``verify=True``), is refused before any of its bytes reach the model.
    Aborting a session whose layers were partly loaded restores the layers that had
    not received all their tensors; the worker then holds no complete version.
    A commit is refused (:class:`~asyncrefit.StaleWeightsError`) when a layer that
    received nothing shares tensors with a written one and its post-load processing
    cannot be re-run (see :mod:`asyncrefit.vllm._reload`); one that can is re-run after
    the reload is finalized. If finalizing fails, the layers it did not reach get their
    previous tensors back and the version stays incomplete (an abort reports it written).
    """

    init_info_cls = ChannelInitInfo
    update_info_cls = ChannelTrigger
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._rank = int(getattr(vllm_config.parallel_config, "rank", 0))
        self._device_id = _device_id(torch.device(device), self._rank)
        self._channel: BlockingChannel | None = None
        self._importers: dict[str, Importer] = {}
        self._specs: dict[str, ParamSpec] | None = None
        self._state = VersionState()
        self._reloading = False
        self._commit: tuple[int, int] | None = None
        self._shared: list[_reload.SharedLayer] = []
        self._faults = _Faults()

    def __repr__(self) -> str:
        return (
            f"<ChannelWeightTransferEngine rank={self._rank} {self._device_id} "
            f"connected={self._channel is not None} reloading={self._reloading} {self._state}>"
        )

    # --- vLLM's WeightTransferEngine ------------------------------------------------

    def init_transfer_engine(self, init_info: ChannelInitInfo) -> None:
        """Connect to the adapter's socket and say which rank this is."""
        self._close_channel()
        self._end_abandoned_reload()  # a previous coordinator may have left one open
        channel = BlockingChannel(init_info.channel, init_info.timeout)
        try:
            channel.send(0, Hello(rank=self._rank, pid=os.getpid()))
        except BaseException:
            channel.close()
            raise
        self._channel = channel

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._commit = None
        self._shared = []
        self._end_abandoned_reload()
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would synchronize the accelerator after every chunk; loads
        # here are complete when their reply is sent.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ChannelTrigger) -> None:
        self.serve(update_info.request_id)

    def finish_weight_update(self) -> None:
        """Finalize the reload; the version the adapter committed becomes complete.

        Without a commit (the adapter aborted, or someone finished the session by
        hand) the session ends as an abort.
        """
        commit, self._commit = self._commit, None
        shared, self._shared = self._shared, []
        if not self._reloading:
            return  # aborted already: the layers were restored then
        if commit is None:
            self._end_abandoned_reload()
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        try:
            if self._faults.fail_finalize:
                self._faults.fail_finalize = False
                raise RuntimeError("injected fault: finalize_layerwise_reload failed")
            finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call, unused-ignore]
            _reload.refresh(shared)
        except BaseException:
            _reload.restore_unfinished(self.model)
            # The version stays pending and written: no complete version here, and
            # the abort that follows reports bytes written (the engine is relabelled).
            raise
        self._state.commit(*commit)

    def shutdown(self) -> None:
        self._close_channel()
        self._release()

    # --- serving the channel ----------------------------------------------------------

    def serve(self, request_id: int) -> None:
        """Read the request ``request_id`` from the channel, handle it, answer it.

        Frames of older ids (their trigger never came: the adapter's call was
        cancelled) are skipped. Never raises: if the channel is missing or breaks, it
        is closed, an update session in progress is aborted here (no layer is left
        unloaded), and the adapter sees its connection end.
        """
        channel = self._channel
        try:
            if channel is None:
                raise ConnectionError("no asyncrefit channel: init_weight_transfer_engine first")
            while True:
                got, request = channel.receive()
                if got == request_id:
                    break
                if got > request_id:
                    raise ConnectionError(f"request {got} arrived before {request_id}")
                logger.debug("rank %d skips stale request %d", self._rank, got)
            reply = self._handle(request)
            channel.send(request_id, reply)
        except Exception as exc:  # timeout, broken or garbled channel (_handle never raises)
            logger.warning("rank %d: asyncrefit channel failed: %s", self._rank, exc)
            self._close_channel()
            try:
                self._end_abandoned_reload()
            except Exception:
                logger.exception("rank %d: ending the weight reload failed", self._rank)

    def _handle(self, request: object) -> Reply | Aborted:
        try:
            match request:
                case ReportDevice():
                    return DeviceReply(device=self._device_id)
                case GetSpecs():
                    return SpecsReply(specs=tuple(self._declared().values()))
                case BeginUpdate(version=v):
                    if not self._reloading:
                        raise UpdateStateError(f"version {v} begun outside a weight update")
                    self._state.begin(v)
                    return Done()
                case LoadBucket():
                    return self._load(request)
                case CommitUpdate(version=v, buckets=n):
                    self._state.check_loading(v)
                    if len(self._state.loaded) != n:
                        raise UpdateStateError(
                            f"version {v} committed with {len(self._state.loaded)} of {n} "
                            "buckets loaded"
                        )
                    # Layers that share tensors with written ones must be renewed
                    # after the finalize: refuse now if one of them cannot be.
                    found = _reload.review(self.model)
                    _reload.check(found)
                    self._shared = list(found.shared)
                    self._commit = (v, n)
                    return Done()
                case AbortUpdate(version=v):
                    if self._faults.abort_delay > 0:
                        delay, self._faults.abort_delay = self._faults.abort_delay, 0.0
                        time.sleep(delay)
                    self._commit = None
                    written = self._state.pending == v and self._state.dirty
                    if self._reloading:
                        self._abort_reload()
                    self._state.abort(v)
                    return Aborted(version=self._state.complete, written=written)
                case GetVersion():
                    return VersionReply(version=self._state.complete)
                case ReleaseHandles():
                    self._release()
                    return Done()
        except Exception as exc:
            logger.debug("rank %d: request %r failed", self._rank, request, exc_info=True)
            return ErrorReply(type=type(exc).__name__, message=str(exc))
        return ErrorReply(type="TypeError", message=f"unknown request {type(request).__name__}")

    def _declared(self) -> dict[str, ParamSpec]:
        if self._specs is None:
            self._specs = {s.name: s for s in checkpoint_specs(self.vllm_config)}
        return self._specs

    def _own_handle(self, handles: tuple[Handle, ...]) -> Handle:
        for handle in handles:
            if handle.device == self._device_id:
                return handle
        offered = ", ".join(str(h.device) for h in handles) or "none"
        raise TransportError(f"no handle for device {self._device_id} (offered: {offered})")

    def _check(self, handle: Handle) -> None:
        declared = self._declared()
        for e in handle.entries:
            spec = declared.get(e.name)
            if spec is None:
                raise TransportError(
                    f"bucket {handle.bucket} names {e.name!r}, which the model does not load"
                )
            if spec.shape != e.shape or spec.dtype != e.dtype:
                raise TransportError(
                    f"bucket {handle.bucket}, parameter {e.name!r}: {e.dtype}{list(e.shape)} "
                    f"sent, {spec.dtype}{list(spec.shape)} expected"
                )

    def _importer(self, kind: str) -> Importer:
        importer = self._importers.get(kind)
        if importer is None:
            importer = self._importers[kind] = make_importer(kind)
        return importer

    def _load(self, request: LoadBucket) -> BucketAck:
        start = time.perf_counter()
        self._state.check_loading(request.version)
        if not self._reloading:
            raise UpdateStateError(f"bucket {request.bucket} arrived outside a weight update")
        handle = self._own_handle(request.handles)
        self._check(handle)
        check_layout(handle)
        importer = self._importer(handle.kind)
        buffer = importer.open(handle)
        try:
            check_layout(handle, buffer.numel())
            # Copy out of the trainer's buffer first: vLLM's layerwise reload keeps the
            # tensors of a layer until all of that layer arrived, possibly in a later
            # bucket, and the trainer reuses this buffer once the bucket is acked.
            weights: list[tuple[str, torch.Tensor]] = []
            for e in handle.entries:
                src = buffer[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype))
                weights.append((e.name, src.view(e.shape).to(self.device, copy=True)))
                del src
            # Waited for on the host even for an ordered handle: the copies above must
            # have read the buffer before the ack (no token is passed back from here).
            importer.finish(handle)
            importer.settle()
        finally:
            del buffer  # no view of the trainer's buffer outlives this block
        if handle.checksum is not None:  # verify=True: check the copy before loading it
            got = checksum(t for _, t in weights)
            if got != handle.checksum:
                raise IntegrityError(request.bucket, handle.checksum, got)
        self._state.loading(request.version, request.bucket)  # model bytes change now
        with torch.no_grad(), _no_mtp_check():
            cast(Any, self.model).load_weights(weights)
        return BucketAck(
            bucket=request.bucket,
            nbytes=sum(e.nbytes for e in handle.entries),
            seconds=time.perf_counter() - start,
        )

    def _abort_reload(self) -> None:
        """End a layerwise reload without a commit; no layer is left half-loaded.

        Layers that received only part of their tensors get their previous tensors
        back; the rest is finalized as vLLM does (layers that received nothing keep
        their previous tensors, complete ones were processed when they completed).
        """
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, layerwise

        self._reloading = False
        self._shared = []
        shared = _reload.review(self.model).shared
        restore = getattr(layerwise, "_place_kernel_tensors", None)
        for layer in self.model.modules():
            info = layerwise.get_layerwise_info(layer)
            partial = (
                info.can_load()
                and info.kernel_tensors is not None
                and 0 < info.load_numel < (info.load_numel_total or 0)
            )
            if partial and restore is not None:
                restore(layer, info)
                info.reset()  # type: ignore[no-untyped-call, unused-ignore]
        try:
            finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call, unused-ignore]
        except BaseException:
            _reload.restore_unfinished(self.model)
            raise
        # Whatever was written stays: layers sharing it must not serve older copies.
        _reload.refresh(shared, strict=False)

    def _end_abandoned_reload(self) -> None:
        if self._state.pending is not None:
            self._state.abort(self._state.pending)
        if self._reloading:
            self._abort_reload()

    def _release(self) -> None:
        importers, self._importers = self._importers, {}
        for importer in importers.values():
            importer.close()

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


class RefitWorkerExtension:
    """vLLM's ``worker_extension_cls`` for asyncrefit: RPCs outside weight updates.

    vLLM mixes this class into its worker class, so ``self`` is the vLLM worker. Its
    method :meth:`asyncrefit_serve` serves a request of the channel (device id,
    parameter specs, version, releasing handles) through ``collective_rpc``; loads go
    through vLLM's own ``update_weights``. :meth:`asyncrefit_inject_faults` is for
    tests and drills. Subclass it to add methods of your own.
    """

    def _asyncrefit_engine(self) -> ChannelWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ChannelWeightTransferEngine):
            raise AsyncRefitError(
                "this vLLM engine was not started with asyncrefit's weight transfer "
                f"engine (weight_transfer_config backend {BACKEND!r}); "
                "pass asyncrefit.vllm.engine_args()"
            )
        return engine

    def asyncrefit_serve(self, request_id: int) -> None:
        """Serve request ``request_id`` from this worker's asyncrefit channel."""
        self._asyncrefit_engine().serve(request_id)

    def asyncrefit_inject_faults(
        self, *, fail_finalize: bool = False, abort_delay: float = 0.0
    ) -> None:
        """For tests and drills: make this worker fail on cue, each fault once.

        ``fail_finalize``: the next ``finish_weight_update`` after a commit raises where
        vLLM's ``finalize_layerwise_reload`` would run, as if it had failed.
        ``abort_delay``: the next abort request is answered only after this many
        seconds (the worker blocks, as in a slow load).
        Call it through ``collective_rpc("asyncrefit_inject_faults", kwargs=...)``.
        """
        engine = self._asyncrefit_engine()
        engine._faults = _Faults(fail_finalize=fail_finalize, abort_delay=abort_delay)


def register() -> None:
    """Register :class:`ChannelWeightTransferEngine` as vLLM's ``"asyncrefit"`` backend.

    Idempotent; runs when this module is imported.
    """
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ChannelWeightTransferEngine)
    except ValueError:
        pass  # registered already (this module was imported before)


register()
