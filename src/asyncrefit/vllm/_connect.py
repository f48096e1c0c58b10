"""The public face of the vLLM integration: :class:`VLLMWorker` and how to connect.

Owns what users call: :func:`connect_async_llm` and :func:`connect_llm` (which open an
:class:`~asyncrefit.vllm._link._EngineLink` to the engine, yield one
:class:`VLLMWorker` per rank, and close the link on exit), :class:`VLLMWorker` (one
rank, as the coordinator sees it: each call is one request of that rank through the
link) and :func:`engine_args`.

Errors: a worker's error reply becomes the typed error of that worker
(the WORKER side of the one error map, :mod:`asyncrefit._wire._errors`); a reply of the wrong kind a
:class:`~asyncrefit.WorkerRemoteError` (``"ProtocolError"``). Resources: see
:func:`connect_async_llm`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from .._core._plan import ParamSpec
from .._device import DeviceId
from .._exceptions import WorkerRemoteError
from .._wire._errors import WORKER
from .._wire._messages import (
    BucketAck,
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
from ..transport._base import Handle
from ..transport.destinations import Destinations
from ._channels import ChannelStatistics
from ._link import CLEANUP_TIMEOUT, _EngineLink
from ._lora import LoRAAdapter
from ._ops import PauseMode, _AsyncLLMOps, _LLMOps
from ._wire import BACKEND, EXTENSION, DeclareAdapter, ToAdapter

R = TypeVar("R")


def _reply_of(reply: Reply, name: str, kind: type[R]) -> R:
    if isinstance(reply, ErrorReply):
        raise WORKER.from_reply(name, reply)
    if not isinstance(reply, kind):
        raise WorkerRemoteError(
            name, "ProtocolError", f"expected {kind.__name__}, got {type(reply).__name__}"
        )
    return reply


class _Rank:
    """What every worker of one rank has: its link, its rank, its name and its device."""

    def __init__(self, link: _EngineLink, rank: int, name: str) -> None:
        self._link = link
        self._rank = rank
        self._name = name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name!r} rank={self._rank}>"

    @property
    def name(self) -> str:
        return self._name

    @property
    def rank(self) -> int:
        return self._rank

    async def report_device_id_async(self) -> DeviceId:
        """Asks the vLLM worker, through ``collective_rpc`` awaited on the engine's loop."""
        reply = await self._link.serve(self._rank, ReportDevice())
        return _reply_of(reply, self._name, DeviceReply).device


class VLLMWorker(_Rank):
    """One vLLM worker (one rank of one engine), as the coordinator sees it.

    Implements :class:`asyncrefit.abc.Worker`. Made by :func:`connect_async_llm` or
    :func:`connect_llm`, one per rank. Each rank is sent only its own device's handle,
    on its own channel; the engine-wide RPC that tells the workers to read their
    channels carries only a request id. Steps that vLLM runs on every rank at once
    (begin, each bucket, commit) run when every rank's worker has asked for them, so
    the workers of one engine must be pushed to together (the coordinator does).

    A push pauses generation at begin (``AsyncLLM``, in the mode given), starts vLLM's
    weight update, loads every bucket through ``update_weights``, finishes the update
    with the version as the engine's weight version, resets the prefix cache and
    resumes generation. Where every rank of the engine exports its parameters (a copy
    plan learned from the model's own loaders covers all of them: see
    :mod:`asyncrefit.vllm._direct`) and the trainer runs on the same node, the trainer
    writes them directly instead (:meth:`begin_direct`): no bucket is loaded, vLLM's
    weight update is not opened, and the version's begin, commit and abort go to each
    rank's control channel, which a thread of the worker serves with no engine RPC;
    pausing, the prefix-cache reset and resuming are the same.

    Error handling: a failure inside the worker raises :class:`WorkerRemoteError`
    naming this worker; a dead engine or broken channel :class:`WorkerDiedError`; a
    step that failed at another rank of the engine :class:`~asyncrefit.PeerWorkerError`
    naming that rank. A commit is refused with
    :class:`~asyncrefit.WorkerStaleWeightsError` when part of the model could not follow
    the pushed weights. An abort (which the coordinator sends after any failure) ends
    vLLM's update session and always resumes generation (see
    :func:`connect_async_llm`); if bytes of the new version were written, or finishing
    the update failed, the engine's weight version becomes ``"incomplete-<version>"``.

    :meth:`lora` gives this rank as the worker of one LoRA adapter, pushed by a
    coordinator of its own (see :class:`VLLMAdapterWorker`).
    """

    def __init__(self, link: _EngineLink, rank: int) -> None:
        super().__init__(link, rank, link.worker_name(rank))

    def statistics(self) -> ChannelStatistics:
        """Bytes this worker's channel carried so far (handles included)."""
        return self._link.statistics(self._rank)

    async def parameter_specs(self) -> tuple[ParamSpec, ...]:
        """The checkpoint names, shapes and the engine's dtype the model loads."""
        reply = await self._link.serve(self._rank, GetSpecs())
        return _reply_of(reply, self._name, SpecsReply).specs

    @property
    def direct_group(self) -> str:
        """The engine: its ranks are written directly all together, or none of them."""
        return self._link.name

    async def destinations(self) -> Destinations | None:
        """This rank's parameters as a trainer on its node writes them (``None``: the
        engine's ranks are not all exported; see :mod:`asyncrefit.vllm._direct`)."""
        return await self._link.destinations(self._rank)

    async def begin_update(self, version: int) -> None:
        reply = await self._link.begin(self._rank, version)
        _reply_of(reply, self._name, Done)

    async def begin_direct(self, version: int) -> None:
        """Begin ``version`` as :meth:`begin_update` does (pausing generation), written
        by the trainer into this rank's :meth:`destinations` rather than loaded."""
        reply = await self._link.begin(self._rank, version, direct=True)
        _reply_of(reply, self._name, Done)

    async def abort_unwritten(self, version: int) -> None:
        """Abort ``version``, begun direct, before the trainer wrote any byte of it: the
        engine keeps the version (and the label) it held, and generation resumes."""
        try:
            await self._link.abort(self._rank, version, unwritten=True)
        except Exception as exc:
            raise self._link.translate(exc, self._rank) from exc

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        request = LoadBucket(version=version, bucket=bucket, handles=handles)
        return _reply_of(await self._link.load(self._rank, request), self._name, BucketAck)

    async def commit_update(self, version: int, buckets: int) -> None:
        reply = await self._link.commit(self._rank, version, buckets)
        _reply_of(reply, self._name, Done)

    async def abort_update(self, version: int) -> None:
        try:
            await self._link.abort(self._rank, version)
        except Exception as exc:
            raise self._link.translate(exc, self._rank) from exc

    async def weight_version(self) -> int | None:
        reply = await self._link.serve(self._rank, GetVersion())
        return _reply_of(reply, self._name, VersionReply).version

    async def release_handles(self) -> None:
        reply = await self._link.serve(self._rank, ReleaseHandles())
        _reply_of(reply, self._name, Done)

    def lora(self, adapter: LoRAAdapter) -> VLLMAdapterWorker:
        """This rank as the worker of one LoRA adapter: a coordinator given these
        pushes the adapter, not the engine's weights (see :class:`VLLMAdapterWorker`)."""
        return VLLMAdapterWorker(self._link, self._rank, adapter)


class VLLMAdapterWorker(_Rank):
    """One rank of a vLLM engine, as the worker of one LoRA adapter (made by
    :meth:`VLLMWorker.lora`). Implements :class:`asyncrefit.abc.Worker`.

    Its specs are the adapter's tensors, once the rank checked the adapter against the
    engine (LoRA enabled, the config vLLM accepts, each ``lora_A`` / ``lora_B`` the
    right shape for a linear layer the model's LoRA takes): a mismatch fails discovery,
    before any byte moves. A push pauses generation as a push of the weights does; each
    rank copies the buckets aside on the CPU; the commit builds the adapter at every
    rank, then installs it at every rank (requests that start after the push use it;
    ``LoRAAdapter.request()`` names it), resets the prefix cache (its blocks were
    computed with the old adapter) and resumes generation. The engine's weight version
    is not touched: :meth:`weight_version` is the adapter's own.

    A failed or cancelled push leaves the old version serving; an install that failed
    at a rank (after every rank built it) takes the adapter out at every rank, so the
    engine serves none rather than a mix. Pushes of the engine's weights and of each
    adapter share the engine's session: one runs at a time, the others wait for it.
    Errors: as :class:`VLLMWorker`'s.
    """

    def __init__(self, link: _EngineLink, rank: int, adapter: LoRAAdapter) -> None:
        super().__init__(link, rank, f"{link.worker_name(rank)}/lora-{adapter.name}")
        self.adapter = adapter

    def _for_adapter(self, request: object) -> ToAdapter:
        return ToAdapter(adapter=self.adapter.name, request=request)

    async def parameter_specs(self) -> tuple[ParamSpec, ...]:
        """The adapter's tensors, as the engine takes them (checked; see the class)."""
        reply = await self._link.serve(self._rank, DeclareAdapter(adapter=self.adapter))
        return _reply_of(reply, self._name, SpecsReply).specs

    async def begin_update(self, version: int) -> None:
        reply = await self._link.begin(self._rank, version, adapter=self.adapter.name)
        _reply_of(reply, self._name, Done)

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        request = LoadBucket(version=version, bucket=bucket, handles=handles)
        reply = await self._link.load(self._rank, request, adapter=self.adapter.name)
        return _reply_of(reply, self._name, BucketAck)

    async def commit_update(self, version: int, buckets: int) -> None:
        reply = await self._link.commit(self._rank, version, buckets, adapter=self.adapter.name)
        _reply_of(reply, self._name, Done)

    async def abort_update(self, version: int) -> None:
        try:
            await self._link.abort(self._rank, version, adapter=self.adapter.name)
        except Exception as exc:
            raise self._link.translate(exc, self._rank) from exc

    async def weight_version(self) -> int | None:
        """The adapter's version this rank serves (``None``: none)."""
        reply = await self._link.serve(self._rank, self._for_adapter(GetVersion()))
        return _reply_of(reply, self._name, VersionReply).version

    async def release_handles(self) -> None:
        reply = await self._link.serve(self._rank, self._for_adapter(ReleaseHandles()))
        _reply_of(reply, self._name, Done)


@asynccontextmanager
async def _connected(link: _EngineLink) -> AsyncIterator[list[VLLMWorker]]:
    try:
        await link.open()
        yield [VLLMWorker(link, rank) for rank in range(link.world)]
    finally:
        await link.aclose()


@asynccontextmanager
async def connect_async_llm(
    engine: Any,
    *,
    pause_mode: PauseMode = "keep",
    name: str = "vllm",
    rpc_timeout: float = 60.0,
    cleanup_timeout: float = CLEANUP_TIMEOUT,
) -> AsyncIterator[list[VLLMWorker]]:
    """Connect to a running ``vllm.AsyncLLM``; yields one :class:`VLLMWorker` per rank.

    Enter it on the event loop that owns ``engine`` (the loop it was created on):
    every engine call is awaited there, and a call from another loop or thread raises
    :class:`EngineLoopError`. The engine must have been started with
    :func:`engine_args` (else :class:`EngineConfigError`).

    Generation may go on during pushes: each push pauses it with
    ``pause_generation(mode=pause_mode)`` — ``"abort"`` ends requests in flight,
    ``"wait"`` lets them finish first (the coordinator's timeout then bounds how
    long), ``"keep"`` freezes them and continues them on the new weights — and
    resumes it when the push ends, also when it fails.

    No KV computed with older weights is used after a push: the pause clears the
    prefix cache, and once the new weights are in (or a failed push wrote some bytes)
    the prefix cache is reset again before generation resumes, together with the
    engine's weight version. Requests frozen by ``"keep"`` are preempted by that
    reset: they keep the tokens generated so far and recompute their KV on the new
    weights. (There is no way to keep the cache: it would serve tokens of the old
    weights.) If vLLM cannot reset its cache, the push fails and the engine's weight
    version becomes ``"stale-cache"``.

    Resource handling: entering opens one Unix socket that every rank connects to;
    exiting ends any open update session, resumes generation, asks the workers to
    close their channels and handle mappings (the extension's ``asyncrefit_shutdown`` RPC),
    and removes the socket, shielded from cancellation. It does not shut the engine
    down.

    Cleanup is bounded per engine call: an abort (which the coordinator sends after a
    failed or cancelled push) and exiting wait at most ``cleanup_timeout`` for each of
    the abort exchange, vLLM's ``finish_weight_update``, the relabelling and
    ``resume_generation``, and run to their end even when the coordinator's own
    ``cleanup_timeout`` (or a cancellation) cuts its wait short: generation is resumed
    on every path. The engine runs its calls in order, so a call that timed out still
    comes before those after it. A resume that fails is retried by the next abort and
    on exit; a commit whose resume fails fails the push (its weights are in).

    Error handling: :class:`EngineConfigError` and :class:`EngineLoopError` before
    anything is sent; :class:`~asyncrefit.WorkerTimeoutError` if the workers do not
    connect within ``rpc_timeout``; vLLM's own errors as
    :class:`~asyncrefit.WorkerRemoteError` (a dead engine:
    :class:`~asyncrefit.WorkerDiedError`). See :class:`VLLMWorker` for pushes.
    """
    link = _EngineLink(_AsyncLLMOps(engine, pause_mode), name, rpc_timeout, cleanup_timeout)
    async with _connected(link) as workers:
        yield workers


@asynccontextmanager
async def connect_llm(
    llm: Any,
    *,
    name: str = "vllm",
    rpc_timeout: float = 60.0,
    cleanup_timeout: float = CLEANUP_TIMEOUT,
) -> AsyncIterator[list[VLLMWorker]]:
    """Connect to a ``vllm.LLM``; yields one :class:`VLLMWorker` per rank.

    ``LLM`` is synchronous: each of its calls runs in a worker thread, one at a time,
    so the coordinator's loop keeps running; each is bounded by ``rpc_timeout``. Do not
    call ``llm.generate`` from another thread during a push: nothing pauses it. The
    engine must have been started with :func:`engine_args`. Once the new weights are
    in (or a failed push wrote some), the prefix cache is reset, so that the next
    ``generate`` computes no token from KV of older weights.

    Resource handling and error handling: as :func:`connect_async_llm`.
    """
    link = _EngineLink(_LLMOps(llm, rpc_timeout), name, rpc_timeout, cleanup_timeout)
    async with _connected(link) as workers:
        yield workers


def engine_args() -> dict[str, Any]:
    """The engine arguments asyncrefit needs, for ``vllm.LLM(...)`` or ``AsyncEngineArgs``.

    ``worker_extension_cls`` makes vLLM load :mod:`asyncrefit.vllm.worker` into every
    worker (which registers the weight-transfer backend), ``weight_transfer_config``
    selects that backend.
    """
    return {"worker_extension_cls": EXTENSION, "weight_transfer_config": {"backend": BACKEND}}
