"""What vLLM loads into each of its workers: a weight-transfer engine and an extension.

Start the engine with :func:`asyncrefit.vllm.engine_args` (``worker_extension_cls`` is
:class:`RefitWorkerExtension`, ``weight_transfer_config`` names the ``"asyncrefit"``
backend). Importing this module (vLLM does, in every worker, when it resolves the
extension) registers :class:`ChannelWeightTransferEngine` with vLLM's
``WeightTransferEngineFactory``, before the worker loads its model and creates its
weight-transfer engine.

The engine reads requests from its own per-worker channel (see
:mod:`asyncrefit.vllm._wire`); vLLM's RPCs carry only a request id, and the requests
are served by the worker-side :class:`~asyncrefit._worker._endpoint.Endpoint` shared by every
backend. Weights travel by handle: the endpoint validates and opens the handle for
its own device; its sink (:mod:`asyncrefit.vllm._sink`) copies the bucket's tensors
out of the trainer's buffer, drops every view of it, and feeds the tensors, under their
checkpoint (Hugging Face) names, to the model's ``load_weights`` inside vLLM's
layerwise reload (``start_weight_update`` .. ``finish_weight_update``), which repacks
fused parameters (``qkv_proj``, ``gate_up_proj``) as a fresh load would, and can be
repeated for the engine's whole life. Layers that received nothing but share tensors
with written ones (a tied ``lm_head``) have their post-load processing re-run after the
reload (see :mod:`asyncrefit.vllm._reload`), or the commit fails.

A version the trainer writes directly into the rank's exported parameters (see
:mod:`asyncrefit.vllm._direct`) needs no engine RPC at all: a thread of the worker
serves its control channel, where the version's begin, commit and abort arrive
(:meth:`ChannelWeightTransferEngine.control`).

A LoRA adapter's requests (its declaration, then :class:`~asyncrefit.vllm._wire.ToAdapter`
around a begin, a bucket, a commit, ...) go to the rank's adapters
(:mod:`asyncrefit.vllm._adapters`), each with its own endpoint and versions; its push
goes on the control channel, with no engine RPC.

This module imports torch and vLLM: only vLLM worker processes import it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from .._device import DeviceId, local_node_id
from .._exceptions import AsyncRefitError
from .._wire._errors import error_reply
from .._wire._messages import Aborted, AbortUpdate, BeginUpdate, CommitUpdate, Done
from .._worker._endpoint import Endpoint
from ..transport.destinations import Destinations
from ._adapters import Adapters
from ._amx import request_amx
from ._compat import not_a_trainer_side
from ._sink import Faults, ReloadSink, checkpoint_specs
from ._wire import BACKEND, BlockingChannel, ControlHello, DeclareAdapter, RankHello, ToAdapter

if not torch.cuda.is_available():
    request_amx()  # vLLM's CPU kernels may use AMX (see asyncrefit.vllm._amx)

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


class _RankEndpoint(Endpoint[Aborted]):
    """The endpoint of a rank: direct versions go to the sink, which exports them."""

    sink: ReloadSink

    def destinations(self) -> Destinations | None:
        return self.sink.destinations()

    def begin_direct(self, version: int) -> None:
        self.sink.begin_direct(version)
        self.state.begin(version, direct=True)


class ChannelWeightTransferEngine(  # type: ignore[misc, unused-ignore]
    WeightTransferEngine[ChannelInitInfo, ChannelTrigger]
):
    """vLLM's weight-transfer engine for asyncrefit: one channel per worker.

    ``init_transfer_engine`` connects to the coordinator-side adapter's socket;
    ``start_weight_update`` starts vLLM's layerwise reload; every ``update_weights``
    serves one request read from the channel (begin, load a bucket, commit, abort);
    ``finish_weight_update`` finalizes the reload and makes the committed version
    complete. Requests outside a session arrive through
    :meth:`RefitWorkerExtension.asyncrefit_serve`. A thread serves the control
    channel (:meth:`control`: direct versions), one request at a time with the
    engine's own calls (a lock); it ends with the channel, aborting a direct version
    left open.

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
    # Abstract in vLLM 0.26: the coordinator sends, never vLLM's trainer-side helper.
    trainer_send_weights = staticmethod(not_a_trainer_side)

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._rank = int(getattr(vllm_config.parallel_config, "rank", 0))
        self._channel: BlockingChannel | None = None
        # The control channel and the thread serving it (direct versions' begin,
        # commit and abort, with no engine RPC); the lock keeps it and the engine's
        # own calls from handling requests at the same time.
        self._control: BlockingChannel | None = None
        self._control_thread: threading.Thread | None = None
        self._lock = threading.RLock()
        # Whether the open update was opened by the control channel (not vLLM's).
        self._control_update = False
        where = _device_id(torch.device(device), self._rank)
        self._sink = ReloadSink(self, where)
        self._endpoint: Endpoint[Aborted] = _RankEndpoint(self._sink, where)
        # The vLLM worker this engine belongs to (its model runner holds the LoRA
        # manager), made known by the extension's first RPC; and the LoRA adapters
        # pushed in memory, each with its own versions.
        self.worker: Any = None
        self._adapters = Adapters(
            lambda: getattr(self.worker, "model_runner", None),
            lambda: dict(self._sink.declared().specs),
            where,
        )

    def __repr__(self) -> str:
        return (
            f"<ChannelWeightTransferEngine rank={self._rank} {self._endpoint.device} "
            f"connected={self._channel is not None} reloading={self._sink.reloading} "
            f"{self._endpoint.state}>"
        )

    # --- vLLM's WeightTransferEngine ------------------------------------------------

    def init_transfer_engine(self, init_info: ChannelInitInfo) -> None:
        """Connect to the adapter's socket twice (the channel, then the control
        channel, whose thread starts here) and say which rank this is."""
        self._close_channel()
        with self._lock:
            self._end_abandoned_reload()  # a previous coordinator may have left one open
        pid = os.getpid()
        channel = BlockingChannel(init_info.channel, init_info.timeout)
        control: BlockingChannel | None = None
        try:
            channel.send(0, RankHello(rank=self._rank, pid=pid))
            control = BlockingChannel(init_info.channel, init_info.timeout)
            control.send(0, ControlHello(rank=self._rank, pid=pid))
            control.wait_forever()
        except BaseException:
            channel.close()
            if control is not None:
                control.close()
            raise
        self._channel, self._control = channel, control
        thread = threading.Thread(
            target=self._serve_control,
            args=(control,),
            name=f"asyncrefit-control-{self._rank}",
            daemon=True,
        )
        self._control_thread = thread
        thread.start()

    def start_weight_update(self) -> None:
        with self._lock:
            if self._control_update:
                raise AsyncRefitError(
                    "a version written directly is being received: vLLM's weight update "
                    "cannot start until asyncrefit commits or aborts it"
                )
            self._end_abandoned_reload()
            self._sink.start()

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
        with self._lock:
            self._control_update = False
            commit = self._sink.finish()
            if commit is not None:
                self._endpoint.complete(*commit)
            else:
                self._end_abandoned_reload()

    def shutdown(self) -> None:
        self._close_channel()
        with self._lock:
            self._endpoint.release_handles()
            self._adapters.abandon()
            self._adapters.release()

    def _handle(self, request: object) -> object:
        """One request, for the engine's weights or for one of its LoRA adapters."""
        if isinstance(request, DeclareAdapter | ToAdapter):
            return self._adapters.handle(request)
        return self._endpoint.handle(request)

    # --- serving the channel ----------------------------------------------------------

    def serve(self, request_id: int) -> object:
        """Read the request ``request_id`` from the channel, handle it, answer it; the
        reply (``None`` if there was none to give).

        Frames of older ids (their trigger never came: the adapter's call was
        cancelled) are skipped. Never raises: if the channel is missing or breaks, it
        is closed, an update session in progress is aborted here (no layer is left
        unloaded), and the adapter sees its connection end.
        """
        channel = self._channel
        reply: object = None
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
            with self._lock:
                reply = self._handle(request)
            channel.send(request_id, reply)
        except Exception as exc:  # timeout, broken or garbled channel (handle never raises)
            logger.warning("rank %d: asyncrefit channel failed: %s", self._rank, exc)
            self._close_channel()
            try:
                with self._lock:
                    self._end_abandoned_reload()
            except Exception:
                logger.exception("rank %d: ending the weight reload failed", self._rank)
            return None
        return reply

    # --- the control channel (a thread of its own) -------------------------------------

    def _serve_control(self, channel: BlockingChannel) -> None:
        """Serve the control channel until it closes: each request as it arrives.

        When the channel ends (the adapter closed it or went away) with a direct
        version still open, that version is aborted here: no update is left open.
        """
        try:
            while True:
                request_id, request = channel.receive()
                channel.send(request_id, self.control(request))
        except Exception as exc:  # closed (EOF, shut down) or garbled
            logger.debug("rank %d: asyncrefit control channel ended: %s", self._rank, exc)
        finally:
            channel.close()
            with self._lock:
                self._adapters.abandon()  # a LoRA push left open: its copies go
                if self._control_update:
                    try:
                        self._endpoint.abandon()
                        self.finish_weight_update()
                    except Exception:
                        logger.exception("rank %d: ending a direct version failed", self._rank)

    def control(self, request: object) -> object:
        """Handle one control request: the begin, commit or abort of a version the
        trainer writes directly into this rank's exported parameters. The begin opens
        this engine's update (vLLM's own weight update stays closed: no RPC is needed)
        and the commit or the abort ends it; the engine serves nothing meanwhile (its
        caller paused generation, or an ``LLM`` generates only inside its own calls).

        Never raises: failures are error replies.
        """
        with self._lock:
            try:
                match request:
                    case BeginUpdate(direct=True):
                        if self._sink.open:
                            raise AsyncRefitError("a weight update is open already")
                        self._end_abandoned_reload()
                        self._sink.start()
                        self._control_update = True
                        reply = self._endpoint.handle(request)
                        if not isinstance(reply, Done):
                            self.finish_weight_update()  # nothing begun: end it here
                        return reply
                    case CommitUpdate():
                        reply = self._endpoint.handle(request)
                        if isinstance(reply, Done) and self._control_update:
                            self.finish_weight_update()  # the version becomes complete
                        return reply
                    case AbortUpdate():
                        reply = self._endpoint.handle(request)
                        if self._control_update:
                            self.finish_weight_update()  # no commit: ends as an abort
                        return reply
                    case ToAdapter():
                        # A LoRA adapter's push: set aside, swapped in at the commit.
                        return self._adapters.handle(request)
                raise AsyncRefitError(f"{type(request).__name__} is not a control request")
            except Exception as exc:
                return error_reply(exc)

    def _end_abandoned_reload(self) -> None:
        self._endpoint.abandon()
        if self._sink.reloading:
            self._sink.end_reload()

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        control, self._control = self._control, None
        thread, self._control_thread = self._control_thread, None
        if control is not None:
            control.close()  # wakes the thread, which ends what it left open
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)


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
        engine.worker = self  # its model runner holds the LoRA manager
        return engine

    def asyncrefit_shutdown(self) -> None:
        """Close this worker's asyncrefit channel (aborting an update session it left
        open); the engine keeps serving. vLLM 0.32 has ``shutdown_weight_transfer_engine``
        for this, 0.26 nothing: this one RPC serves every release."""
        engine = self._asyncrefit_engine()
        engine.shutdown()
        with engine._lock:
            engine._end_abandoned_reload()

    def asyncrefit_serve(self, request_id: int) -> None:
        """Serve request ``request_id`` from this worker's asyncrefit channel."""
        self._asyncrefit_engine().serve(request_id)

    def asyncrefit_learn_copy_plan(self, checkpoint: str | None = None) -> dict[str, Any]:
        """Learn this rank's copy plan (:mod:`asyncrefit.vllm._copyplan`) on the live
        model, outside any update session; with ``checkpoint`` (the directory the engine
        was loaded from), check it bitwise against what the engine loaded.

        Returns the plan's summary, with ``mismatches`` (targets where the plan would
        write other bytes than the engine holds) when checked. The model's parameters
        are swapped for float64 during the learning and restored after it: run it
        while the engine serves nothing.
        """
        from ._copyplan import learn, mismatches
        from ._direct import derives
        from ._sink import checkpoint_specs

        engine = self._asyncrefit_engine()
        model = engine.model
        shapes = {s.name: s.shape for s in checkpoint_specs(engine.vllm_config)}
        cpu = torch.device(engine.device).type == "cpu"
        plan = learn(model, shapes, processed=derives(model, cpu))
        found = plan.summary()
        found["all"] = sorted(shapes)
        if checkpoint is not None:
            from safetensors.torch import load_file

            tensors: dict[str, torch.Tensor] = {}
            for path in sorted(Path(checkpoint).glob("*.safetensors")):
                tensors.update(load_file(str(path)))
            params = dict(model.named_parameters())
            found["mismatches"] = mismatches(plan, params, tensors)
        return found

    def asyncrefit_direct_status(self) -> dict[str, Any]:
        """Whether a trainer on this node can write this rank directly, and if not why
        (exporting it if that was not done yet: see ``ReloadSink.destinations``)."""
        sink = self._asyncrefit_engine()._sink
        found = sink.destinations()
        return {"direct": found is not None, "why_not": sink.why_not}

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
        engine._sink.faults = Faults(fail_finalize=fail_finalize, abort_delay=abort_delay)


def register() -> None:
    """Register :class:`ChannelWeightTransferEngine` as vLLM's ``"asyncrefit"`` backend.

    Idempotent; runs when this module is imported.
    """
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ChannelWeightTransferEngine)
    except ValueError:
        pass  # registered already (this module was imported before)


register()
