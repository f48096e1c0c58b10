"""The coordinator's side of a local worker process, and the pool that starts them."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from .._core._plan import ParamSpec
from .._device import DeviceId, cpu_device
from .._exceptions import (
    WorkerDiedError,
    WorkerProtocolError,
    WorkerRemoteError,
    WorkerTimeoutError,
    one_error,
)
from .._wire._channel import FrameChannel, UnixListener
from .._wire._errors import WORKER, Lost, map_wire, raise_for_error
from .._wire._messages import (
    AbortUpdate,
    BeginUpdate,
    BucketAck,
    CommitUpdate,
    DestinationsReply,
    DeviceReply,
    Digest,
    DigestReply,
    Done,
    Forward,
    ForwardReply,
    GetDestinations,
    GetSpecs,
    GetVersion,
    LoadBucket,
    ReleaseHandles,
    Reply,
    ReportDevice,
    Request,
    Shutdown,
    SpecsReply,
    VersionReply,
)
from .._wire._mux import RequestChannel
from ..transport.destinations import Destinations, unlink_segments
from ._faults import WorkerFaults
from ._server import worker_main

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import torch

    from ..transport._base import Handle

R = TypeVar("R")

_SEND_TIMEOUT = 30.0
_REAP_TIMEOUT = 10.0


class LocalWorker:
    """A worker subprocess with its own event loop, holding a real ``torch.nn.Module``.

    Implements :class:`asyncrefit.abc.Worker`. Each call sends one request over a Unix
    socket and awaits the reply; calls may overlap (the coordinator sends the next
    bucket's notification while the last one is being loaded), and the worker handles
    requests one at a time, in the order they were sent.

    Resource handling: :meth:`aclose` asks the process to exit, then terminates and
    reaps it if it does not. A call cancelled while waiting for its reply leaves the
    connection usable: the late reply is recognised by its request id and dropped.

    Error handling: a closed connection (the process died) raises
    :class:`WorkerDiedError`, after the process was killed and reaped, so a worker
    reported dead no longer reads any buffer; an error inside the worker raises
    :class:`WorkerRemoteError` with its type and message.
    """

    def __init__(
        self, name: str, process: BaseProcess, channel: FrameChannel, device: DeviceId
    ) -> None:
        self._name = name
        self._process = process
        self._channel = channel
        self._device = device
        self._requests = RequestChannel(channel, send_timeout=_SEND_TIMEOUT)
        self._dead: str | None = None
        self._exported: list[Destinations] = []  # what the process exported (its segments)

    def __repr__(self) -> str:
        state = f"dead ({self._dead})" if self._dead else "alive"
        return f"<LocalWorker {self._name!r} pid={self._process.pid} {self._device} {state}>"

    @property
    def name(self) -> str:
        return self._name

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    # --- transport -------------------------------------------------------------------

    async def _request(self, request: Request) -> Reply:
        if self._dead is not None:
            raise WorkerDiedError(self._name, self._dead)
        async with map_wire(WORKER, self._name, self._lost):
            reply = raise_for_error(await self._requests.request(request))
        assert isinstance(reply, Reply)
        return reply

    async def _lost(self, how: Lost, exc: BaseException) -> tuple[Lost, str]:
        """The connection failed: kill and reap the process, say how it was lost."""
        if how is Lost.TIMEOUT:
            await self._mark_dead("sending a request timed out")
            return how, "sending a request timed out"
        await self._mark_dead("the worker process closed its connection")
        assert self._dead is not None
        return how, self._dead

    async def _expect(self, request: Request, kind: type[R]) -> R:
        reply = await self._request(request)
        if not isinstance(reply, kind):
            raise WorkerProtocolError(
                self._name, f"expected {kind.__name__}, got {type(reply).__name__}"
            )
        return reply

    async def _mark_dead(self, why: str) -> None:
        """Kill and reap the process: once this returns, it reads no buffer any more."""
        with anyio.CancelScope(shield=True):
            await self._requests.aclose()
            if self._process.is_alive():
                self._process.kill()
            await anyio.to_thread.run_sync(self._process.join, _REAP_TIMEOUT)
            self._unlink_exported()
        self._dead = f"{why} (exit code {self._process.exitcode})"

    def _unlink_exported(self) -> None:
        """The process is gone: unlink the segments it exported (it cannot any more)."""
        if self._process.is_alive():
            return
        for found in self._exported:
            unlink_segments(found)
        self._exported.clear()

    # --- the Worker protocol ----------------------------------------------------------

    async def report_device_id_async(self) -> DeviceId:
        """Asks the worker process, whose own loop answers."""
        return (await self._expect(ReportDevice(), DeviceReply)).device

    async def parameter_specs(self) -> Sequence[ParamSpec]:
        return (await self._expect(GetSpecs(), SpecsReply)).specs

    async def begin_update(self, version: int) -> None:
        await self._expect(BeginUpdate(version=version), Done)

    async def destinations(self) -> Destinations | None:
        """The worker's exported parameters (with ``shared_parameters=True``), or ``None``.

        Their segment is unlinked here once the process is reaped, if it died.
        """
        found = (await self._expect(GetDestinations(), DestinationsReply)).destinations
        if found is not None:
            self._exported.append(found)
        return found

    async def begin_direct(self, version: int) -> None:
        await self._expect(BeginUpdate(version=version, direct=True), Done)

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        return await self._expect(
            LoadBucket(version=version, bucket=bucket, handles=handles), BucketAck
        )

    async def commit_update(self, version: int, buckets: int) -> None:
        await self._expect(CommitUpdate(version=version, buckets=buckets), Done)

    async def abort_update(self, version: int) -> None:
        await self._expect(AbortUpdate(version=version), Done)

    async def abort_unwritten(self, version: int) -> None:
        """Abort ``version``, begun direct, before the trainer wrote any byte of it: the
        worker holds the version it held before the begin again."""
        await self._expect(AbortUpdate(version=version, unwritten=True), Done)

    async def weight_version(self) -> int | None:
        return (await self._expect(GetVersion(), VersionReply)).version

    async def release_handles(self) -> None:
        await self._expect(ReleaseHandles(), Done)

    # --- diagnostics --------------------------------------------------------------------

    async def parameter_digests(self) -> dict[str, str]:
        """A digest of each parameter's bytes, computed in the worker process."""
        return (await self._expect(Digest(), DigestReply)).digests

    async def forward(self, inputs: Any) -> Any:
        """Run the worker's module on ``inputs`` (pickled both ways): for verification."""
        return (await self._expect(Forward(inputs=inputs), ForwardReply)).output

    # --- lifecycle --------------------------------------------------------------------

    async def kill(self) -> None:
        """Kill the process now (SIGKILL) and reap it."""
        await self._mark_dead("killed")

    async def aclose(self) -> None:
        """Ask the process to exit; terminate it after a grace period. Idempotent."""
        with anyio.CancelScope(shield=True):
            if self._dead is None:
                with anyio.move_on_after(5):
                    try:
                        await self._request(Shutdown())
                    except (WorkerDiedError, WorkerRemoteError, WorkerTimeoutError):
                        pass
                await self._requests.aclose()
            await anyio.to_thread.run_sync(self._process.join, 5)
            if self._process.is_alive():
                self._process.terminate()
                await anyio.to_thread.run_sync(self._process.join, 5)
            if self._process.is_alive():
                self._process.kill()
                await anyio.to_thread.run_sync(self._process.join, _REAP_TIMEOUT)
            self._unlink_exported()  # a graceful exit unlinked them already
            if self._dead is None:
                self._dead = "closed"


#: The ``-W`` option that silences torch's warning of a missing numpy.
_NUMPY_WARNING = "ignore:Failed to initialize NumPy:UserWarning"


def _quiet_numpy_in_children() -> None:
    """Where numpy is not installed, spawned workers do not warn that it is missing.

    numpy is not a dependency of asyncrefit, but torch warns of its absence when it is
    imported, once in every worker process. A spawned process gets the parent's ``-W``
    options (``sys.warnoptions``), and applies them before it imports anything: this
    adds one for that warning alone, once, and only where numpy cannot be imported.
    """
    if _NUMPY_WARNING in sys.warnoptions:
        return
    try:
        missing = importlib.util.find_spec("numpy") is None
    except ImportError:  # an import hook that refuses numpy outright
        missing = True
    if missing:
        sys.warnoptions.append(_NUMPY_WARNING)


async def _start_worker(
    name: str,
    path: str,
    factory: Callable[[], torch.nn.Module],
    device: DeviceId,
    threads: int,
    faults: WorkerFaults,
    start_timeout: float,
    shared: bool = False,
) -> LocalWorker:
    context = multiprocessing.get_context("spawn")
    _quiet_numpy_in_children()
    listener = UnixListener(path)
    process = context.Process(
        target=worker_main,
        args=(path, factory, device, threads, faults, shared),
        name=f"asyncrefit-{name}",
        daemon=True,
    )
    try:
        await anyio.to_thread.run_sync(process.start)
        with anyio.fail_after(start_timeout):
            while True:
                with anyio.move_on_after(0.25):
                    channel = await listener.accept()
                    break
                if not process.is_alive():
                    raise WorkerDiedError(
                        name, f"exited during start-up (exit code {process.exitcode})"
                    )
    except BaseException:
        with anyio.CancelScope(shield=True):
            if process.is_alive():
                process.kill()
            if process.pid is not None:
                await anyio.to_thread.run_sync(process.join, _REAP_TIMEOUT)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return LocalWorker(name, process, channel, device)


@asynccontextmanager
async def spawn_local_workers(
    factory: Callable[[], torch.nn.Module],
    count: int = 2,
    *,
    devices: Sequence[DeviceId | str] | None = None,
    names: Sequence[str] | None = None,
    threads: int = 1,
    faults: dict[str, WorkerFaults] | None = None,
    start_timeout: float = 120.0,
    shared_parameters: bool = False,
) -> AsyncIterator[list[LocalWorker]]:
    """Start ``count`` local worker processes, each building its module with ``factory``.

    ``factory`` must be picklable (a module-level function): processes are spawned,
    not forked. Worker ``i`` is named ``names[i]`` (default ``"worker-i"``) and sits on
    ``devices[i]`` (default the virtual CPU device ``cpu:i``: one device each); give
    several workers one device to model many consumers of one device. Workers start
    concurrently.

    ``shared_parameters=True``: each worker moves its parameters into one region it
    allocates and exports (a ``/dev/shm`` segment on the CPU, a CUDA IPC allocation on
    a GPU), so a trainer on this node writes them directly, with no staging copy and
    two messages per worker per push (see :class:`~asyncrefit.abc.DirectWorker`).

    (``faults`` is deprecated: fault injection is for the project's own tests, in
    ``asyncrefit.local._faults``.)

    Resource handling: on exit every process is shut down and reaped, also when the
    body raised or was cancelled; if start-up fails, the workers already started are
    shut down before the error propagates.
    """
    if faults is not None:
        warnings.warn(
            "spawn_local_workers(faults=...) is deprecated: fault injection is test-only "
            "(asyncrefit.local._faults.spawn_with_faults); it goes in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
    async with spawn_with_faults(
        factory,
        count,
        devices=devices,
        names=names,
        threads=threads,
        faults=faults,
        start_timeout=start_timeout,
        shared_parameters=shared_parameters,
    ) as workers:
        yield workers


@asynccontextmanager
async def spawn_with_faults(
    factory: Callable[[], torch.nn.Module],
    count: int = 2,
    *,
    devices: Sequence[DeviceId | str] | None = None,
    names: Sequence[str] | None = None,
    threads: int = 1,
    faults: dict[str, WorkerFaults] | None = None,
    start_timeout: float = 120.0,
    shared_parameters: bool = False,
) -> AsyncIterator[list[LocalWorker]]:
    """:func:`spawn_local_workers`, with ``faults`` (worker name to faults) injected."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    worker_names = list(names) if names is not None else [f"worker-{i}" for i in range(count)]
    worker_devices = [
        d if isinstance(d, DeviceId) else cpu_device(d)
        for d in (devices if devices is not None else range(count))
    ]
    if len(worker_names) != count or len(worker_devices) != count:
        raise ValueError("names and devices must have one entry per worker")
    tmpdir = tempfile.mkdtemp(prefix="asyncrefit-")
    workers: list[LocalWorker | None] = [None] * count

    async def start(i: int) -> None:
        workers[i] = await _start_worker(
            worker_names[i],
            os.path.join(tmpdir, f"w{i}.sock"),
            factory,
            worker_devices[i],
            threads,
            (faults or {}).get(worker_names[i], WorkerFaults()),
            start_timeout,
            shared_parameters,
        )

    try:
        with one_error():
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(start, i)
        yield [w for w in workers if w is not None]
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for w in workers:
                    if w is not None:
                        tg.start_soon(w.aclose)
        shutil.rmtree(tmpdir, ignore_errors=True)
