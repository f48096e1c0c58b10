"""In-process workers that record what they are sent, for coordinator tests.

A :class:`FakeWorker` copies for real (through a :class:`ParameterReceiver` over the
trainer's own shared memory) so bitwise results can be checked, and it records every
call, every handle and the serialized size of every load request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar

import anyio
import torch

from asyncrefit import DeviceId, ParameterReceiver, ParamSpec, WorkerDiedError, cpu_device
from asyncrefit._wire._messages import LoadBucket, encoded_size
from asyncrefit.abc import BucketAck
from asyncrefit.transport import Handle, Importer
from asyncrefit.transport.destinations import Destinations


@dataclass
class Faults:
    """What a fake worker does wrong, and when."""

    fail_at_bucket: int | None = None  # raise RuntimeError
    die_at_bucket: int | None = None  # raise WorkerDiedError (as a dead process would)
    hang_at_bucket: int | None = None  # never answer that load, nor anything after it
    delay: float = 0.0  # sleep holding a view of the buffer before copying
    # Copy bucket ``read_late_at`` in a thread that first sleeps ``read_late`` seconds
    # and that cancelling the call does not stop: a reader the coordinator cannot halt.
    read_late_at: int | None = None
    read_late: float = 0.0
    bad_device: DeviceId | None = None
    fail_at_begin: bool = False  # raise RuntimeError from begin_direct
    fail_at_commit: bool = False  # raise RuntimeError from commit_update
    hang_at_commit: bool = False  # never answer commit_update


@dataclass
class FakeWorker:
    """A worker whose parameters are plain tensors in this process."""

    name: str
    device: DeviceId
    parameters: dict[str, torch.Tensor]
    faults: Faults = field(default_factory=Faults)
    calls: list[tuple[str, int]] = field(default_factory=list)
    handles: list[tuple[Handle, ...]] = field(default_factory=list)
    load_bytes: list[int] = field(default_factory=list)
    device_queries: int = 0
    dead: bool = False
    hung: bool = False
    importers: dict[str, Importer] | None = None
    whole: bool = False  # declares its parameters whole only (no parts), as vLLM does

    def __post_init__(self) -> None:
        self.receiver = ParameterReceiver(self.parameters, self.device, importers=self.importers)
        self.reading = threading.Event()  # set while no late reader runs
        self.reading.set()

    @classmethod
    def like(
        cls,
        name: str,
        device: DeviceId,
        module: torch.nn.Module,
        faults: Faults | None = None,
        *,
        whole: bool = False,
    ) -> FakeWorker:
        """A worker holding zeroed copies of ``module``'s parameters."""
        params = {n: torch.zeros_like(p.detach()) for n, p in module.named_parameters()}
        return cls(
            name=name, device=device, parameters=params, faults=faults or Faults(), whole=whole
        )

    async def _check_alive(self) -> None:
        if self.hung:
            await anyio.sleep_forever()
        if self.dead:
            raise WorkerDiedError(self.name, "dead")

    async def report_device_id_async(self) -> DeviceId:
        await anyio.lowlevel.checkpoint()
        self.device_queries += 1
        return self.faults.bad_device or self.device

    async def parameter_specs(self) -> Sequence[ParamSpec]:
        await anyio.lowlevel.checkpoint()
        specs = self.receiver.specs()
        if self.whole:
            return tuple(replace(s, parts=False) for s in specs)
        return specs

    async def begin_update(self, version: int) -> None:
        await anyio.lowlevel.checkpoint()
        await self._check_alive()
        self.calls.append(("begin", version))
        self.receiver.begin(version)

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        await self._check_alive()
        self.calls.append(("load", version))
        self.handles.append(handles)
        self.load_bytes.append(
            encoded_size(LoadBucket(version=version, bucket=bucket, handles=handles))
        )
        f = self.faults
        if f.die_at_bucket == bucket:
            self.dead = True
            raise WorkerDiedError(self.name, f"died at bucket {bucket}")
        if f.fail_at_bucket == bucket:
            raise RuntimeError(f"injected failure at bucket {bucket}")
        if f.hang_at_bucket == bucket:
            self.hung = True
            await anyio.sleep_forever()
        if f.delay:
            await anyio.sleep(f.delay)
        if f.read_late_at == bucket:
            self.reading.clear()

            def late() -> BucketAck:
                try:
                    time.sleep(f.read_late)
                    return self.receiver.load(version, bucket, handles)
                finally:
                    self.reading.set()

            return await anyio.to_thread.run_sync(late, abandon_on_cancel=True)
        return self.receiver.load(version, bucket, handles)

    async def commit_update(self, version: int, buckets: int) -> None:
        await anyio.lowlevel.checkpoint()
        await self._check_alive()
        self.calls.append(("commit", version))
        if self.faults.fail_at_commit:
            raise RuntimeError("injected failure at commit")
        if self.faults.hang_at_commit:
            await anyio.sleep_forever()
        self.receiver.commit(version, buckets)

    async def abort_update(self, version: int) -> None:
        await anyio.lowlevel.checkpoint()
        await self._check_alive()
        # Honest: confirm only once no thread of ours reads any buffer.
        await anyio.to_thread.run_sync(self.reading.wait, abandon_on_cancel=True)
        self.calls.append(("abort", version))
        self.receiver.abort(version)

    async def weight_version(self) -> int | None:
        await anyio.lowlevel.checkpoint()
        return self.receiver.version

    async def release_handles(self) -> None:
        await anyio.lowlevel.checkpoint()
        await self._check_alive()
        self.calls.append(("release", 0))
        self.receiver.release_handles()

    def equals(self, module: torch.nn.Module) -> bool:
        """Bitwise equality with ``module``'s parameters."""
        return all(
            torch.equal(self.parameters[n].view(torch.uint8), p.detach().view(torch.uint8))
            for n, p in module.named_parameters()
        )


@dataclass
class PlainDirectFakeWorker(FakeWorker):
    """A :class:`FakeWorker` whose parameters live in a shared-memory segment it exports
    (a :class:`~asyncrefit.abc.DirectWorker`): the trainer writes them directly. It
    cannot take a begin back (see :class:`DirectFakeWorker`).

    ``tamper`` rewrites the destinations it reports (a hostile or broken worker).
    Call :meth:`close` at the end: it unlinks a segment that no trainer opened.
    """

    tamper: Callable[[Destinations], Destinations] | None = None

    def __post_init__(self) -> None:
        self.receiver = ParameterReceiver(self.parameters, self.device, shared=True)
        self.reading = threading.Event()
        self.reading.set()

    async def destinations(self) -> Destinations | None:
        await anyio.lowlevel.checkpoint()
        await self._check_alive()
        self.calls.append(("destinations", 0))
        found = self.receiver.destinations()
        if found is not None and self.tamper is not None:
            return self.tamper(found)
        return found

    async def begin_direct(self, version: int) -> None:
        await anyio.lowlevel.checkpoint()
        await self._check_alive()
        self.calls.append(("begin_direct", version))
        if self.faults.fail_at_begin:
            raise RuntimeError("injected failure at begin")
        self.receiver.begin_direct(version)

    def close(self) -> None:
        self.receiver.close()


@dataclass
class DirectFakeWorker(PlainDirectFakeWorker):
    """A :class:`PlainDirectFakeWorker` that can take a begin back before any write
    (a :class:`~asyncrefit.abc.RestoringWorker`, as local workers and vLLM ranks are)."""

    async def abort_unwritten(self, version: int) -> None:
        await anyio.lowlevel.checkpoint()
        await self._check_alive()
        self.calls.append(("abort_unwritten", version))
        self.receiver.abort_unwritten(version)


W = TypeVar("W", bound=PlainDirectFakeWorker)


@contextmanager
def direct_workers(kind: type[W], model: torch.nn.Module, count: int) -> Iterator[list[W]]:
    """``count`` direct workers of ``kind`` (``w<i>`` on ``cpu:<i>``) holding zeroed copies
    of ``model``'s parameters; closed at the end."""
    workers = [
        kind(
            name=f"w{i}",
            device=cpu_device(i),
            parameters={n: torch.zeros_like(p.detach()) for n, p in model.named_parameters()},
        )
        for i in range(count)
    ]
    try:
        yield workers
    finally:
        for w in workers:
            w.close()
