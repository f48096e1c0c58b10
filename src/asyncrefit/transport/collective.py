"""The collective transport: buckets broadcast over a dedicated ``torch.distributed`` group.

For workers that share no memory with the trainer (another node, another GPU). The
trainer side, :class:`asyncrefit.trainer.CollectiveTrainer`, packs each bucket into
one of its own staging slots (plain CPU tensors for gloo, CUDA tensors for NCCL) and,
while the workers load the bucket, broadcasts the slot from rank 0 of a *stateless* process group: a
``TCPStore`` the trainer hosts, and a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` built
on a ``PrefixStore`` of it. Neither ``init_process_group`` nor any default group (the
trainer's, vLLM's) is touched.

Each worker is sent only its own :class:`CollectiveHandle`: the store's address, the
group's generation, the world size and the worker's own rank. Its
:class:`CollectiveImporter` joins the group on the first handle of a generation,
receives the broadcast into a buffer of its own, and returns it for the copy into the
parameters; the ack then means what it means for every transport.

The group is formed lazily by both sides (the root in its first broadcast, each worker
in its first ``open``) and re-formed with a new generation when the set of receiving
devices changes or after any failure: a failed or cancelled push leaves the group in an
unknown state, so the next push starts a fresh one (remove a dead worker with
``RefitCoordinator.remove_worker`` first).

The NCCL backend takes the same code path with CUDA buffers, each on an explicit GPU:
the trainer's (``CollectiveTrainer(device=...)``) and, on a worker, the one its handle
names by UUID; never the current device of a transport thread (``cuda:0`` in a fresh
thread). A broadcast needs two GPUs; ``tests/test_collective_devices.py`` has the GPU
tests, and the multi-GPU issue (8) exercises it further.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import secrets
import socket
import threading
import traceback
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .._cuda import cuda_index, device_index
from .._device import DeviceId
from .._exceptions import ClosedError, TransportError
from ._base import Handle

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket

logger = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]

#: Bytes after each bucket's payload in a broadcast: (bucket index, generation) as two
#: int64, so that a receiver that got another bucket's bytes fails instead of loading them.
_TRAILER = 16
_ALIGN = 8

DEFAULT_TIMEOUT = 30.0
#: Seconds a failed broadcast waits before raising, for a worker's own error to surface.
_SURFACE_GRACE = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveHandle(Handle):
    """One worker's ticket to a bucket broadcast: where to join, as which rank.

    ``host``/``port`` name the trainer's ``TCPStore``; ``session`` (random per trainer
    source) and ``generation`` name the group; ``rank`` is this worker's rank in it
    (the trainer is rank 0) and ``world_size`` counts every rank. ``timeout`` bounds
    joining the group and each broadcast, in seconds.
    """

    kind: ClassVar[str] = "collective"
    host: str
    port: int
    session: str
    generation: int
    rank: int
    world_size: int
    backend: Backend = "gloo"
    timeout: float = DEFAULT_TIMEOUT


def _framed(nbytes: int) -> int:
    """Bytes of a bucket's broadcast: its payload, padded, then the trailer."""
    return -(-nbytes // _ALIGN) * _ALIGN + _TRAILER


def _write_trailer(buffer: torch.Tensor, nbytes: int, bucket: int, generation: int) -> None:
    import torch

    at = _framed(nbytes) - _TRAILER
    values = torch.tensor([bucket, generation], dtype=torch.int64, device=buffer.device)
    buffer[at : at + _TRAILER].copy_(values.view(torch.uint8))


def _read_trailer(buffer: torch.Tensor, nbytes: int) -> tuple[int, int]:
    import torch

    at = _framed(nbytes) - _TRAILER
    bucket, generation = buffer[at : at + _TRAILER].cpu().view(torch.int64).tolist()
    return int(bucket), int(generation)


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (``127.0.0.1`` for a loopback host).

    No packet is sent: a UDP socket is connected and asked for its own address.
    """
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:  # a host name
        if host == "localhost":
            return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        address: str = probe.getsockname()[0]
        return address


def _dist() -> Any:
    """``torch.distributed``, untyped: its stubs do not export the stateless-group API."""
    import importlib

    return importlib.import_module("torch.distributed")


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# Every NCCL buffer is placed on an explicit device: the transport's threads are fresh
# threads, whose current CUDA device is cuda:0 whatever the training loop selected.


def _empty(size: int, device: torch.device) -> torch.Tensor:
    """A flat ``uint8`` buffer of ``size`` bytes on ``device``."""
    import torch

    return torch.empty(size, dtype=torch.uint8, device=device)


def _on_device(device: torch.device) -> AbstractContextManager[object]:
    """Make ``device`` this thread's current CUDA device while in the block (CPU: nothing)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def _synchronize(device: torch.device) -> None:
    """Wait on the host for the work enqueued on ``device``'s current stream."""
    import torch

    torch.cuda.current_stream(device).synchronize()


def _slot_device(backend: Backend, device: int | str | torch.device | None) -> torch.device:
    """The device of a trainer's slots: the CPU for gloo, the given (or current) GPU for NCCL."""
    import torch

    if backend == "gloo":
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the gloo backend broadcasts CPU buffers, not {device}")
        return torch.device("cpu")
    if device is None and not torch.cuda.is_available():
        raise TransportError("the nccl backend needs CUDA, which is not available")
    return torch.device("cuda", device_index(device, transport="collective (nccl)"))


def _receiver_device(handle: CollectiveHandle) -> torch.device:
    """Where a worker receives ``handle``'s broadcast: NCCL, on the handle's GPU (its UUID)."""
    import torch

    if handle.backend == "nccl":
        return torch.device("cuda", cuda_index(handle.device.device))
    return torch.device("cpu")


def _new_group(
    backend: Backend,
    store: Any,
    prefix: str,
    rank: int,
    size: int,
    bind: str,
    timeout: float,
    device: torch.device,
) -> Any:
    """A process group of ``size`` ranks on ``PrefixStore(prefix, store)``; blocks until formed.

    ``device`` is this rank's own (NCCL: its GPU, which the group's probe runs on).
    """
    dist = _dist()

    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":  # exercised by the multi-GPU issue (8); not testable on one GPU
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timedelta(timeout)
        group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        # NCCL connects lazily: a one-element broadcast on this rank's own GPU (a
        # barrier would guess the GPU from the rank) makes a missing rank fail here.
        _broadcast(group, _empty(1, device), "nccl")
        return group
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _timedelta(timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    return dist.ProcessGroupGloo(prefixed, rank, size, options)


def _broadcast(group: Any, tensor: torch.Tensor, backend: Backend) -> None:
    """Broadcast ``tensor`` from rank 0 (or receive it); blocks until it is complete."""
    dist = _dist()

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
    if backend == "nccl":
        _synchronize(tensor.device)


def _forget_frames(exc: BaseException) -> None:
    """Drop the locals of the frames ``exc`` (and its causes) passed through.

    A process group closes its connections only when it is destroyed: a failed
    broadcast's traceback must not keep it alive (peers would wait out their timeouts).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def _shut(group: Any) -> None:
    """Abort a group (NCCL: ``ncclCommAbort``) before its last reference goes.

    Gloo closes its connections only when the group is destroyed, which is what makes
    peers blocked in it fail at once: callers drop every reference right after this.
    """
    try:
        group.abort()
    except Exception as exc:  # an older torch, or nothing left to abort
        logger.debug("aborting a process group failed: %s", exc)


class _Root:
    """Rank 0: the slots, the store, the group and its membership (an :class:`Exporter`).

    Slot buffers are touched by one packing thread and one sending thread at a time,
    never the same slot at once (the coordinator's slot rules); the group by the sending
    thread only, and by :meth:`close` once that thread ended.
    """

    kind = "collective"

    def __init__(
        self, host: str, port: int, backend: Backend, timeout: float, device: torch.device
    ) -> None:
        self.host = host
        self.port = port
        self.backend: Backend = backend
        self.device = device
        self.timeout = timeout
        self.session = secrets.token_hex(4)
        self.generation = 0
        self.members: tuple[DeviceId, ...] = ()
        self.broken = False
        self._slots: list[torch.Tensor] = []
        self._store: Any = None
        self._group: Any = None
        self._group_generation = -1
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<collective root {self.backend} on {self.device} {self.host}:{self.port} "
            f"gen={self.generation} "
            f"members={len(self.members)} slots={len(self._slots)} broken={self.broken}>"
        )

    # --- the Exporter protocol ----------------------------------------------------------

    def allocate(self, slots: int, slot_bytes: int) -> None:
        dist = _dist()

        size = _framed(slot_bytes)
        if self._store is None:
            try:
                self._store = dist.TCPStore(
                    self.host,
                    self.port,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=_timedelta(self.timeout),
                )
            except Exception as exc:
                raise TransportError(
                    f"cannot host a TCP store on {self.host}:{self.port}: {exc}"
                ) from exc
            self.port = self._store.port
        if len(self._slots) == slots and all(s.numel() == size for s in self._slots):
            return
        self._slots = []
        with _on_device(self.device):
            self._slots = [_empty(size, self.device) for _ in range(slots)]

    def buffer(self, slot: int) -> torch.Tensor:
        return self._slots[slot]

    def seal(self, slot: int) -> None:
        if self.backend == "nccl":
            _synchronize(self.device)  # where the slots are, and the pack's copies ran

    def handle(self, slot: int, bucket: Bucket, device: DeviceId) -> CollectiveHandle:
        try:
            rank = 1 + self.members.index(device)
        except ValueError:
            raise TransportError(f"device {device} is not a member of the broadcast") from None
        return CollectiveHandle(
            device=device,
            bucket=bucket.index,
            nbytes=bucket.nbytes,
            entries=bucket.entries,
            host=self.host,
            port=self.port,
            session=self.session,
            generation=self.generation,
            rank=rank,
            world_size=1 + len(self.members),
            backend=self.backend,
            timeout=self.timeout,
        )

    def close(self) -> None:
        with self._lock:
            self._drop_group()
            self._slots = []
            self._store = None  # the store's server stops with its last reference

    # --- membership and sending -----------------------------------------------------------

    def form(self, devices: Sequence[DeviceId]) -> None:
        """Before a push: a new generation if the receivers changed or the group broke."""
        members = tuple(sorted(set(devices)))
        if members != self.members or self.broken or self.generation == 0:
            self.generation += 1
            self.members = members
            self.broken = False

    def send(self, slot: int, bucket: Bucket) -> None:
        """Broadcast ``slot`` holding ``bucket`` to the current generation (a thread)."""
        with self._lock:
            if self.broken:
                raise TransportError(
                    f"the broadcast group (generation {self.generation}) failed earlier in "
                    "this push"
                )
            if not self._slots:
                raise ClosedError("the collective trainer source is closed")
            generation = self.generation
            try:
                with _on_device(self.device):
                    self._send(slot, bucket, generation)
            except TransportError as exc:
                _forget_frames(exc)
                self._fail()
                raise
            except Exception as exc:  # gloo/NCCL/store errors are RuntimeErrors
                _forget_frames(exc)
                self._fail()
                raise TransportError(
                    f"broadcast of bucket {bucket.index} (generation {generation}, "
                    f"{len(self.members)} receivers) failed: {exc}"
                ) from exc

    def _send(self, slot: int, bucket: Bucket, generation: int) -> None:
        group = self._current_group(generation)
        buffer = self._slots[slot]
        _write_trailer(buffer, bucket.nbytes, bucket.index, generation)
        _broadcast(group, buffer[: _framed(bucket.nbytes)], self.backend)

    def _current_group(self, generation: int) -> Any:
        if self._group is not None and self._group_generation == generation:
            return self._group
        self._drop_group()
        assert self._store is not None
        try:
            group = _new_group(
                self.backend,
                self._store,
                f"{self.session}/gen{generation}",
                0,
                1 + len(self.members),
                self.host,
                self.timeout,
                self.device,
            )
        except Exception as exc:
            raise TransportError(
                f"the {len(self.members)} receivers did not all join broadcast group "
                f"generation {generation} within {self.timeout} s: {exc}"
            ) from exc
        self._group, self._group_generation = group, generation
        return group

    def _fail(self) -> None:
        self.broken = True
        self._drop_group()

    def drop_group(self) -> None:
        """Tear the group down (once no broadcast runs); the next push forms a new one."""
        with self._lock:
            self._drop_group()

    def _drop_group(self) -> None:
        group, self._group, self._group_generation = self._group, None, -1
        if group is not None:
            _shut(group)


class CollectiveImporter:
    """Worker side: joins the trainer's broadcast group and receives buckets.

    ``bind`` is the address this worker's end of the group binds to (default: this
    machine's address on the route to the trainer, ``127.0.0.1`` for a local one).

    Resource handling: the group of the current generation, a client of the trainer's
    store and one receive buffer (grown as needed) are kept across buckets and pushes;
    a handle of a new generation drops the old group first. :meth:`close` drops all of
    it. The buffer returned by :meth:`open` is overwritten by the next ``open``.

    Error handling: a group that cannot be joined, or a broadcast that fails or does
    not arrive within the handle's ``timeout``, raises
    :class:`~asyncrefit.TransportError` before any byte reaches the parameters, and
    tears this worker's end of the group down.
    """

    def __init__(self, bind: str | None = None) -> None:
        self._bind = bind
        self._store: Any = None
        self._store_address: tuple[str, int] | None = None
        self._group: Any = None
        self._group_key: tuple[str, int, int] | None = None
        self._buffer: torch.Tensor | None = None
        # The generation that failed here: later buckets of it fail at once instead of
        # each waiting out its timeout (the trainer forms a new one after any failure).
        self._failed: tuple[str, int] | None = None

    def __repr__(self) -> str:
        return f"<CollectiveImporter group={self._group_key} failed={self._failed}>"

    def _join(self, handle: CollectiveHandle) -> Any:
        dist = _dist()

        key = (handle.session, handle.generation, handle.rank)
        if self._group is not None and self._group_key == key:
            return self._group
        self._drop_group()
        address = (handle.host, handle.port)
        if self._store is None or self._store_address != address:
            self._store = dist.TCPStore(
                handle.host,
                handle.port,
                is_master=False,
                wait_for_workers=False,
                timeout=_timedelta(handle.timeout),
            )
            self._store_address = address
        bind = self._bind if self._bind is not None else local_address_towards(handle.host)
        self._group = _new_group(
            handle.backend,
            self._store,
            f"{handle.session}/gen{handle.generation}",
            handle.rank,
            handle.world_size,
            bind,
            handle.timeout,
            _receiver_device(handle),
        )
        self._group_key = key
        return self._group

    def _receive_buffer(self, size: int, device: torch.device) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() < size or buffer.device != device:
            self._buffer = buffer = None  # free the old one before allocating
            self._buffer = buffer = _empty(size, device)
        return buffer

    def open(self, handle: Handle) -> torch.Tensor:
        if not isinstance(handle, CollectiveHandle):
            raise TransportError(f"the collective transport cannot open a {handle.kind!r} handle")
        size = _framed(handle.nbytes)
        if self._failed == (handle.session, handle.generation):
            raise TransportError(
                f"broadcast group generation {handle.generation} failed earlier on this "
                "worker; the next push forms a new one"
            )
        try:
            buffer = self._receive(handle, size)
        except Exception as exc:
            _forget_frames(exc)
            self._failed = (handle.session, handle.generation)
            self._drop_group()
            self._store = self._store_address = None
            raise TransportError(
                f"receiving bucket {handle.bucket} (generation {handle.generation}, rank "
                f"{handle.rank}) failed: {exc}"
            ) from exc
        got = _read_trailer(buffer, handle.nbytes)
        if got != (handle.bucket, handle.generation):
            self._failed = (handle.session, handle.generation)
            self._drop_group()
            raise TransportError(
                f"expected bucket {handle.bucket} of generation {handle.generation}, "
                f"received bucket {got[0]} of generation {got[1]}"
            )
        return buffer[: handle.nbytes]

    def _receive(self, handle: CollectiveHandle, size: int) -> torch.Tensor:
        device = _receiver_device(handle)
        with _on_device(device):
            group = self._join(handle)
            buffer = self._receive_buffer(size, device)
            _broadcast(group, buffer[:size], handle.backend)
        return buffer

    def finish(self, handle: Handle) -> bytes:
        if isinstance(handle, CollectiveHandle) and handle.backend == "nccl":
            # The copies out of the buffer ran on the current stream of the buffer's GPU.
            _synchronize(_receiver_device(handle))
        return b""

    def settle(self) -> None:
        pass  # finish waited already

    def _drop_group(self) -> None:
        group, self._group, self._group_key = self._group, None, None
        if group is not None:
            _shut(group)

    def close(self) -> None:
        self._drop_group()
        self._store = self._store_address = None
        self._buffer = None
