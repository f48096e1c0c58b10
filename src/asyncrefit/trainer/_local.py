"""In-process trainer sources: the training loop's own tensors, exported to workers.

:class:`LocalTrainer` packs each bucket into a reusable staging slot of a transport.
The zero-copy trainers, whose parameters live in their buckets' memory instead
(``_shared`` on the CPU, ``_cuda_shared`` on a GPU), build on :class:`_InProcessSource`
through ``_slabs``.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from itertools import chain
from typing import TYPE_CHECKING, TypeAlias

import anyio

from .._checksum import checksum
from .._core._plan import ParamSpec
from .._device import DeviceId, local_node_id
from .._dtypes import dtype_name, torch_dtype
from .._exceptions import ClosedError, PackError
from .._names import as_name_map, engine_named
from .._protocols import SourceInfo
from ..transport._base import Exporter, Handle, OrderingExporter
from ._checkpoint import CheckpointLayout, is_transformers_model
from ._direct import DirectWriter
from ._quantized import quantize_tensors
from ._slices import Lazy, copy_plain, rows_of

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket, Plan, TensorEntry
    from ..quantization import Fp8Blocks

logger = logging.getLogger(__name__)

TensorsLike: TypeAlias = (
    "torch.nn.Module | Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]"
)
#: Trainer name to engine name, or ``None`` to leave a parameter out (see NameMap).
NamesLike: TypeAlias = Callable[[str], "str | None"]


def _reader(parameters: TensorsLike) -> Callable[[], Mapping[str, torch.Tensor]]:
    """A callable reading the trainer's tensors, by the trainer's names."""
    import torch

    if isinstance(parameters, torch.nn.Module):
        module = parameters
        if type(module).named_parameters is not torch.nn.Module.named_parameters:
            return lambda: dict(module.named_parameters())  # a wrapper's own names
        return _ModuleWalk(module)
    if isinstance(parameters, Mapping):
        mapping = parameters
        return lambda: mapping
    return parameters


def _named_parameters(
    module: torch.nn.Module,
    prefix: str,
    out: dict[str, torch.Tensor],
    seen: set[int],
    visited: list[torch.nn.Module],
) -> dict[str, torch.Tensor]:
    """``dict(module.named_parameters())``: the same names, order and objects (a
    parameter reachable twice counted at its first name), in about a third of the time.
    ``visited`` gets every module walked, in order."""
    visited.append(module)
    for name, p in module._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out[prefix + name] = p
    for name, child in module._modules.items():
        if child is not None:
            _named_parameters(child, prefix + name + ".", out, seen, visited)
    return out


_PARAMETERS = operator.attrgetter("_parameters")
_CHILDREN = operator.attrgetter("_modules")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")

#: What the modules of a walk hold, in walk order: the count of each one's parameters,
#: their names and objects, and each one's children (a dict of modules).
_Held: TypeAlias = "tuple[list[int], list[str], list[object], list[dict[str, object]]]"


class _ModuleWalk:
    """``dict(module.named_parameters())`` of a module, read at every push, walked again
    only when the module tree changed.

    A walk (:func:`_named_parameters`) depends on nothing but the names and objects
    held by the ``_parameters`` and ``_modules`` of the modules it visits. The last
    walk's modules are kept with what they held; a read collects that again with
    C-level ``map`` calls (no Python frame per module) and, when every count, name and
    object is the same (parameters by identity; children by dict equality, which is
    identity for modules that do not define ``__eq__``: with one that does, every read
    walks), it answers (a copy of) what that walk found: walking again would visit the
    same modules under the same prefixes. Any change (a parameter replaced, added,
    removed or renamed; a module added, replaced, removed or moved) walks anew.
    Llama-2-7B's 390 modules: about a third of the walk's time.
    """

    __slots__ = ("_module", "_walked")

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        # The modules of the last walk, what they held then, and what it found.
        self._walked: tuple[tuple[torch.nn.Module, ...], _Held, dict[str, torch.Tensor]] | None
        self._walked = None

    @staticmethod
    def _held(modules: tuple[torch.nn.Module, ...]) -> _Held | None:
        """What ``modules`` hold now (``None`` if some module keeps it in no dict)."""
        try:
            params: list[dict[str, object]] = list(map(_PARAMETERS, modules))
            children: list[dict[str, object]] = list(map(_CHILDREN, modules))
            return (
                list(map(len, params)),
                [*chain.from_iterable(params)],
                [*chain.from_iterable(map(dict.values, params))],
                children,
            )
        except (AttributeError, TypeError):
            return None

    def __call__(self) -> dict[str, torch.Tensor]:
        walked = self._walked
        if walked is not None:
            modules, (counts, names, objects, children), found = walked
            now = self._held(modules)
            if (
                now is not None
                and now[0] == counts
                and now[1] == names
                and all(map(operator.is_, now[2], objects))
                and now[3] == children
            ):
                return dict(found)
        visited: list[torch.nn.Module] = []
        found = _named_parameters(self._module, "", {}, set(), visited)
        modules = tuple(visited)
        held = self._held(modules)
        if held is not None and all(type(m).__eq__ is object.__eq__ for m in modules):
            counts, names, objects, children = held
            # Copies of the children: the modules' own dicts change in place. One
            # assignment: a read in another thread sees one walk or the other.
            self._walked = (modules, (counts, names, objects, list(map(dict, children))), found)
        else:
            self._walked = None
        return dict(found)


def _linear_weights(parameters: TensorsLike, names: Callable[[str], str | None]) -> set[str] | None:
    """The engine names of the weights of ``parameters``' ``torch.nn.Linear`` modules
    (``None`` if it is no module)."""
    import torch

    if not isinstance(parameters, torch.nn.Module):
        return None
    found = set()
    for module_name, module in parameters.named_modules():
        if isinstance(module, torch.nn.Linear):
            engine = names(f"{module_name}.weight" if module_name else "weight")
            if engine is not None:
                found.add(engine)
    return found


def _trainer_sources(tensor: Lazy) -> list[object]:
    """The trainer tensors a lazy engine tensor reads (through lazy ones it wraps)."""
    found: list[object] = []
    for source in tensor.sources:
        found.extend(_trainer_sources(source) if isinstance(source, Lazy) else [source])
    return found


class _Reading:
    """The engine's tensors of a trainer, read at every push without redoing what did
    not change.

    ``read()`` walks the trainer's tensors (``trainer``) and, if every name, object,
    shape and dtype is as the last walk found them, answers the engine's tensors it
    made then; otherwise it makes them anew (``make``: the checkpoint layout and the
    name map, the quantization). It keeps them only when each engine tensor is one of
    the trainer's own tensors or a :class:`~asyncrefit.trainer._slices.Lazy` one
    reading only those (both read the trainer's memory when written, wherever it is
    then), never a view, which would keep viewing memory a parameter no longer has.
    ``made`` counts the times they were made anew: two reads with the same count
    answered the same tensors.
    """

    __slots__ = (
        "_dtypes",
        "_engine",
        "_make",
        "_names",
        "_shapes",
        "_trainer",
        "_values",
        "made",
    )

    def __init__(
        self,
        trainer: Callable[[], Mapping[str, torch.Tensor]],
        make: Callable[[], Mapping[str, torch.Tensor]],
    ) -> None:
        self._trainer = trainer
        self._make = make
        self._names: tuple[str, ...] = ()
        self._values: tuple[torch.Tensor, ...] = ()
        self._shapes: list[torch.Size] = []
        self._dtypes: list[torch.dtype] = []
        self._engine: Mapping[str, torch.Tensor] | None = None
        self.made = 0

    def read(self) -> Mapping[str, torch.Tensor]:
        raw = self._trainer()
        kept = self._engine
        values = self._values
        # In C (map), not a Python frame per tensor: every push reads them.
        if (
            kept is not None
            and len(raw) == len(values)
            and all(map(operator.is_, raw.values(), values))
            and tuple(raw) == self._names
            and list(map(_SHAPE, values)) == self._shapes
            and list(map(_DTYPE, values)) == self._dtypes
        ):
            return kept
        self.made += 1
        engine = self._make()
        values = tuple(raw.values())
        own = {id(t) for t in values}
        keep = all(
            id(t) in own or (isinstance(t, Lazy) and all(id(s) in own for s in _trainer_sources(t)))
            for t in engine.values()
        )
        self._engine = engine if keep else None
        self._names = tuple(raw)
        self._values = values
        self._shapes = list(map(_SHAPE, values))
        self._dtypes = list(map(_DTYPE, values))
        return engine


class _SourceBase:
    """What every source of this process shares: its name, node and devices; one
    packing thread at a time; closing off the event loop; naming a failed parameter."""

    #: Whether packing takes part in collectives with other ranks (see SourceInfo).
    _gathers = False
    #: Whether buckets are packed into staging slots (see SourceInfo).
    _stages = True
    #: Whether rows of a parameter can be packed as a part (see SourceInfo).
    _splits = True

    def __init__(
        self,
        *,
        devices: Iterable[DeviceId | str] | None,
        node: str | None,
        name: str,
    ) -> None:
        self._node = node if node is not None else local_node_id()
        self._devices = (
            None
            if devices is None
            else frozenset(d.device if isinstance(d, DeviceId) else d for d in devices)
        )
        self._name = name
        # One worker thread at a time packs or lays out (the limiter), and whichever
        # thread touches the buffers holds the lock: a close, in a thread of its own that
        # a cancellation cannot stop, waits there for a pack still running.
        self._limiter = anyio.CapacityLimiter(1)
        # (slot, bucket index, device) -> the handle handed out last.
        self._handles: dict[tuple[int, int, DeviceId], Handle] = {}
        self._buffer_lock = threading.Lock()

    def _handles_for(
        self,
        slot: int,
        bucket: Bucket,
        devices: Sequence[DeviceId],
        make: Callable[[DeviceId], Handle],
    ) -> tuple[Handle, ...]:
        """The handles for ``bucket`` in ``slot``, one per device, made by ``make``;
        where one equals the handle handed out for the same slot, bucket and device at
        the last push, that same object is handed out again.

        Workers and links recognise a handle they met before by identity, without
        hashing or validating it again (see :class:`~asyncrefit._worker._endpoint.Endpoint`).
        """
        out: list[Handle] = []
        memo = self._handles
        for device in devices:
            handle = make(device)
            key = (slot, bucket.index, device)
            known = memo.get(key)
            if known is not None and known == handle:
                handle = known
            else:
                memo[key] = handle
            out.append(handle)
        return tuple(out)

    @property
    def name(self) -> str:
        """This source's name (in reports and errors)."""
        return self._name

    def _info(self, specs: tuple[ParamSpec, ...]) -> SourceInfo:
        return SourceInfo(
            name=self._name,
            node=self._node,
            devices=self._devices,
            specs=specs,
            gathers=self._gathers,
            stages=self._stages,
            splits=self._splits,
        )

    async def _close_in_thread(self, close: Callable[[], None]) -> None:
        """Run ``close`` off the event loop, after any pack still running; wait for it.

        Closing blocks (a CUDA synchronize, ``ipc_collect``, a group's teardown), so it
        runs in a thread of its own, started before the first checkpoint: a cancelled
        ``aclose`` still closes everything. Waiting for it ends with a cancellation (or
        the caller's timeout); the close then finishes in its thread and logs a failure
        that nobody waits for any more.
        """
        failed: list[BaseException] = []
        waiting = True
        handoff = threading.Lock()  # a failure is raised by the waiter or logged, once

        def run() -> None:
            try:
                with self._buffer_lock:
                    close()
            except BaseException as exc:
                with handoff:
                    failed.append(exc)
                    orphan = not waiting
                if orphan:
                    logger.error("closing trainer source %r failed", self._name, exc_info=exc)

        closer = threading.Thread(target=run, name=f"asyncrefit-close-{self._name}")
        closer.start()
        try:
            await anyio.to_thread.run_sync(closer.join, abandon_on_cancel=True)
        except BaseException:
            with handoff:
                waiting = False
                lost = list(failed)
            for exc in lost:
                logger.error("closing trainer source %r failed", self._name, exc_info=exc)
            raise
        if failed:
            raise failed[0]

    @contextmanager
    def _packing(self, bucket: int, entry: TensorEntry) -> Iterator[None]:
        """Turn an error while packing ``entry`` into a :class:`PackError` that names it."""
        try:
            yield
        except PackError:
            raise
        except Exception as exc:
            raise PackError(self._name, bucket, entry.name, f"{type(exc).__name__}: {exc}") from exc


class _InProcessSource(_SourceBase):
    """What the sources of the training loop's own tensors share: reading and naming them."""

    def __init__(
        self,
        parameters: TensorsLike,
        *,
        devices: Iterable[DeviceId | str] | None,
        node: str | None,
        name: str,
        names: NamesLike | None = None,
        checkpoint_names: bool = True,
        quantization: Fp8Blocks | None = None,
    ) -> None:
        super().__init__(devices=devices, node=node, name=name)
        trainer_named = _reader(parameters)
        names_map = as_name_map(names)
        quantized = None
        if quantization is not None:
            quantized = quantization.chooser(_linear_weights(parameters, names_map))
        layout = (
            CheckpointLayout(parameters, source=name)
            if checkpoint_names and is_transformers_model(parameters)
            else None
        )

        def engine_tensors() -> Mapping[str, torch.Tensor]:
            tensors = trainer_named()
            if layout is not None:
                tensors = layout(tensors)
            engine = engine_named(tensors, names_map, source=name)
            if quantization is not None and quantized is not None:
                engine = quantize_tensors(engine, quantized, quantization.block, source=name)
            return engine

        self._reading = _Reading(trainer_named, engine_tensors)
        self._tensors = self._reading.read
        # The tensors as read by the last describe (the start of a push): walking a
        # module's parameters for every bucket would cost more than packing small ones.
        self._current: Mapping[str, torch.Tensor] | None = None
        self._described: dict[str, ParamSpec] = {}
        # What the last describe saw, and what it answered (kept while nothing changes).
        self._described_key: tuple[tuple[str, torch.Size, torch.dtype], ...] = ()
        self._info_cache: SourceInfo | None = None
        self._described_made = -1  # the reading's count when the last describe answered

    def specs(self) -> tuple[ParamSpec, ...]:
        """The current parameters' names, shapes and dtypes, in order."""
        return self._specs(self._tensors())

    @staticmethod
    def _specs(tensors: Mapping[str, torch.Tensor]) -> tuple[ParamSpec, ...]:
        return tuple(
            ParamSpec(name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype))
            for name, t in tensors.items()
        )

    def _read(self) -> Mapping[str, torch.Tensor]:
        """The tensors of the push in progress (read afresh by every describe)."""
        return self._current if self._current is not None else self._tensors()

    async def describe(self) -> SourceInfo:
        """Read the parameters afresh (the coordinator calls this at every push).

        When no name, shape or dtype changed since the last describe, the same
        :class:`SourceInfo` object is returned: the coordinator then finds the plan
        unchanged by identity, without comparing or re-checking specs.
        """
        current = dict(self._tensors())
        self._current = current
        made = self._reading.made
        if self._info_cache is not None and made == self._described_made:
            return self._info_cache  # the same tensors as the last describe's
        key = tuple((name, t.shape, t.dtype) for name, t in current.items())
        if self._info_cache is None or key != self._described_key:
            specs = self._specs(current)
            self._described = {s.name: s for s in specs}
            self._info_cache = self._info(specs)
            self._described_key = key
        self._described_made = made
        return self._info_cache

    def _tensor(
        self, tensors: Mapping[str, torch.Tensor], bucket: int, entry: TensorEntry
    ) -> torch.Tensor:
        """The tensor of ``entry``'s parameter (whole), still of the shape and dtype it
        was described with: a tensor, or a :class:`~asyncrefit.trainer._slices.Lazy`
        one made of the trainer's tensors.

        The entry's dtype is the engine's; the tensor's may differ (the pack casts).
        """
        tensor = tensors.get(entry.name)
        if tensor is None:
            raise PackError(self._name, bucket, entry.name, "disappeared from the trainer")
        got = (tuple(tensor.shape), dtype_name(tensor.dtype))
        described = self._described.get(entry.name)
        want_dtype = described.dtype if described is not None else entry.dtype
        want_shape = described.shape if described is not None else entry.shape
        if got != (want_shape, want_dtype):
            raise PackError(
                self._name,
                bucket,
                entry.name,
                f"changed shape or dtype mid-push: {got[1]}{list(got[0])} now, "
                f"{want_dtype}{list(want_shape)} planned",
            )
        return tensor


def _with_checksum(handle: Handle, crc: int | None) -> Handle:
    return handle if crc is None else replace(handle, checksum=crc)


class _SlotSource(_SourceBase):
    """A source that packs each bucket into a reusable slot of an exporter.

    A subclass calls :meth:`_init_slots` from its ``__init__`` and implements
    :meth:`_fill`; allocating, the pack's thread, sealing, the checksum, handles and
    the close off the event loop are all here.
    """

    def _init_slots(self, exporter: Exporter | None) -> None:
        if exporter is None:
            from ..transport.shm import SharedMemoryExporter

            exporter = SharedMemoryExporter()
        self._exporter = exporter
        self._prepared = False
        self._checksum = False
        self._order: dict[int, tuple[bytes, ...]] = {}  # slot -> consumers' tokens
        # (id of a slot's buffer, bucket) -> (the buffer, each entry's flat view and
        # shaped view): built at a bucket's first pack into a slot, dropped with the slots.
        self._views: dict[tuple[int, int], _EntryViews] = {}

    @property
    def exporter(self) -> Exporter:
        return self._exporter

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        await anyio.to_thread.run_sync(self._allocate, slots, slot_bytes, limiter=self._limiter)
        self._checksum = checksum
        self._prepared = True

    def _allocate(self, slots: int, slot_bytes: int) -> None:
        with self._buffer_lock:
            self._views.clear()
            self._handles.clear()
            self._exporter.allocate(slots, slot_bytes)

    def _entry_views(
        self, bucket: Bucket, buffer: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The places of ``bucket``'s entries in ``buffer``: flat, and in their shapes."""
        key = (id(buffer), bucket.index)
        cached = self._views.get(key)
        if cached is not None and cached[0] is buffer and len(cached[1]) == len(bucket.entries):
            return cached[1], cached[2]
        flat = [entry_view(buffer, e) for e in bucket.entries]
        shaped = [v.view(e.shape) for v, e in zip(flat, bucket.entries, strict=True)]
        self._views[key] = (buffer, flat, shaped)
        return flat, shaped

    def _close_slots(self) -> None:
        self._views.clear()  # the views would keep the slots' memory alive
        self._handles.clear()
        self._exporter.close()

    def _fill(self, bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Pack ``bucket`` into the flat ``uint8`` ``buffer`` (in a worker thread, under
        no_grad, holding the buffer lock); return the packed views in entry order."""
        raise NotImplementedError

    def _pack(self, bucket: Bucket, slot: int) -> int | None:
        with self._buffer_lock:
            if not self._prepared:  # closed while this pack waited for its turn
                raise ClosedError(f"trainer source {self._name!r} was closed")
            return self._pack_locked(bucket, slot)

    def order_after(self, slot: int, tokens: Sequence[bytes]) -> None:
        """Order the next pack into ``slot`` after the consumers' copies of ``tokens``.

        The coordinator calls it before every export of this source, with the tokens
        the workers' acks carried for the bucket last in ``slot`` (see
        :class:`~asyncrefit.abc.BucketAck`). With an exporter that can wait for them on the
        device (CUDA IPC), handles are marked ``ordered`` from then on, so consumers
        ack as soon as their copies are enqueued.
        """
        exporter = self._exporter
        if isinstance(exporter, OrderingExporter):
            exporter.ordered = True
            self._order[slot] = tuple(tokens)

    def _pack_locked(self, bucket: Bucket, slot: int) -> int | None:
        import torch

        tokens = self._order.pop(slot, ())
        exporter = self._exporter
        if tokens and isinstance(exporter, OrderingExporter):
            exporter.order_after(slot, tokens)
        buffer = self._exporter.buffer(slot)
        with torch.no_grad():
            packed = self._fill(bucket, buffer)
        self._exporter.seal(slot)
        # Over the packed bytes, not the source: what the workers will read.
        return checksum(packed) if self._checksum else None

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        if not self._prepared:
            raise ClosedError(f"trainer source {self._name!r} has no buffers (not prepared)")
        crc = await anyio.to_thread.run_sync(self._pack, bucket, slot, limiter=self._limiter)
        if not self._prepared:  # closed meanwhile: the slot may be gone already
            raise ClosedError(f"trainer source {self._name!r} was closed")
        exporter = self._exporter
        return self._handles_for(
            slot,
            bucket,
            devices,
            lambda d: _with_checksum(exporter.handle(slot, bucket, d), crc),
        )

    async def aclose(self) -> None:
        """Free the buffers: off the event loop, after a pack still running.

        A cancelled ``aclose`` still frees them (the close goes on in its thread).
        """
        self._prepared = False
        await self._close_in_thread(self._close_slots)


#: On a GPU, a bucket whose tensors average at least this many bytes is packed one
#: copy per tensor: each is then a device-to-device copy at memcpy's rate, where
#: ``torch._foreach_copy_`` (one kernel over many tensors) moved the Llama-2-7B set
#: (291 bf16 tensors, 13.48 GB) in 9.4 ms against 7.2 ms on an H200. Below it the
#: host's launch per tensor costs more than the bytes, and one call packs them all.
PER_TENSOR_PACK_BYTES = 1 << 20


def _one_call(buffer: torch.Tensor, bucket: Bucket) -> bool:
    """Whether to pack ``bucket`` into ``buffer`` with one ``_foreach_copy_``."""
    if not bucket.entries:
        return False
    if buffer.device.type == "cpu":
        return True
    return bucket.payload_bytes < PER_TENSOR_PACK_BYTES * len(bucket.entries)


_EntryViews: TypeAlias = "tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]"


def entry_view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The place of ``entry`` in a bucket's flat ``uint8`` buffer, flat, of its dtype."""
    return buffer[entry.offset : entry.offset + entry.nbytes].view(torch_dtype(entry.dtype))


class LocalTrainer(_InProcessSource, _SlotSource, DirectWriter):
    """A :class:`~asyncrefit.abc.TrainerSource` over tensors of this process.

    ``parameters`` is a ``torch.nn.Module`` (its ``named_parameters()``), a mapping of
    names to tensors, or a callable returning one; it is read afresh at every push, so
    in-place optimizer steps and replaced tensors are both seen. Packing runs in a
    worker thread so the event loop keeps serving acks meanwhile; do not step the
    optimizer while a push is running.

    ``exporter`` picks the transport (shared memory by default). ``devices`` restricts
    the devices served (default: every device on this node). ``names`` maps the
    trainer's parameter names to the engine's, or leaves a parameter out (a
    :class:`~asyncrefit.NameMap`, e.g. :func:`~asyncrefit.strip_wrappers`, or any
    callable returning a name or ``None``). Parameters are packed in the dtype the
    workers hold them in, cast in the pack copy (fp32 master weights to a bf16
    engine); only floating-point dtypes are cast.

    A ``transformers`` model (``PreTrainedModel``) is pushed under its checkpoint's
    names and layout, as ``save_pretrained`` would write it and as vLLM loads it:
    transformers' own conversion (``revert_weight_conversion``) is traced once per
    parameter set (see :mod:`asyncrefit.trainer._checkpoint`), and each checkpoint
    tensor is packed straight from the trainer tensor it is a slice of (one expert of
    a fused expert tensor), without a copy of its own. ``names`` then applies to the
    checkpoint names. ``checkpoint_names=False`` pushes the in-memory names instead.
    A parameter larger than a bucket is packed in parts (rows) when every worker
    takes it so.

    ``quantization=Fp8Blocks(...)`` (:mod:`asyncrefit.quantization`) pushes the linear
    layers' weights as FP8 with block scales (``X.weight_scale_inv``), quantized as
    they are packed, for an engine started from an FP8 checkpoint; each such weight is
    packed whole.

    It is also a :class:`~asyncrefit.abc.WritingSource`: a worker that exports its
    parameters (:class:`~asyncrefit.abc.DirectWorker`, e.g. local workers started with
    ``shared_parameters=True``) on this node is written directly, each tensor copied
    (and cast) once from the trainer's tensor into the worker's place, with no staging
    slot; the coordinator picks that path where it can (``direct_write``).

    Resource handling: buffers are allocated by ``prepare`` and freed by ``aclose``
    (also on every error path of the coordinator that owns this source), off the event
    loop and after a pack still running, also when ``aclose`` is cancelled; a source
    can be prepared again after ``aclose``.

    Error handling: a parameter that cannot be packed (it disappeared, changed shape or
    dtype, or its copy failed) raises :class:`~asyncrefit.PackError` naming this
    source, the bucket and the parameter, with the underlying error chained. A
    ``transformers`` conversion that cannot be read as slices of the trainer's
    tensors raises :class:`~asyncrefit.ConversionError` (before any byte moves).
    """

    def __init__(
        self,
        parameters: TensorsLike,
        *,
        exporter: Exporter | None = None,
        devices: Iterable[DeviceId | str] | None = None,
        node: str | None = None,
        name: str = "trainer",
        names: NamesLike | None = None,
        checkpoint_names: bool = True,
        quantization: Fp8Blocks | None = None,
    ) -> None:
        super().__init__(
            parameters,
            devices=devices,
            node=node,
            name=name,
            names=names,
            checkpoint_names=checkpoint_names,
            quantization=quantization,
        )
        self._init_slots(exporter)
        self._init_direct()

    def __repr__(self) -> str:
        return f"<LocalTrainer {self._name!r} node={self._node} exporter={self._exporter!r}>"

    def _fill(self, bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
        import torch

        tensors = self._read()
        flat, shaped = self._entry_views(bucket, buffer)
        sources: list[torch.Tensor | Lazy] = []
        for e in bucket.entries:
            with self._packing(bucket.index, e):
                sources.append(rows_of(self._tensor(tensors, bucket.index, e), e.part))
        plain = [t for t in sources if isinstance(t, torch.Tensor)]
        if (
            type(self)._copy_into is LocalTrainer._copy_into
            and _one_call(buffer, bucket)
            and len(plain) == len(sources)
        ):
            # One call for the bucket's copies (and casts): the host's cost per tensor,
            # not the bytes, bounds a GPU pack of many small tensors.
            try:
                torch._foreach_copy_(shaped, plain)
                return flat
            except Exception:
                pass  # copy one by one below: the failure then names its parameter
        for e, dst, tensor in zip(bucket.entries, shaped, sources, strict=True):
            with self._packing(bucket.index, e):
                self._copy_into(dst, tensor, e.name)
        return flat

    def _close_slots(self) -> None:
        super()._close_slots()
        self._close_direct()

    def _copy_into(self, dst: torch.Tensor, tensor: torch.Tensor | Lazy, name: str) -> None:
        """Write ``tensor``'s value into its place ``dst`` (cast to ``dst``'s dtype)."""
        if isinstance(tensor, Lazy):
            tensor.copy_into(dst, copy_plain)
        else:
            dst.copy_(tensor)
