"""A trainer source over converted tensors: the hook for layouts that are not the engine's.

Megatron-style trainers hold their parameters as tensor-parallel shards with fused
projections (``linear_qkv``, ``linear_fc1`` = gate and up) under their own names; the
engine wants full tensors under its checkpoint's names. :class:`ConvertingSource`
plans the engine's names, and asks a user function for the tensors of one bucket at a
time, packing each into the bucket's slot as it arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

import anyio

from .._core._plan import ParamSpec
from .._device import DeviceId
from .._dtypes import cast_problem, dtype_name, torch_dtype
from .._exceptions import PackError
from .._protocols import SourceInfo
from ._local import _SlotSource, entry_view

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket, Plan, TensorEntry
    from ..transport._base import Exporter, Handle

logger = logging.getLogger(__name__)

#: How long a failed export waits for the stream to close (it goes on in its thread).
_CLOSE_WAIT = 10.0

#: The engine's parameters in order, or a callable returning them (read at every push).
SpecsLike: TypeAlias = "Sequence[ParamSpec] | Callable[[], Iterable[ParamSpec]]"
#: Given one bucket's parameter names, yields ``(name, full tensor)`` for each of them.
TensorsFn: TypeAlias = "Callable[[Sequence[str]], Iterable[tuple[str, torch.Tensor]]]"
#: Yields ``(name, full tensor)`` for the whole model, once per push.
WeightsFn: TypeAlias = "Callable[[], Iterable[tuple[str, torch.Tensor]]]"
#: Names a stream yields that the engine does not take: a collection or a predicate.
SkipLike: TypeAlias = "Collection[str] | Callable[[str], bool]"

#: ``error(parameter, detail)``: a PackError naming this source, the bucket, ``parameter``.
_Error: TypeAlias = "Callable[[str, str], PackError]"


def _pair(item: object) -> tuple[str, torch.Tensor] | None:
    """``item`` as a ``(name, tensor)`` pair, or ``None`` if it is not one."""
    import torch

    if (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
    ):
        return item[0], item[1]
    return None


def _not_a_pair(item: object) -> str:
    return f"the conversion yielded a {type(item).__name__}, not a (name, tensor) pair"


def _close(iterator: object) -> None:
    """Close a generator (its ``finally`` blocks run now); other iterables: nothing."""
    close = getattr(iterator, "close", None)
    if callable(close):
        close()


class _PerBucket:
    """The user function is asked for each bucket's names, and yields exactly those."""

    ordered = False  # any bucket may be asked at any time
    position = 0

    def __init__(self, tensors: TensorsFn) -> None:
        self._tensors = tensors

    @property
    def open(self) -> bool:
        return False

    def take(
        self, bucket: Bucket, bucket_of: Mapping[str, int], last: bool, error: _Error
    ) -> Iterator[object]:
        items = iter(self._tensors([e.name for e in bucket.entries]))
        try:
            yield from items
        finally:
            _close(items)

    def failed(self) -> None:
        pass

    def end(self) -> None:
        pass


class _Stream:
    """A whole-model generator, read once per push, bucket after bucket in plan order.

    For bucket *k* it is read until every parameter of *k* arrived; the rest of the
    stream waits, suspended, for bucket *k+1*. After the last bucket it is read to its
    end (a collective generator must run to its end on every rank).
    """

    ordered = True

    def __init__(self, weights: WeightsFn, skip: SkipLike, lookahead_bytes: int) -> None:
        if lookahead_bytes < 0:
            raise ValueError(f"lookahead_bytes must not be negative, got {lookahead_bytes}")
        self._weights = weights
        if callable(skip):
            self._skip: Callable[[str], bool] = skip
        else:
            names = frozenset(skip)
            self._skip = names.__contains__
        self._lookahead = lookahead_bytes
        self._items: Iterator[object] | None = None
        self.position = 0  # the bucket the stream is at; -1 after a failure
        self._ahead: dict[str, torch.Tensor] = {}  # arrived before their bucket
        self._ahead_bytes = 0
        self._delivered: set[str] = set()

    @property
    def open(self) -> bool:
        """Whether a push left the stream anywhere but at its start."""
        return self._items is not None or bool(self._ahead) or self.position != 0

    def take(
        self, bucket: Bucket, bucket_of: Mapping[str, int], last: bool, error: _Error
    ) -> Iterator[object]:
        k = bucket.index
        first = bucket.entries[0].name
        if k == 0:
            self.end()  # a new push
            self._items = iter(self._weights())
        elif self._items is None or self.position != k:
            state = (
                "failed at an earlier bucket of this push"
                if self.position < 0
                else f"is at bucket {self.position}, not {k}"
            )
            raise error(first, f"the weight stream {state}")
        wanted = {e.name for e in bucket.entries}
        for name in [n for n in self._ahead if n in wanted]:
            early = self._ahead.pop(name)
            self._ahead_bytes -= early.numel() * early.element_size()
            wanted.discard(name)
            self._delivered.add(name)
            yield name, early
            del early
        while wanted or last:
            try:
                item = next(self._items)
            except StopIteration:
                break
            pair = _pair(item)
            if pair is None:
                pending = next((e.name for e in bucket.entries if e.name in wanted), first)
                raise error(pending, _not_a_pair(item))
            del item
            name, tensor = pair
            del pair
            home = bucket_of.get(name)
            if home is None:
                if self._skip(name):
                    del tensor  # dropped before the stream makes the next one
                    continue
                raise error(
                    name,
                    "is not among the specs (the engine takes no parameter of that name); "
                    "pass skip= to drop what the stream yields beyond the engine's names",
                )
            if name in self._delivered or name in self._ahead:
                raise error(name, "was yielded twice in this push")
            if home == k:
                wanted.discard(name)
                self._delivered.add(name)
                yield name, tensor
            elif home > k:
                nbytes = tensor.numel() * tensor.element_size()
                if self._ahead_bytes + nbytes > self._lookahead:
                    raise error(
                        name,
                        f"arrived while bucket {k} is packed, ahead of its bucket {home}; "
                        f"holding it would exceed lookahead_bytes={self._lookahead}: list "
                        "the specs in the order the stream yields them (or allow a lookahead)",
                    )
                self._ahead[name] = tensor
                self._ahead_bytes += nbytes
            else:  # pragma: no cover - bucket ``home`` was complete, so it was delivered
                raise error(name, f"arrived after its bucket {home} was packed")
            del tensor
        if not wanted:
            self.position = k + 1
        if last:
            self.end()

    def failed(self) -> None:
        self.end()
        self.position = -1

    def end(self) -> None:
        """Close the stream (its ``finally`` blocks run) and forget this push."""
        items, self._items = self._items, None
        self._ahead.clear()
        self._ahead_bytes = 0
        self._delivered = set()
        self.position = 0
        if items is not None:
            try:
                _close(items)
            except Exception:
                logger.exception("closing the weight stream failed")


class ConvertingSource(_SlotSource):
    """A :class:`~asyncrefit.abc.TrainerSource` whose tensors a conversion function makes.

    For trainers whose layout is not the engine's (Megatron TP/PP/EP shards, fused
    ``qkv`` and ``gate_up``): ``specs`` are the engine's parameters (names, shapes and
    dtypes as the engine holds them), in order, or a callable returning them, read
    afresh at every push (a changed set is re-planned). ``tensors(names)`` yields
    ``(name, tensor)``, the full engine-named tensor, for exactly the parameters of one
    bucket, in any order: gather and convert there. It is called once per bucket, in
    plan order (the order the coordinator exports them), in a worker thread, so the
    event loop keeps serving acks meanwhile.
    For a generator over the whole model (Megatron-Bridge's ``export_hf_weights``),
    use :meth:`from_stream`.

    Each tensor is packed into the bucket's slot as it arrives, then dropped: at most
    one bucket (the slot) and the tensor being packed are held, plus whatever the
    function holds itself. A tensor of another dtype than its spec is cast as it is
    copied (fp32 master weights into a bf16 engine); a change of kind (integer and
    floating point) is refused. Do not step the optimizer while a push runs.

    ``exporter`` picks the transport (shared memory by default; CUDA IPC works the
    same); ``devices`` restricts the devices served (default: every device on this
    node); ``node`` and ``name`` as for :class:`~asyncrefit.LocalTrainer`.

    With several trainer ranks, each rank's source runs its own conversion; a gather
    in it is a collective, so every rank must be asked for the same buckets in the
    same order: pass ``gathers=True`` on every rank, and the coordinator drives each
    rank's source through every bucket, in plan order, also when it serves no worker
    (see :class:`~asyncrefit.abc.SourceInfo`).

    Resource handling: slots are allocated by ``prepare`` and freed by ``aclose``, off
    the event loop and after a pack still running, also when ``aclose`` is cancelled.
    A generator the function returns is closed when its bucket is packed or fails; for
    a stream, see :meth:`from_stream`.

    Error handling: :class:`~asyncrefit.PackError`, naming this source, the bucket and
    the parameter, for a name that is not in the bucket, a name yielded twice, a
    parameter of the bucket never yielded, a tensor of the wrong shape or of a dtype
    that cannot be cast, and an exception raised by the function (chained; the
    parameter is the first of the bucket not packed yet). The push then fails before
    any worker is sent that bucket.
    """

    # The conversion yields whole tensors by name: a parameter is never packed in parts.
    _splits = False

    def __init__(
        self,
        specs: SpecsLike,
        tensors: TensorsFn,
        *,
        exporter: Exporter | None = None,
        devices: Iterable[DeviceId | str] | None = None,
        node: str | None = None,
        name: str = "trainer",
        gathers: bool = False,
    ) -> None:
        self._setup(specs, _PerBucket(tensors), exporter, devices, node, name, gathers)

    @classmethod
    def from_stream(
        cls,
        specs: SpecsLike,
        weights: WeightsFn,
        *,
        skip: SkipLike = (),
        lookahead_bytes: int = 0,
        exporter: Exporter | None = None,
        devices: Iterable[DeviceId | str] | None = None,
        node: str | None = None,
        name: str = "trainer",
        gathers: bool = False,
    ) -> ConvertingSource:
        """A source over ``weights()``, a generator of ``(name, tensor)`` for the whole
        model (``lambda: bridge.export_hf_weights(model, cpu=False)``), unchanged.

        ``weights()`` is called once per push, at its first bucket, and read in plan
        order: for each bucket until all of its parameters arrived, packing each as it
        comes; the generator stays suspended between buckets, and after the last
        bucket it is read to its end. List ``specs`` in the order the stream yields
        them: then no tensor is ever held beyond the one being packed. A tensor that
        arrives before its bucket is held (as yielded, not copied) until its bucket is
        packed, up to ``lookahead_bytes`` in all (default 0); past that the push fails
        with :class:`~asyncrefit.PackError`. Names in ``skip`` (a collection, or a
        predicate) are dropped as they arrive; any other name that is not in
        ``specs`` fails the push, as does a name yielded twice.

        The coordinator exports buckets in plan order; an export that comes before
        the buckets ahead of it waits for them. A push that fails or is cancelled
        while one of its buckets is exported closes the stream then; otherwise (a
        worker failed while loading) the next push or ``aclose`` closes it.
        """
        source = cls.__new__(cls)
        feed = _Stream(weights, skip, lookahead_bytes)
        source._setup(specs, feed, exporter, devices, node, name, gathers)
        return source

    def _setup(
        self,
        specs: SpecsLike,
        feed: _PerBucket | _Stream,
        exporter: Exporter | None,
        devices: Iterable[DeviceId | str] | None,
        node: str | None,
        name: str,
        gathers: bool,
    ) -> None:
        super().__init__(devices=devices, node=node, name=name)
        self._gathers = gathers
        self._init_slots(exporter)
        self._spec_source = specs
        self._feed = feed
        self._bucket_of: dict[str, int] = {}
        self._buckets = 0
        self._advanced: anyio.Event | None = None  # made on the loop that pushes

    def __repr__(self) -> str:
        kind = "stream" if self._feed.ordered else "per-bucket"
        return f"<ConvertingSource {self._name!r} {kind} exporter={self._exporter!r}>"

    def specs(self) -> tuple[ParamSpec, ...]:
        """The engine's parameters, as given (a callable is called)."""
        given = self._spec_source
        specs = tuple(given() if callable(given) else given)
        for i, spec in enumerate(specs):
            if not isinstance(spec, ParamSpec):
                raise TypeError(
                    f"trainer source {self._name!r}: specs item {i} is a "
                    f"{type(spec).__name__}, not a ParamSpec"
                )
        return specs

    async def describe(self) -> SourceInfo:
        """Read the specs afresh (the coordinator calls this at every push).

        A stream that a failed push left open is closed here, in a worker thread.
        """
        specs = self.specs()
        if self._feed.open:
            await anyio.to_thread.run_sync(self._end_feed, limiter=self._limiter)
        return self._info(specs)

    def _end_feed(self) -> None:
        with self._buffer_lock:
            self._feed.end()

    def _fail_feed(self) -> None:
        with self._buffer_lock:
            self._feed.failed()

    async def prepare(
        self, plan: Plan, slots: int, slot_bytes: int, *, checksum: bool = False
    ) -> None:
        self._bucket_of = {e.name: b.index for b in plan.buckets for e in b.entries}
        self._buckets = len(plan.buckets)
        await super().prepare(plan, slots, slot_bytes, checksum=checksum)

    async def export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        if not self._feed.ordered:
            return await super().export(bucket, slot, devices)
        try:
            while bucket.index > 0 and 0 <= self._feed.position < bucket.index:
                if self._advanced is None:
                    self._advanced = anyio.Event()
                await self._advanced.wait()
            handles = await super().export(bucket, slot, devices)
            # A push cancelled while this bucket was packed ends here, not later.
            await anyio.lowlevel.checkpoint_if_cancelled()
            return handles
        except BaseException:
            # The push is over: close the stream now rather than at the next push, after
            # a pack already started (the limiter), which would otherwise find it closed.
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_WAIT):
                await anyio.to_thread.run_sync(
                    self._fail_feed, limiter=self._limiter, abandon_on_cancel=True
                )
            raise
        finally:
            advanced, self._advanced = self._advanced, None
            if advanced is not None:
                advanced.set()

    async def aclose(self) -> None:
        """Free the slots and close an open stream: off the event loop, after a pack
        still running; also when cancelled (the close goes on in its thread)."""
        self._prepared = False
        await self._close_in_thread(self._close_all)

    def _close_all(self) -> None:
        try:
            self._feed.end()
        finally:
            self._close_slots()

    # --- packing (in a worker thread, holding the buffer lock) --------------------------

    def _error(self, bucket: Bucket) -> _Error:
        return lambda parameter, detail: PackError(self._name, bucket.index, parameter, detail)

    def _fill(self, bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
        try:
            return self._fill_from(bucket, buffer)
        except BaseException:
            self._feed.failed()
            raise

    def _fill_from(self, bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
        entries = {e.name: e for e in bucket.entries}
        packed: dict[str, torch.Tensor] = {}
        error = self._error(bucket)

        def pending() -> str:
            return next((e.name for e in bucket.entries if e.name not in packed), "-")

        last = bucket.index == self._buckets - 1
        items = self._feed.take(bucket, self._bucket_of, last, error)  # runs on next()
        try:
            while True:
                try:
                    item = next(items)
                except StopIteration:
                    break
                except PackError:
                    raise
                except Exception as exc:
                    raise error(
                        pending(), f"the conversion raised {type(exc).__name__}: {exc}"
                    ) from exc
                pair = _pair(item)
                if pair is None:
                    raise error(pending(), _not_a_pair(item))
                del item
                name, tensor = pair
                del pair
                entry = entries.get(name)
                if entry is None:
                    raise error(name, self._stranger(name, bucket))
                if name in packed:
                    raise error(name, "was yielded twice for this bucket")
                packed[name] = self._place(buffer, bucket, entry, tensor)
                del tensor  # packed: only the slot holds its bytes now
        finally:
            _close(items)
        missing = [e.name for e in bucket.entries if e.name not in packed]
        if missing:
            more = f" (and {len(missing) - 1} more of the bucket)" if len(missing) > 1 else ""
            raise error(missing[0], f"was never yielded by the conversion{more}")
        return [packed[e.name] for e in bucket.entries]

    def _stranger(self, name: str, bucket: Bucket) -> str:
        home = self._bucket_of.get(name)
        if home is None:
            return "is not among the specs (the engine takes no parameter of that name)"
        return f"is not a parameter of this bucket (it is in bucket {home})"

    def _place(
        self, buffer: torch.Tensor, bucket: Bucket, entry: TensorEntry, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Copy ``tensor`` into ``entry``'s place, cast to the entry's dtype."""
        error = self._error(bucket)
        if tuple(tensor.shape) != entry.shape:
            raise error(
                entry.name,
                f"has shape {list(tensor.shape)}, the engine's is {list(entry.shape)}",
            )
        target = torch_dtype(entry.dtype)
        problem = cast_problem(tensor.dtype, target)
        if problem is not None:
            raise error(entry.name, f"has dtype {dtype_name(tensor.dtype)}: {problem}")
        with self._packing(bucket.index, entry):
            dst = entry_view(buffer, entry)
            dst.view(entry.shape).copy_(tensor)
        return dst
