"""The worker process of the local backend: its own event loop, a module, a receiver.

The refit requests are served by the receiver (an :class:`~asyncrefit._worker._endpoint.Endpoint`
over the module's parameters); the server adds what only a local worker does: copies
in a thread, fault injection, diagnostics (digests, a forward pass) and shutdown. The
connection is served by the one serve loop (:mod:`asyncrefit._wire._serve`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio

from .._device import DeviceId
from .._loop import backend_options
from .._wire._channel import connect_unix
from .._wire._errors import error_reply
from .._wire._messages import (
    CommitUpdate,
    DeviceReply,
    Digest,
    DigestReply,
    Done,
    Forward,
    ForwardReply,
    LoadBucket,
    Reply,
    ReportDevice,
    Request,
    Shutdown,
)
from .._wire._refs import RefDecoder
from .._wire._serve import serve
from .._worker._receiver import ParameterReceiver
from ._faults import WorkerFaults

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: How long a reply may take to be sent before the coordinator counts as gone.
_SEND_TIMEOUT = 60.0


class WorkerServer:
    """Serves one coordinator connection, one request at a time, in order.

    Handling requests strictly in order is what makes an abort's answer mean "no view
    of any buffer is held": it is sent after any load that was still running.
    """

    def __init__(
        self, module: torch.nn.Module, receiver: ParameterReceiver, faults: WorkerFaults
    ) -> None:
        self._module = module
        self._receiver = receiver
        self._faults = faults
        self._limiter = anyio.CapacityLimiter(1)

    async def report_device_id_async(self) -> DeviceId:
        """The device this worker's parameters live on; runs on this process's loop."""
        await anyio.lowlevel.checkpoint()
        return self._receiver.device

    async def serve(self, path: str) -> None:
        """Serve the coordinator at ``path`` until it asks to shut down or goes away."""
        channel = connect_unix(path)
        refs = RefDecoder()  # this connection's handles by reference
        try:
            await serve(
                channel,
                refs,
                self.handle,
                until=lambda request: isinstance(request, Shutdown),
                send_timeout=_SEND_TIMEOUT,
            )
        finally:
            self._receiver.close()
            await channel.aclose()

    async def _load(self, request: LoadBucket) -> Reply:
        if self._faults.crash_at_bucket == request.bucket:
            os._exit(17)
        if self._faults.hang_at_bucket == request.bucket:
            await anyio.sleep_forever()
        if self._faults.load_delay:
            await anyio.sleep(self._faults.load_delay)
        if self._faults.kill_at_bucket == request.bucket:
            return await anyio.to_thread.run_sync(self._killed_mid_copy, request)
        if self._faults.gpu_delay_cycles:
            return await anyio.to_thread.run_sync(
                self._late_on_the_gpu, request, limiter=self._limiter
            )
        # On this loop: it serves nothing else while a request is handled (requests are
        # taken one at a time, in order), and a thread's hand-off would cost more CPU
        # than a small bucket's copy.
        return self._receiver.handle(request)

    def _killed_mid_copy(self, request: LoadBucket) -> Reply:
        """Copy the bucket's first tensor, then die by SIGKILL (fault injection)."""
        first = request.handles[0]
        partial = replace(first, entries=first.entries[:1])
        self._receiver.load(request.version, request.bucket, (partial,))
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    def _late_on_the_gpu(self, request: LoadBucket) -> Reply:
        """Make the stream spin before the copies, then load (fault injection)."""
        import torch

        from .._cuda import cuda_index

        handle = self._receiver.own_handle(request.handles)
        index = cuda_index(handle.device.device)  # the slot's GPU: the copies run there
        cuda: Any = torch.cuda
        with torch.cuda.device(index):
            cuda._sleep(self._faults.gpu_delay_cycles)
        return self._receiver.handle(request)

    def _forward(self, inputs: Any) -> Any:
        import torch

        with torch.no_grad():
            return self._module(inputs)

    async def handle(self, request: Request) -> Reply:
        r = self._receiver
        try:
            match request:
                case ReportDevice():
                    return DeviceReply(device=await self.report_device_id_async())
                case LoadBucket():
                    return await self._load(request)
                case Digest():
                    return DigestReply(
                        digests=await anyio.to_thread.run_sync(r.digests, limiter=self._limiter)
                    )
                case Forward(inputs=x):
                    out = await anyio.to_thread.run_sync(self._forward, x, limiter=self._limiter)
                    return ForwardReply(output=out)
                case Shutdown():
                    r.close()
                    return Done()
                case CommitUpdate() if r.commit_waits:
                    # It waits for the trainer's GPU writes: off the loop.
                    return await anyio.to_thread.run_sync(r.handle, request, limiter=self._limiter)
        except Exception as exc:
            logger.debug("request %r failed", request, exc_info=True)
            return error_reply(exc)
        return r.handle(request)


def worker_main(
    path: str,
    factory: Callable[[], torch.nn.Module],
    device: DeviceId,
    threads: int,
    faults: WorkerFaults,
    shared: bool = False,
) -> None:
    """Entry point of a local worker process (spawned, so it starts clean)."""
    import torch

    torch.set_num_threads(threads)
    module = factory()
    module.eval()
    receiver = ParameterReceiver(dict(module.named_parameters()), device, shared=shared)
    server = WorkerServer(module, receiver, faults)
    anyio.run(server.serve, path, backend="asyncio", backend_options=backend_options())
