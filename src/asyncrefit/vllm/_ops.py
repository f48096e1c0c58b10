"""The engine-wide calls of a vLLM engine, for the two kinds of engine asyncrefit drives.

Owns :class:`_EngineOps` (what :class:`~asyncrefit.vllm._link._EngineLink` may ask of an
engine: the trigger RPCs, vLLM's weight-update session, pausing, the prefix cache, the
weight version), its two implementations (:class:`_AsyncLLMOps` for ``vllm.AsyncLLM``,
:class:`_LLMOps` for ``vllm.LLM``) and :class:`EngineLoopError`.

Where vLLM releases differ (the weight-version label), the calls ask
:mod:`._compat`. Errors: each call raises what vLLM raised (the link translates it into a
:class:`~asyncrefit.WorkerError`); :func:`_check_reset` turns vLLM's "could not reset" answer
into a ``RuntimeError``. ``AsyncLLM`` calls refuse to run off the engine's own loop
(:class:`EngineLoopError`). Resources: none of their own; an ``LLM``'s blocking calls
run one at a time in a worker thread, each bounded by the RPC timeout, so cancelling the
caller's wait never leaves a call running unbounded behind its back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

import anyio

from .._exceptions import EngineLoopError
from ._compat import features
from ._wire import SERVE_METHOD, SHUTDOWN_METHOD

R = TypeVar("R")

PauseMode = Literal["abort", "wait", "keep"]
_PAUSE_MODES = ("abort", "wait", "keep")


# --- the two kinds of engine -------------------------------------------------------


class _EngineOps(Protocol):
    """The engine-wide calls the link makes; each runs where the engine needs it."""

    vllm_config: Any

    async def serve(self, request_id: int) -> None: ...

    async def update(self, request_id: int) -> None: ...

    async def start(self) -> None: ...

    async def finish(self, label: str | None) -> None: ...

    async def set_label(self, label: str) -> None: ...

    async def init(self, channel: str, read_timeout: float) -> None: ...

    async def shutdown(self) -> None: ...

    async def pause(self) -> None: ...

    async def reset_cache(self) -> None: ...

    async def resume(self) -> None: ...


def _check_reset(done: object) -> None:
    """vLLM answers a prefix-cache reset with whether it succeeded (``None`` where an
    older release returned nothing)."""
    if done is False:
        raise RuntimeError("vLLM could not reset its prefix cache")


class _AsyncLLMOps:
    """An ``AsyncLLM``: every call is awaited on the loop that owns the engine."""

    def __init__(self, engine: Any, pause_mode: PauseMode) -> None:
        if pause_mode not in _PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {_PAUSE_MODES}, got {pause_mode!r}")
        self._engine = engine
        self.vllm_config = engine.vllm_config
        self._mode = pause_mode
        handler = getattr(engine, "output_handler", None)
        # The engine's output handler task runs on the loop that owns it; an engine
        # made outside a loop binds to the first loop that uses it: this one.
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            raise EngineLoopError("an AsyncLLM is driven from an asyncio event loop") from None
        self._loop = handler.get_loop() if isinstance(handler, asyncio.Task) else current
        self._check()

    def _check(self) -> None:
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is not self._loop:
            raise EngineLoopError(
                "this AsyncLLM belongs to another event loop: await asyncrefit's calls on "
                "the loop that created the engine (not from another thread or loop)"
            )

    async def serve(self, request_id: int) -> None:
        self._check()
        await self._engine.collective_rpc(SERVE_METHOD, args=(request_id,))

    async def update(self, request_id: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._check()
        await self._engine.update_weights(
            WeightTransferUpdateRequest(update_info={"request_id": request_id})
        )

    async def start(self) -> None:
        self._check()
        await self._engine.start_weight_update()

    async def finish(self, label: str | None) -> None:
        self._check()
        if features().weight_versions:
            await self._engine.finish_weight_update(weight_version=label)
        else:  # vLLM 0.26: no label to set
            await self._engine.finish_weight_update()

    async def set_label(self, label: str) -> None:
        self._check()
        if features().weight_versions:
            await self._engine.update_weight_version(label)

    async def init(self, channel: str, read_timeout: float) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._check()
        await self._engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info={"channel": channel, "timeout": read_timeout})
        )

    async def shutdown(self) -> None:
        self._check()
        await self._engine.collective_rpc(SHUTDOWN_METHOD)

    async def pause(self) -> None:
        self._check()
        # clear_cache: the prefix cache holds KV computed with the weights being
        # replaced, and requests frozen by "keep" are preempted, to be recomputed.
        await self._engine.pause_generation(mode=self._mode, clear_cache=True)

    async def reset_cache(self) -> None:
        self._check()
        _check_reset(await self._engine.reset_prefix_cache(reset_running_requests=True))

    async def resume(self) -> None:
        self._check()
        await self._engine.resume_generation()


class _LLMOps:
    """A synchronous ``LLM``: every call blocks, so it runs in a worker thread, one at a
    time (``LLM`` is not thread-safe), bounded by ``timeout`` so that cancelling the
    coordinator's wait never leaves a call running behind its back."""

    def __init__(self, llm: Any, timeout: float) -> None:
        self._llm = llm
        self.vllm_config = llm.llm_engine.vllm_config
        self._timeout = timeout
        self._limiter = anyio.CapacityLimiter(1)

    async def _run(self, fn: Callable[[], R]) -> R:
        return await anyio.to_thread.run_sync(fn, limiter=self._limiter)

    async def _rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> None:
        llm, timeout = self._llm, self._timeout
        await self._run(lambda: llm.collective_rpc(method, timeout, args, kwargs))

    async def serve(self, request_id: int) -> None:
        await self._rpc(SERVE_METHOD, args=(request_id,))

    async def update(self, request_id: int) -> None:
        await self._rpc("update_weights", kwargs={"update_info": {"request_id": request_id}})

    async def start(self) -> None:
        await self._rpc("start_weight_update")

    async def finish(self, label: str | None) -> None:
        await self._rpc("finish_weight_update")
        if label is not None:
            await self.set_label(label)

    async def set_label(self, label: str) -> None:
        if features().weight_versions:
            engine = self._llm.llm_engine
            await self._run(lambda: engine.set_weight_version(label))

    async def init(self, channel: str, read_timeout: float) -> None:
        init_info = {"channel": channel, "timeout": read_timeout}
        await self._rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    async def shutdown(self) -> None:
        await self._rpc(SHUTDOWN_METHOD)

    async def pause(self) -> None:
        pass  # an LLM generates only inside its own blocking calls: nothing to pause

    async def reset_cache(self) -> None:
        llm = self._llm
        _check_reset(await self._run(lambda: llm.reset_prefix_cache(reset_running_requests=True)))

    async def resume(self) -> None:
        pass
