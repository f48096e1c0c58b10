"""Direct writes: a source of this process writes buckets into workers' own memory.

:class:`DirectWriter` is what :class:`~asyncrefit.LocalTrainer` adds to be a
:class:`~asyncrefit.abc.WritingSource`: it opens the destinations a
:class:`~asyncrefit.abc.DirectWorker` exported
(:func:`~asyncrefit.transport.destinations.open_destinations`), checks them against
the plan, and writes each bucket's tensors straight into every attached worker's
places, casting on the way, from the trainer's own tensors (or strided slices of
them, for a checkpoint layout): one copy per byte, nothing staged.

It runs in the source's packing thread, under its buffer lock (the
:class:`~asyncrefit.trainer._local._SourceBase` machinery): a close waits for a write
still running. On a GPU the copies are issued on the thread's current stream and on
side streams of the same device that fork from it as a write starts and join it as the
write ends, so the copies of a push overlap each other's ramp-up and tail; the
completion events are recorded after the join. :meth:`DirectWriter.flush` ends them:
it records each worker's completion event after them (the worker waits for it at its
commit) or waits for them; on the CPU they are complete on return.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .._exceptions import ClosedError, ParameterMismatchError
from ..transport.destinations import Box, OpenedDestinations, open_destinations
from ._slices import Lazy, Slices, rows_of

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket, Plan, TensorEntry
    from .._gate import WriteGate
    from ..transport.destinations import Destinations

logger = logging.getLogger(__name__)


class DirectWriter:
    """The writing half of a source of this process (a mixin of ``_SourceBase``)."""

    #: Whether this kind of source writes directly at all (a subclass whose packing
    #: takes part in collectives, or that transmits by one, says no).
    _writes_direct = True

    #: How many CUDA streams a GPU write spreads its copies over: the thread's current
    #: one and side streams forked from it (1: every copy on the current stream). On an
    #: H100, copying the 7B set tensor by tensor took 9.79 ms of GPU time on one stream
    #: and 9.08 ms on two, against 8.85 ms for one flat copy of the same bytes: each
    #: copy's start and tail leave the GPU partly idle unless another copy overlaps it
    #: (``benchmarks/copy_issue_probe.py``).
    _copy_streams = 2

    # Provided by the source this is mixed into.
    _name: str
    _node: str
    _devices: frozenset[str] | None
    _limiter: anyio.CapacityLimiter
    _buffer_lock: Any

    def _init_direct(self) -> None:
        self._attached: dict[str, OpenedDestinations] = {}
        # (bucket index, workers, streams) -> every place written, in write order,
        # whether one ``_foreach_copy_`` writes them (see ``_one_call``), and which of
        # them each stream copies (see ``_split``).
        self._targets: dict[tuple[int, tuple[str, ...], int], _Known] = {}
        # Device index -> the side streams of GPU writes there (made once).
        self._side_streams: dict[int, list[Any]] = {}
        # The workers written on a GPU since the last flush whose completion event was
        # not recorded after those writes (a flush then has something left to do).
        self._unended: set[str] = set()

    # Provided by the source this is mixed into.
    def _read(self) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def _tensor(
        self, tensors: Mapping[str, torch.Tensor], bucket: int, entry: TensorEntry
    ) -> torch.Tensor:
        raise NotImplementedError

    def _packing(self, bucket: int, entry: TensorEntry) -> Any:
        raise NotImplementedError

    def _copy_into(self, dst: torch.Tensor, tensor: torch.Tensor | Lazy, name: str) -> None:
        raise NotImplementedError

    # --- attaching ---------------------------------------------------------------------

    async def attach(self, worker: str, destinations: Destinations, plan: Plan) -> bool:
        """Open ``worker``'s destinations for ``plan``: whether this source writes there.

        ``False`` (the worker is then sent staged buckets) for destinations on another
        node or on a device this source does not serve; :class:`TransportError` if
        they cannot be opened, :class:`ParameterMismatchError` if a planned parameter
        has no place there of its shape and dtype.
        """
        where = destinations.device
        if (
            not self._writes_direct
            or where.node != self._node
            or (self._devices is not None and where.device not in self._devices)
        ):
            return False
        if destinations.kind == "cuda_ipc":
            import torch

            if not torch.cuda.is_available():
                return False
        known = self._attached.get(worker)
        if known is None or known.destinations != destinations:
            opened = await anyio.to_thread.run_sync(
                open_destinations, destinations, limiter=self._limiter
            )
            _check_places(worker, opened, plan)
            with self._buffer_lock:
                self._attached[worker] = opened
                self._targets.clear()
        else:
            _check_places(worker, known, plan)
        return True

    async def detach(self, worker: str) -> None:
        """Close what :meth:`attach` opened for ``worker`` (nothing if it is not attached)."""
        await anyio.to_thread.run_sync(self._detach, worker, limiter=self._limiter)

    def _detach(self, worker: str) -> None:
        with self._buffer_lock:
            opened = self._attached.pop(worker, None)
            self._targets.clear()
        if opened is not None:
            opened.close()

    def _close_direct(self) -> None:
        """Close every worker's destinations (under the buffer lock, from a close)."""
        for opened in self._attached.values():
            opened.close()
        self._attached.clear()
        self._targets.clear()
        self._unended.clear()

    # --- writing -----------------------------------------------------------------------

    async def write(self, buckets: Sequence[Bucket], workers: Sequence[str]) -> None:
        """Write the tensors of ``buckets`` into each of ``workers``' places (attached
        first), in one hand-off to the source's thread.

        Complete on return on the CPU; on a GPU, issued (see :meth:`flush`), and the
        completion event of each worker that exported one recorded after them, from
        the same thread: ``flush(wait=False)`` then needs no hand-off of its own. A
        tensor that cannot be written raises :class:`~asyncrefit.PackError` naming it.
        """
        await anyio.to_thread.run_sync(
            self._write_all, tuple(buckets), tuple(workers), None, limiter=self._limiter
        )

    async def write_gated(
        self, buckets: Sequence[Bucket], workers: Sequence[str], gate: WriteGate
    ) -> bool:
        """:meth:`write`, handed to the source's thread before the workers began (and
        before the push read the trainer's tensors): the thread waits for ``gate``,
        then writes at once, bucket after bucket while the gate is not stopped.
        ``False`` if the gate was shut (nothing written) or stopped before the last
        bucket (see :class:`~asyncrefit.abc.GatedWritingSource`)."""
        return await anyio.to_thread.run_sync(
            self._write_all, tuple(buckets), tuple(workers), gate, limiter=self._limiter
        )

    async def flush(self, *, wait: bool = True) -> None:
        """End the writes issued on a GPU (nothing to do on the CPU).

        ``wait``: return once they ran. Otherwise a worker that exported a completion
        event gets it recorded after them (it waits for it at its commit), and only
        the devices of the others are waited for.
        """
        if not wait and not self._unended:
            return  # every write's completion event was recorded after it (or on the CPU)
        attached = [
            o for o in self._attached.values() if o.device is not None and o.device.type == "cuda"
        ]
        if attached:
            await anyio.to_thread.run_sync(_end_writes, attached, wait, limiter=self._limiter)
        self._unended.clear()

    def _write_all(
        self, buckets: tuple[Bucket, ...], workers: tuple[str, ...], gate: WriteGate | None
    ) -> bool:
        """Write every bucket (after ``gate`` opened, if any: ``False`` if it was shut
        first, or stopped before the last bucket).

        The gate is waited for first: the trainer's tensors to write are those the
        push read, which it may not have read yet.
        """
        if gate is not None and not gate.wait():
            return False  # nothing was written
        self._unended.update(workers)
        lanes = self._fork(workers)
        try:
            for bucket in buckets:
                if gate is not None and gate.stopped:
                    return False  # the push failed or was cancelled: no further bucket
                self._write(bucket, workers, lanes)
        finally:
            if lanes is not None:  # the current stream's later work (and the completion
                for side in lanes[1:]:  # events, the synchronize of a flush) follows all
                    lanes[0].wait_stream(side)
        with self._buffer_lock:
            for worker in workers:
                opened = self._attached.get(worker)
                if opened is None:
                    continue  # detached meanwhile: left to the flush
                on_gpu = opened.device is not None and opened.device.type == "cuda"
                if not on_gpu or opened.mark():
                    self._unended.discard(worker)
        return True

    def _fork(self, workers: tuple[str, ...]) -> list[Any] | None:
        """The streams a write into ``workers`` spreads its copies over: the current
        stream first, then side streams made to wait for the current one's work so far
        (the trainer's tensors as written). ``None``: one stream (the CPU, one stream
        configured, or a worker on another device than the current one)."""
        if self._copy_streams < 2:
            return None
        import torch

        with self._buffer_lock:
            opened = [self._attached.get(w) for w in workers]
        devices = {o.device for o in opened if o is not None}
        if len(devices) != 1:
            return None
        (device,) = devices
        if device is None or device.type != "cuda":
            return None
        current = torch.cuda.current_stream()
        if current.device != device:
            return None
        side = self._side_streams.get(current.device_index)
        if side is None or len(side) != self._copy_streams - 1:
            side = [torch.cuda.Stream(device) for _ in range(self._copy_streams - 1)]  # type: ignore[no-untyped-call]
            self._side_streams[current.device_index] = side
        for stream in side:
            stream.wait_stream(current)
        return [current, *side]

    def _write(self, bucket: Bucket, workers: tuple[str, ...], lanes: list[Any] | None) -> None:
        import torch

        with self._buffer_lock:
            streams = 1 if lanes is None else len(lanes)
            key = (bucket.index, workers, streams)
            known = self._targets.get(key)
            if known is None:
                places = self._places(bucket, workers)
                known = (places, _one_call(places), _split(places, streams))
                self._targets[key] = known
            targets, one_call, split = known
            sources = self._sources(bucket, self._read())
            with torch.no_grad():
                plain = [_block(sources[i], box) for _, i, box in targets]
                if one_call and all(isinstance(t, torch.Tensor) for t in plain):
                    try:
                        torch._foreach_copy_([d for d, _, _ in targets], plain)  # type: ignore[arg-type]
                        return
                    except Exception:
                        pass  # one by one below: the failure then names its parameter
                if lanes is None or split is None:
                    self._issue(bucket, targets, sources, plain, range(len(targets)))
                    return
                for lane, ks in zip(lanes, split, strict=True):
                    with torch.cuda.stream(lane):
                        self._issue(bucket, targets, sources, plain, ks)

    def _issue(
        self,
        bucket: Bucket,
        targets: list[Target],
        sources: list[torch.Tensor | Lazy],
        plain: list[torch.Tensor | Lazy],
        ks: Sequence[int],
    ) -> None:
        """Copy targets ``ks`` of ``bucket`` one by one (on the current stream); a
        failure raises :class:`~asyncrefit.PackError` naming its entry."""
        entries, k = bucket.entries, 0
        try:
            for k in ks:
                dst, i, box = targets[k]
                source = plain[k]
                if box is not None and source is sources[i]:  # a block to cut
                    source = self._materialized(sources[i], dst.device, entries[i].name)[box]
                self._copy_into(dst, source, entries[i].name)
        except Exception:
            with self._packing(bucket.index, entries[targets[k][1]]):
                raise

    def _sources(
        self, bucket: Bucket, tensors: Mapping[str, torch.Tensor]
    ) -> list[torch.Tensor | Lazy]:
        """The trainer's tensor of every entry of ``bucket`` (rows, for a part), checked
        (see ``_tensor``); a failure raises :class:`~asyncrefit.PackError` naming its
        entry. No context per entry: every push does this for every tensor."""
        sources: list[torch.Tensor | Lazy] = []
        entries, index = bucket.entries, bucket.index
        try:  # (extend keeps what came before a failure: its count names the entry)
            sources.extend(rows_of(self._tensor(tensors, index, e), e.part) for e in entries)
        except Exception:
            with self._packing(index, entries[len(sources)]):
                raise
        return sources

    def _materialized(
        self, source: torch.Tensor | Lazy, device: torch.device, name: str
    ) -> torch.Tensor:
        """An engine tensor made of several pieces, in a tensor of its own (a block
        that is not rows of it is cut from that)."""
        import torch

        if isinstance(source, torch.Tensor):
            return source
        whole = torch.empty(source.shape, dtype=source.dtype, device=device)
        self._copy_into(whole, source, name)
        return whole

    def _places(self, bucket: Bucket, workers: tuple[str, ...]) -> list[Target]:
        places: list[Target] = []
        for worker in workers:
            opened = self._attached.get(worker)
            if opened is None:
                raise ClosedError(
                    f"trainer source {self._name!r} has no destinations of worker {worker!r}"
                )
            for i, e in enumerate(bucket.entries):
                for place, box in opened.places[e.name]:
                    cut = _cut(place, box, e.part)
                    if cut is not None:
                        places.append((cut[0], i, cut[1]))
        return places


#: What a bucket's write into some workers needs, worked out once: its targets, whether
#: one ``_foreach_copy_`` writes them, and which of them each stream copies.
_Known = tuple[list["Target"], bool, "list[list[int]] | None"]

#: Where one tensor of a bucket goes: the place, the entry's index in the bucket, and
#: the block of the entry's tensor (as sent: rows of a part) written there (``None``:
#: all of it).
Target = tuple["torch.Tensor", int, "tuple[slice, ...] | None"]


def _cut(
    place: torch.Tensor, box: Box | None, part: tuple[int, int] | None
) -> tuple[torch.Tensor, tuple[slice, ...] | None] | None:
    """The piece of ``place`` that a bucket entry (rows ``part`` of its tensor) fills,
    and the block of the entry that goes there; ``None`` if it fills nothing."""
    if box is None:
        return (place if part is None else place[part[0] : part[1]]), None
    block = [slice(a, b) for a, b in box]
    if part is None:
        return place, tuple(block)
    if not box:
        return place, ()
    (r0, r1), (a, b) = box[0], part
    lo, hi = max(a, r0), min(b, r1)
    if lo >= hi:
        return None
    block[0] = slice(lo - a, hi - a)
    return place[lo - r0 : hi - r0], tuple(block)


def _block(source: torch.Tensor | Lazy, box: tuple[slice, ...] | None) -> torch.Tensor | Lazy:
    """The block ``box`` of ``source``: a view of a plain tensor, rows of pieces; other
    blocks of pieces are cut when written (see ``DirectWriter._write``)."""
    if box is None:
        return source
    if isinstance(source, Slices):
        rest = box[1:]
        if all(s.start == 0 and s.stop == n for s, n in zip(rest, source.shape[1:], strict=True)):
            return source.rows(box[0].start, box[0].stop) if box else source
    if isinstance(source, Lazy):
        return source  # cut from the whole, once written
    return source[box]


#: A GPU bucket whose copies average at least this many bytes is written one copy per
#: tensor (each then runs at memcpy's rate); below it, one ``_foreach_copy_``.
_PER_TENSOR_BYTES = 1 << 20


def _one_call(targets: list[Target]) -> bool:
    if not targets:
        return False
    first = targets[0][0]
    if first.device.type == "cpu":
        return True
    nbytes = sum(d.numel() * d.element_size() for d, _, _ in targets)
    return nbytes < _PER_TENSOR_BYTES * len(targets)


def _split(targets: list[Target], streams: int) -> list[list[int]] | None:
    """Which targets each of ``streams`` streams copies (indices, in write order), the
    bytes balanced greedily; ``None``: all on one (one stream, or one target)."""
    if streams < 2 or len(targets) < 2:
        return None
    loads = [0] * streams
    split: list[list[int]] = [[] for _ in range(streams)]
    for k, (dst, _, _) in enumerate(targets):
        lane = loads.index(min(loads))
        split[lane].append(k)
        loads[lane] += dst.numel() * dst.element_size()
    return split


def _end_writes(attached: list[OpenedDestinations], wait: bool) -> None:
    """Record each worker's completion event (unless ``wait``), then wait for the
    devices of the workers that have none (of all of them with ``wait``)."""
    import torch

    devices = {o.device for o in attached if wait or not o.mark()}
    for device in devices:
        torch.cuda.synchronize(device)


def _check_places(worker: str, opened: OpenedDestinations, plan: Plan) -> None:
    """Raise :class:`ParameterMismatchError` unless every planned parameter has its place."""
    from .._dtypes import dtype_name

    for spec in plan.params:
        places = opened.places.get(spec.name)
        if not places:
            raise ParameterMismatchError(worker, spec.name, "has no place in its destinations")
        shape = tuple(spec.shape)
        for place, box in places:
            got = (tuple(place.shape), dtype_name(place.dtype))
            if box is None and got != (shape, spec.dtype):
                raise ParameterMismatchError(
                    worker,
                    spec.name,
                    f"its destination is {got[1]}{list(got[0])}, the plan sends "
                    f"{spec.dtype}{list(shape)}",
                )
            if box is not None and (
                got[1] != spec.dtype
                or len(box) != len(shape)
                or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape, strict=False))
            ):
                raise ParameterMismatchError(
                    worker,
                    spec.name,
                    f"its destination holds block {[list(b) for b in box]} as {got[1]}, "
                    f"the plan sends {spec.dtype}{list(shape)}",
                )
