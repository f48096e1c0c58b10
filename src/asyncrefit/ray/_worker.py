"""Inference workers as Ray async actors: the actor-side mixin and the coordinator's adapter."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio

from .._core._plan import ParamSpec
from .._device import DeviceId
from .._exceptions import (
    AsyncRefitError,
    AwaitableReturnedError,
    WorkerDiedError,
    WorkerError,
    WorkerRemoteError,
)
from .._wire._messages import AbortUpdate, BucketAck, CommitUpdate
from .._worker._receiver import ParameterReceiver
from ..transport.destinations import Destinations
from ..transport.shm import segment_pid
from ._cluster import current_node_id, sweep_dead_process
from ._errors import worker_errors
from ._order import BucketTurns
from ._stream import StreamCall, driver_host, open_stream, serve_stream

if TYPE_CHECKING:
    import torch

    from ..transport._base import Handle, Importer

#: The methods a worker actor serves; each must be a coroutine function (``async def``),
#: so that it runs on the actor's own event loop and returns a plain value.
WORKER_METHODS = (
    "report_device_id_async",
    "refit_discover",
    "refit_parameter_specs",
    "refit_begin",
    "refit_begin_direct",
    "refit_destinations",
    "refit_load",
    "refit_commit",
    "refit_abort",
    "refit_abort_unwritten",
    "refit_weight_version",
    "refit_release_handles",
    "refit_digests",
    "refit_stream",
)


logger = logging.getLogger(__name__)


def check_async_methods(cls: type, names: Iterable[str]) -> None:
    """Raise ``TypeError`` if ``cls`` defines one of ``names`` as anything but ``async def``.

    A plain ``def`` that returns a coroutine would have Ray pickle a coroutine object
    (or the caller await it on the wrong loop): refused when the class is defined.
    """
    for name in names:
        attr = inspect.getattr_static(cls, name, None)
        if attr is None:
            continue
        func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"{cls.__qualname__}.{name} must be an `async def` method: the coordinator "
                "awaits it through Ray, it runs on the actor's own event loop and returns a "
                "plain value (a plain `def` returning a coroutine would send the coroutine)"
            )


def is_awaitable_result(value: object) -> bool:
    """Whether ``value`` is something to await (coroutine, future, ``ObjectRef``)."""
    return inspect.isawaitable(value) or type(value).__name__ in ("ObjectRef", "Future")


def _reject_awaitable(where: str, what: str, value: object) -> None:
    if is_awaitable_result(value):
        if inspect.iscoroutine(value):
            value.close()  # never awaited here, and never sent anywhere: no warning
        raise AwaitableReturnedError(
            where,
            f"{what} returned a {type(value).__name__}, not a plain value; "
            "await it on the actor's own loop and return the result",
        )


class RefitWorkerMixin:
    """Makes a Ray async actor an asyncrefit inference worker.

    Inherit it in your actor class (the one that owns your engine or module) and call
    :meth:`init_refit` from ``__init__`` with the parameters to update::

        class Policy(RefitWorkerMixin):
            def __init__(self) -> None:
                self.model = make_model()
                self.init_refit(self.model, device="cpu:0")

        actor = ray.remote(Policy).options(num_cpus=0).remote()
        worker = RayWorker(actor, name="policy-0")      # give this to RefitCoordinator

    Every method the coordinator calls is ``async def`` and runs on the actor's own
    event loop; Ray returns its plain result (a ``DeviceId``, a ``BucketAck``, ...).
    ``report_device_id_async`` may be overridden with an ``async def`` that awaits
    your engine (on this same loop); the device it reports is the one the actor is
    sent handles for. Defining any of these methods without ``async`` raises
    ``TypeError`` when the class is defined.

    Resource handling: copies run in a worker thread (one at a time, in the order the
    requests arrived), so the actor's loop keeps serving other calls meanwhile. An
    abort is answered only after a copy still running has finished, so its answer
    means this actor reads no trainer buffer any more. Shared-memory mappings are
    cached across pushes and closed by ``refit_release_handles`` (the coordinator
    calls it on exit) and when the actor exits gracefully.

    Error handling: errors raised here reach the coordinator as
    :class:`~asyncrefit.WorkerRemoteError` with their type and message; a device
    query that returns an awaitable raises :class:`AwaitableReturnedError`.
    """

    _refit_receiver_: ParameterReceiver | None = None
    _refit_device_: DeviceId | None = None
    _refit_lock_: anyio.Lock | None = None
    _refit_limiter_: anyio.CapacityLimiter | None = None
    # Loads are taken in bucket order: Ray may run an async actor's calls in any order,
    # and a transport that streams buckets (a broadcast) must receive them in order.
    _refit_turns_: BucketTurns | None = None
    _refit_streams_: int = 0  # stream calls started (refit_stream)
    _refit_method_names: ClassVar[tuple[str, ...]] = WORKER_METHODS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_async_methods(cls, cls._refit_method_names)

    # --- set-up (synchronous: called from the actor's __init__) -----------------------

    def init_refit(
        self,
        parameters: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        device: str | DeviceId = "cpu:0",
        importers: Mapping[str, Importer] | None = None,
        shared_parameters: bool = False,
    ) -> None:
        """Receive refits into ``parameters`` (a module's parameters, or named tensors).

        ``device`` is this actor's device on its node: a virtual CPU device name
        (``"cpu:0"``), a GPU's UUID, or a full :class:`~asyncrefit.DeviceId`. A name is
        qualified with this actor's Ray node id, so handles never cross nodes.
        ``importers`` overrides the transports' importers (tests, custom transports).
        ``shared_parameters=True`` exports the parameters for direct writes by a
        trainer on this node (see :class:`~asyncrefit.abc.DirectWorker`): on the CPU
        they move into one ``/dev/shm`` segment, on a GPU their storages are shared by
        CUDA IPC.
        """
        import torch

        tensors = (
            dict(parameters.named_parameters())
            if isinstance(parameters, torch.nn.Module)
            else dict(parameters)
        )
        own = (
            device
            if isinstance(device, DeviceId)
            else DeviceId(node=current_node_id(), device=device)
        )
        self._refit_device_ = own
        self._refit_receiver_ = ParameterReceiver(
            tensors, own, importers=importers, shared=shared_parameters
        )

    @property
    def refit_receiver(self) -> ParameterReceiver:
        """The receiver that copies into this actor's parameters."""
        if self._refit_receiver_ is None:
            raise AsyncRefitError(
                f"{type(self).__name__}.init_refit(...) was not called in __init__"
            )
        return self._refit_receiver_

    def _refit_order(self) -> BucketTurns:
        if self._refit_turns_ is None:
            self._refit_turns_ = BucketTurns("a load")
        return self._refit_turns_

    async def _refit_restart_order(self) -> None:
        """A new push (or an abort): bucket 0 is next; loads still waiting give up."""
        await self._refit_order().restart()

    def _refit_sync(self) -> tuple[anyio.Lock, anyio.CapacityLimiter]:
        # Made on first use, on the actor's loop (``__init__`` may run elsewhere).
        if self._refit_lock_ is None or self._refit_limiter_ is None:
            self._refit_lock_ = anyio.Lock()
            self._refit_limiter_ = anyio.CapacityLimiter(1)
        return self._refit_lock_, self._refit_limiter_

    # --- what the coordinator calls (through RayWorker) ---------------------------------

    async def report_device_id_async(self) -> DeviceId:
        """This actor's device. Runs on the actor's own loop; override it to ask your engine.

        An override must be ``async def`` and return a :class:`~asyncrefit.DeviceId`
        (see :func:`asyncrefit.ray.ray_device`), awaiting whatever it needs first.
        """
        await anyio.lowlevel.checkpoint()
        if self._refit_device_ is None:
            raise AsyncRefitError(
                f"{type(self).__name__}.init_refit(...) was not called in __init__"
            )
        return self._refit_device_

    async def refit_discover(self) -> DeviceId:
        """Await :meth:`report_device_id_async` here, on this loop; bind the receiver to it."""
        receiver = self.refit_receiver
        device: object = await self.report_device_id_async()
        _reject_awaitable(type(self).__name__, "report_device_id_async", device)
        if not isinstance(device, DeviceId):
            raise TypeError(
                f"report_device_id_async returned {type(device).__name__}, not a DeviceId"
            )
        receiver.device = device
        return device

    async def refit_parameter_specs(self) -> tuple[ParamSpec, ...]:
        await anyio.lowlevel.checkpoint()
        return self.refit_receiver.specs()

    async def refit_begin(self, version: int) -> None:
        lock, _ = self._refit_sync()
        async with lock:
            self.refit_receiver.begin(version)
        await self._refit_restart_order()

    async def refit_destinations(self) -> Destinations | None:
        """This actor's exported parameters (``init_refit(shared_parameters=True)``)."""
        await anyio.lowlevel.checkpoint()
        return self.refit_receiver.destinations()

    async def refit_begin_direct(self, version: int) -> None:
        """Begin ``version``, written into this actor's parameters by the trainer."""
        lock, _ = self._refit_sync()
        async with lock:
            self.refit_receiver.begin_direct(version)
        await self._refit_restart_order()

    async def refit_load(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> BucketAck:
        """Copy one bucket (in a thread); returns once every view of the buffer is dropped."""
        lock, limiter = self._refit_sync()
        receiver = self.refit_receiver
        async with self._refit_order().turn(bucket, version), lock:
            return await anyio.to_thread.run_sync(
                receiver.load, version, bucket, handles, limiter=limiter
            )

    async def refit_commit(self, version: int, buckets: int) -> None:
        lock, limiter = self._refit_sync()
        receiver = self.refit_receiver
        async with lock:
            if receiver.commit_waits:  # it waits for the trainer's GPU writes: off the loop
                await anyio.to_thread.run_sync(receiver.commit, version, buckets, limiter=limiter)
            else:
                receiver.commit(version, buckets)

    async def refit_abort(self, version: int) -> None:
        """Give ``version`` up; answered after any copy still running has finished."""
        await self._refit_restart_order()
        lock, _ = self._refit_sync()
        async with lock:
            self.refit_receiver.abort(version)

    async def refit_abort_unwritten(self, version: int) -> None:
        """Give ``version`` up, begun direct, of which the coordinator says no byte was
        written: the actor holds the version it held before the begin again. Then
        :meth:`refit_abort` (an override of it applies)."""
        lock, _ = self._refit_sync()
        async with lock:
            self.refit_receiver.state.unwritten(version)
        await self.refit_abort(version)

    async def refit_stream(self, host: str, port: int, token: bytes) -> int:
        """Every push of one coordinator over a stream (what :class:`RayWorker` calls).

        Connects to the driver at ``(host, port)``, sends ``token``, then serves the
        requests of push after push in order through :meth:`refit_begin`,
        :meth:`refit_load`, :meth:`refit_commit` and :meth:`refit_abort` (overrides of
        them apply), each answered after it returned. Returns (the number of requests
        served) when the driver closed the connection; a version begun and not
        finished is then given up. See :mod:`asyncrefit.ray._stream`.
        """
        return await serve_stream(self, host, port, token)

    def _refit_stream_started(self) -> int:
        """A stream call started: its number (a newer one supersedes it)."""
        self._refit_streams_ += 1
        return self._refit_streams_

    def _refit_stream_current(self, epoch: int) -> bool:
        return self._refit_streams_ == epoch

    async def _refit_stream_lost(self, version: int, epoch: int) -> None:
        # The driver closed a push's stream before its end: give that version up,
        # unless a newer stream started meanwhile (its push may have the same version
        # number, from another coordinator). The bucket order is left alone.
        lock, _ = self._refit_sync()
        async with lock:
            if self._refit_stream_current(epoch):
                self.refit_receiver.abort(version)

    async def refit_weight_version(self) -> int | None:
        await anyio.lowlevel.checkpoint()
        return self.refit_receiver.version

    async def refit_release_handles(self) -> None:
        lock, _ = self._refit_sync()
        async with lock:
            self.refit_receiver.release_handles()

    async def refit_digests(self) -> dict[str, str]:
        """A digest of each parameter's bytes (diagnostics: equal iff bitwise equal)."""
        lock, limiter = self._refit_sync()
        async with lock:
            return await anyio.to_thread.run_sync(self.refit_receiver.digests, limiter=limiter)

    def __ray_shutdown__(self) -> None:
        # Ray calls this when the actor exits gracefully (not when it is killed).
        if self._refit_receiver_ is not None:
            self._refit_receiver_.close()
        parent = getattr(super(), "__ray_shutdown__", None)
        if parent is not None:
            parent()


def check_actor_methods(actor: Any, methods: Iterable[str], mixin: str) -> None:
    """Raise ``TypeError`` unless ``actor`` (a handle) has every one of ``methods``."""
    missing = [m for m in methods if not hasattr(actor, m)]
    if missing:
        raise TypeError(f"{actor!r} has no method {missing[0]!r}: its class must inherit {mixin}")


def default_actor_name(actor: Any) -> str:
    """``ClassName-<first 8 hex digits of the actor id>`` for an actor handle."""
    try:
        cls = str(actor._ray_actor_creation_function_descriptor.class_name)
        actor_id = str(actor._actor_id.hex())
    except AttributeError:
        return repr(actor)
    return f"{cls.rsplit('.', 1)[-1]}-{actor_id[:8]}"


class RayWorker:
    """A :class:`~asyncrefit.abc.Worker` backed by a Ray actor that uses :class:`RefitWorkerMixin`.

    Each call submits one actor task (``actor.method.remote(...)``, which does not
    block) and awaits its ``ObjectRef`` on the coordinator's loop; nothing calls
    ``ray.get``. The actor's code, its device query included, runs on the actor's own
    loop, and only plain values come back: a coroutine, future or ``ObjectRef`` in a
    reply raises :class:`AwaitableReturnedError` (at discovery, before any byte moves).
    Works on asyncio (uvloop included), where Ray's ``ObjectRef`` can be awaited.

    With ``stream=True`` (the default) a worker costs one actor call for as long as a
    coordinator uses it: the first ``begin_update`` starts the actor's
    ``refit_stream``, which connects back to this process over TCP (to
    ``stream_host``, by default the node IP Ray reports here, on a fresh port,
    authenticated by a random token); every push is then requests on that stream (a
    begin, one small frame per bucket each way, a commit or abort), with handles sent
    by reference after their first push. ``release_handles`` closes the stream. A
    stream whose connection failed is not reused: the next push opens a new one.
    ``stream=False`` makes every request its own actor call (``refit_begin``, one
    ``refit_load`` per bucket, ...): ~0.2-0.7 ms of this process's CPU per call.

    ``name`` defaults to ``ClassName-<actor id prefix>``. An actor whose class does not
    inherit :class:`RefitWorkerMixin` raises ``TypeError`` here.

    Resource handling: the actor belongs to the caller: nothing here kills it. A call
    that is cancelled stops waiting; the actor finishes that request on its own, and
    answers a later abort only after it. On the stream, a load cancelled after it was
    sent leaves the stream usable: the actor still copies it, in order, and the abort
    that follows on the stream is answered only after that copy. The stream is closed
    when its connection fails and at ``release_handles``. An actor that exported its
    parameters in a ``/dev/shm`` segment (``init_refit(shared_parameters=True)``) and
    died without unlinking it (``ray.kill``, its process killed): ``release_handles``
    (the coordinator's close, ``remove_worker``) finds it dead and has a zero-CPU task on
    its node remove the segment once its process is gone, bounded by
    ``sweep_timeout``.

    Error handling: the actor dying (``ray.kill``, its process killed, its node lost)
    raises :class:`~asyncrefit.WorkerDiedError` naming it, as soon as Ray reports it
    or its stream's connection ends; an unavailable actor raises
    :class:`~asyncrefit.WorkerTimeoutError`; an error in the actor
    :class:`~asyncrefit.WorkerRemoteError`. The coordinator's ``timeout`` bounds every
    call.
    """

    def __init__(
        self,
        actor: Any,
        *,
        name: str | None = None,
        stream: bool = True,
        stream_host: str | None = None,
        sweep_timeout: float = 10.0,
    ) -> None:
        check_actor_methods(actor, WORKER_METHODS, "asyncrefit.ray.RefitWorkerMixin")
        self._actor = actor
        self._name = name if name is not None else default_actor_name(actor)
        self._streaming = stream
        self._stream_host = stream_host
        self._sweep_timeout = sweep_timeout
        self._stream: StreamCall | None = None
        self._pushing: int | None = None  # the version begun on the stream
        # (node, pid) of the process whose /dev/shm segment holds the actor's exported
        # parameters: what to sweep if it dies without unlinking it.
        self._exported: tuple[str, int] | None = None

    def __repr__(self) -> str:
        mode = "stream" if self._streaming else "per-call"
        return f"<RayWorker {self._name!r} {mode} {self._actor!r}>"

    @property
    def stream(self) -> bool:
        """Whether a push is one actor call with its requests on a stream."""
        return self._streaming

    @property
    def name(self) -> str:
        return self._name

    @property
    def actor(self) -> Any:
        """The Ray actor handle."""
        return self._actor

    async def _call(self, method: str, *args: object) -> object:
        with worker_errors(self._name):
            ref = getattr(self._actor, method).remote(*args)
            result: object = await ref
        _reject_awaitable(self._name, method, result)
        return result

    def _wrong_type(self, method: str, result: object, expected: str) -> WorkerRemoteError:
        return WorkerRemoteError(
            self._name, "TypeError", f"{method} returned {type(result).__name__}, not {expected}"
        )

    async def report_device_id_async(self) -> DeviceId:
        """The actor's device: its ``report_device_id_async``, awaited on its own loop."""
        result = await self._call("refit_discover")
        if not isinstance(result, DeviceId):
            raise self._wrong_type("report_device_id_async", result, "a DeviceId")
        return result

    async def parameter_specs(self) -> Sequence[ParamSpec]:
        result = await self._call("refit_parameter_specs")
        if not isinstance(result, tuple) or not all(isinstance(s, ParamSpec) for s in result):
            raise self._wrong_type("refit_parameter_specs", result, "a tuple of ParamSpec")
        return result

    async def _drop_stream(self, why: str) -> None:
        stream, self._stream, self._pushing = self._stream, None, None
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.close(why)

    async def begin_update(self, version: int) -> None:
        await self._begin(version, direct=False)

    async def begin_direct(self, version: int) -> None:
        """Begin ``version``, which the trainer writes into the actor's exported memory."""
        await self._begin(version, direct=True)

    async def destinations(self) -> Destinations | None:
        """The actor's exported parameters, or ``None`` (see ``init_refit``)."""
        result = await self._call("refit_destinations")
        if result is not None and not isinstance(result, Destinations):
            raise self._wrong_type("refit_destinations", result, "Destinations or None")
        if result is not None and result.kind == "shm":
            pids = {segment_pid(r.segment) for r in result.regions}
            if len(pids) == 1 and (pid := pids.pop()) is not None:
                self._exported = (result.device.node, pid)
        return result

    async def _begin(self, version: int, *, direct: bool) -> None:
        if not self._streaming:
            await self._call("refit_begin_direct" if direct else "refit_begin", version)
            return
        self._pushing = None
        stream = self._stream
        if stream is not None and stream.usable:
            try:
                await stream.begin(version, direct=direct)
            except WorkerError:
                if stream.usable:
                    raise  # the actor answered the begin with an error
                # the kept stream's connection failed: once more, on a new stream (a
                # begin the actor took gave its version up when the connection ended)
            else:
                self._pushing = version
                return
        await self._drop_stream("it failed")
        host = self._stream_host if self._stream_host is not None else driver_host()
        stream = self._stream = await open_stream(self._actor, self._name, host)
        await stream.begin(version, direct=direct)
        self._pushing = version

    def _open_stream(self, version: int) -> StreamCall:
        stream = self._stream
        if stream is None or self._pushing != version:
            raise WorkerError(
                self._name, f"no push of version {version} is open (begin_update first)"
            )
        return stream

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        if self._streaming:
            return await self._open_stream(version).load(version, bucket, handles)
        result = await self._call("refit_load", version, bucket, handles)
        if not isinstance(result, BucketAck):
            raise self._wrong_type("refit_load", result, "a BucketAck")
        return result

    async def commit_update(self, version: int, buckets: int) -> None:
        if not self._streaming:
            await self._call("refit_commit", version, buckets)
            return
        await self._open_stream(version).finish(CommitUpdate(version=version, buckets=buckets))
        self._pushing = None

    async def abort_update(self, version: int) -> None:
        await self._abort(version, unwritten=False)

    async def abort_unwritten(self, version: int) -> None:
        """Abort ``version``, begun direct, before the trainer wrote any byte of it: the
        actor holds the version it held before the begin again."""
        await self._abort(version, unwritten=True)

    async def _abort(self, version: int, *, unwritten: bool) -> None:
        stream = self._stream
        self._pushing = None
        if stream is not None and stream.usable:
            try:
                await stream.finish(AbortUpdate(version=version, unwritten=unwritten))
                return
            except WorkerError as exc:
                if isinstance(exc, WorkerDiedError):
                    raise
                # the stream failed under the abort: confirm it by a call of its own
        elif stream is not None:
            await self._drop_stream("it failed")
        await self._call("refit_abort_unwritten" if unwritten else "refit_abort", version)

    async def weight_version(self) -> int | None:
        result = await self._call("refit_weight_version")
        if result is not None and not isinstance(result, int):
            raise self._wrong_type("refit_weight_version", result, "an int or None")
        return result

    async def release_handles(self) -> None:
        """Close the stream and have the actor drop what it opened; an actor found dead
        has its exported segment swept from its node (see the class), then the error
        is raised."""
        await self._drop_stream("handles were released")
        try:
            await self._call("refit_release_handles")
        except WorkerDiedError:
            await self._sweep()
            raise

    async def _sweep(self) -> None:
        if self._exported is None:
            return  # it exported no segment through us
        node, pid = self._exported
        if await sweep_dead_process(self._name, node, pid, self._sweep_timeout):
            self._exported = None

    async def parameter_digests(self) -> dict[str, str]:
        """A digest of each of the actor's parameters (diagnostics)."""
        result = await self._call("refit_digests")
        if not isinstance(result, dict):
            raise self._wrong_type("refit_digests", result, "a dict")
        return {str(k): str(v) for k, v in result.items()}
