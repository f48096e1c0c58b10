"""``asyncrefit bench`` and ``asyncrefit plan``: refit throughput against memcpy.

The benchmark pushes a synthetic, transformer-like parameter set (~200 tensors of
mixed shapes, float32 and bfloat16) into two local worker processes and measures, in
one run:

- memcpy: the same tensors copied once into one preallocated flat buffer (what packing
  costs at best), and one contiguous copy of the same byte count;
- asyncrefit: filtered dispatch, two staging slots (two buckets in flight);
- the same with the trainer exporting for 8 virtual devices (filtered: the bytes sent
  to a worker must not change);
- baseline A, "broadcast all": every worker is sent the handles of all 8 devices;
- baseline B, "one bucket in flight": one staging slot, so the trainer waits for every
  ack before packing the next bucket.

Every variant is verified once: the workers' parameter digests must equal the
trainer's, or :class:`VerificationError` is raised.

With ``--trace`` / ``--timeline``, one more push of the asyncrefit variant, after the
timed ones and not timed, is recorded (its :mod:`asyncrefit.events`) and written as a
Chrome trace and / or drawn as a PNG by :mod:`asyncrefit.tools.timeline`.

The scripts in ``benchmarks/`` share its helpers: parameter sets (:func:`llama_specs`,
:func:`module_from_specs`), the memcpy limit (:func:`measure_memcpy`) and the median
push (:func:`median_push`); the machine's description is in
:mod:`asyncrefit.tools._machine`, the check of the workers in
:mod:`asyncrefit.tools._verify`, tables and filing results in
:mod:`asyncrefit.tools._table`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from .._core._coordinator import RefitCoordinator
from .._core._plan import DEFAULT_ALIGNMENT, ParamSpec, plan_buckets
from .._device import DeviceId, cpu_device
from .._dtypes import torch_dtype
from .._exceptions import PlanError
from .._loop import backend_options
from .._wire._messages import LoadBucket, encode, encoded_size
from ..trainer._local import LocalTrainer
from ..trainer._shared import SharedParameterTrainer
from ..transport._base import Handle
from ._machine import machine_info, machine_line
from ._table import Column, table
from ._verify import VerificationError, module_digests, verify_workers

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket
    from .._core._report import RefitReport
    from ..events import PushEvent
    from ..local import LocalWorker

MIB = 2**20
#: The bucket size the benchmark uses at most (256 MiB); smaller sets use a quarter.
MAX_BUCKET_BYTES = 256 * MIB
#: Transformer blocks of the synthetic parameter set (12 tensors each, 5 more around).
LAYERS = 16
#: Worker processes (each on its own virtual device, ``cpu:0`` and ``cpu:1``).
WORKERS = 2
#: Virtual devices the trainer exports for in the 8-device variants.
EXPORTED_DEVICES = 8
#: Timed runs of each memcpy measurement (the median is reported).
MEMCPY_RUNS = 5

Progress = Callable[[str], None]


# --- the synthetic parameter set ------------------------------------------------------


def _layout(d: int, vocab: int) -> list[ParamSpec]:
    ff = 4 * d
    specs = [
        ParamSpec(name="embed.weight", shape=(vocab, d), dtype="float32"),
        ParamSpec(name="pos_embed.weight", shape=(d, d), dtype="float32"),
    ]
    for i in range(LAYERS):
        w = "float32" if i % 2 == 0 else "bfloat16"  # alternate: mixed dtypes
        p = f"layers.{i}"
        specs += [
            ParamSpec(name=f"{p}.attn_norm.weight", shape=(d,), dtype="float32"),
            ParamSpec(name=f"{p}.attn_norm.bias", shape=(d,), dtype="float32"),
            ParamSpec(name=f"{p}.attn.qkv.weight", shape=(3 * d, d), dtype=w),
            ParamSpec(name=f"{p}.attn.qkv.bias", shape=(3 * d,), dtype="float32"),
            ParamSpec(name=f"{p}.attn.out.weight", shape=(d, d), dtype=w),
            ParamSpec(name=f"{p}.attn.out.bias", shape=(d,), dtype="float32"),
            ParamSpec(name=f"{p}.mlp_norm.weight", shape=(d,), dtype="float32"),
            ParamSpec(name=f"{p}.mlp_norm.bias", shape=(d,), dtype="float32"),
            ParamSpec(name=f"{p}.mlp.up.weight", shape=(ff, d), dtype=w),
            ParamSpec(name=f"{p}.mlp.up.bias", shape=(ff,), dtype="float32"),
            ParamSpec(name=f"{p}.mlp.down.weight", shape=(d, ff), dtype=w),
            ParamSpec(name=f"{p}.mlp.down.bias", shape=(d,), dtype="float32"),
        ]
    specs += [
        ParamSpec(name="final_norm.weight", shape=(d,), dtype="float32"),
        ParamSpec(name="final_norm.bias", shape=(d,), dtype="float32"),
        ParamSpec(name="lm_head.weight", shape=(vocab, d), dtype="bfloat16"),
    ]
    return specs


def synthetic_specs(size_mib: int) -> list[ParamSpec]:
    """The benchmark's parameter set: 197 tensors adding up to about ``size_mib`` MiB.

    A transformer-like mix: an embedding and an LM head (float32, bfloat16), 16 blocks
    of big 2-D matrices (float32 and bfloat16 in alternate blocks) and small float32
    vectors. The hidden size is a multiple of 16 chosen from the size; the vocabulary
    fills the rest, so the total is within a few KiB of the target. Deterministic.
    """
    if size_mib < 1:
        raise PlanError(f"size_mib must be at least 1, got {size_mib}")
    target = size_mib * MIB
    # The set is about 628 d^2 bytes when the vocabulary is 8 d.
    d = max(16, int(math.sqrt(target / 628)) // 16 * 16)
    rest = sum(s.nbytes for s in _layout(d, 0))
    vocab = max(16, (target - rest) // (6 * d))  # embed (4 B) + lm_head (2 B) per row
    return _layout(d, vocab)


def llama_specs(
    layers: int = 32,
    vocab: int = 32000,
    hidden: int = 4096,
    inter: int = 11008,
    *,
    dtype: str = "bfloat16",
) -> list[ParamSpec]:
    """The parameters of a Llama-2 model (defaults: Llama-2-7B, 291 tensors, 6.74 B values).

    Embedding, ``layers`` blocks of attention and MLP matrices and two norms, the final
    norm and the LM head, in Hugging Face's names and order, all of ``dtype``.
    """

    def spec(name: str, *shape: int) -> ParamSpec:
        return ParamSpec(name=name, shape=shape, dtype=dtype)

    specs = [spec("model.embed_tokens.weight", vocab, hidden)]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs += [
            spec(f"{p}.self_attn.q_proj.weight", hidden, hidden),
            spec(f"{p}.self_attn.k_proj.weight", hidden, hidden),
            spec(f"{p}.self_attn.v_proj.weight", hidden, hidden),
            spec(f"{p}.self_attn.o_proj.weight", hidden, hidden),
            spec(f"{p}.mlp.gate_proj.weight", inter, hidden),
            spec(f"{p}.mlp.up_proj.weight", inter, hidden),
            spec(f"{p}.mlp.down_proj.weight", hidden, inter),
            spec(f"{p}.input_layernorm.weight", hidden),
            spec(f"{p}.post_attention_layernorm.weight", hidden),
        ]
    specs += [spec("model.norm.weight", hidden), spec("lm_head.weight", vocab, hidden)]
    return specs


def module_from_specs(
    specs: Sequence[ParamSpec],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    root: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """A module holding one zero-filled, frozen ``Parameter`` per spec, under its dotted name.

    Submodules are made as the names need them; ``named_parameters()`` yields the
    specs in order. ``dtype`` overrides every spec's dtype; ``device`` may be
    ``"meta"`` (nothing allocated, for ``fully_shard`` then ``to_empty``). ``root``
    is the module to fill (a subclass with a ``forward``, say); default a new one.
    """
    import torch

    root = root if root is not None else torch.nn.Module()
    for spec in specs:
        *path, leaf = spec.name.split(".")
        module = root
        for part in path:
            child = getattr(module, part, None)
            if not isinstance(child, torch.nn.Module):
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        data = torch.zeros(
            spec.shape, dtype=dtype if dtype is not None else torch_dtype(spec.dtype), device=device
        )
        module.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
    return root


def synthetic_model(size_mib: int) -> torch.nn.Module:
    """A module holding :func:`synthetic_specs` as zero-filled ``Parameter``\\ s.

    ``named_parameters()`` yields them in the specs' order. Picklable as
    ``functools.partial(synthetic_model, size_mib)``: the worker factory.
    """
    return module_from_specs(synthetic_specs(size_mib))


def fill_random(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with normal random values (never left at zero)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(generator=gen)


def bucket_bytes_for(size_bytes: int) -> int:
    """The benchmark's bucket size: a quarter of the set, at most 256 MiB."""
    return max(MIB, min(MAX_BUCKET_BYTES, size_bytes // 4))


# --- memcpy, the limit ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemcpyResult:
    """Copy rates of the parameter set's bytes on this machine, in GB/s (1e9 B/s).

    ``gbps``: every tensor copied into one flat buffer, the best of the runs (the
    limit); ``contiguous_gbps``: one copy of the same byte count, best of the runs.
    """

    gbps: float
    median_gbps: float
    contiguous_gbps: float
    contiguous_median_gbps: float
    nbytes: int
    runs: int


def measure_memcpy(tensors: Sequence[torch.Tensor], runs: int = MEMCPY_RUNS) -> MemcpyResult:
    """Time copying ``tensors`` into a preallocated flat buffer, and one flat copy.

    Both destinations are touched before timing (no page faults are measured). Uses
    torch's default intra-op threads, like the trainer's packing does.
    """
    import torch

    offsets: list[int] = []
    end = 0
    for t in tensors:
        end = -(-end // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
        offsets.append(end)
        end += t.nbytes
    nbytes = sum(t.nbytes for t in tensors)
    flat = torch.empty(max(end, 1), dtype=torch.uint8)
    flat.fill_(1)
    views = [
        flat[o : o + t.nbytes].view(t.dtype).view(t.shape)
        for o, t in zip(offsets, tensors, strict=True)
    ]

    def pack() -> None:
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t)

    def timed(fn: Callable[[], None]) -> list[float]:
        fn()  # warm-up
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    with torch.no_grad():
        packed = timed(pack)
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(2)
        dst = flat[:nbytes]

        def copy() -> None:
            dst.copy_(src)

        contiguous = timed(copy)

    def rate(seconds: float) -> float:
        return nbytes / seconds / 1e9

    return MemcpyResult(
        gbps=rate(min(packed)),
        median_gbps=rate(statistics.median(packed)),
        contiguous_gbps=rate(min(contiguous)),
        contiguous_median_gbps=rate(statistics.median(contiguous)),
        nbytes=nbytes,
        runs=runs,
    )


# --- the refit variants ---------------------------------------------------------------


class RecordingExporter:
    """A shared-memory exporter that keeps the last handle it made per bucket and device.

    Used by baseline A to work out what its handles would cost if every device's handle
    were serialized on its own (see :meth:`independent_bytes`).
    """

    def __init__(self) -> None:
        from ..transport.shm import SharedMemoryExporter

        self._inner = SharedMemoryExporter()
        self.kind = self._inner.kind
        self.handles: dict[int, dict[DeviceId, Handle]] = {}

    def allocate(self, slots: int, slot_bytes: int) -> None:
        """Delegated."""
        self._inner.allocate(slots, slot_bytes)

    def buffer(self, slot: int) -> torch.Tensor:
        """Delegated."""
        return self._inner.buffer(slot)

    def seal(self, slot: int) -> None:
        """Delegated."""
        self._inner.seal(slot)

    def handle(self, slot: int, bucket: Bucket, device: DeviceId) -> Handle:
        """Delegated; the handle is recorded."""
        made = self._inner.handle(slot, bucket, device)
        self.handles.setdefault(bucket.index, {})[device] = made
        return made

    def close(self) -> None:
        """Delegated."""
        self._inner.close()

    def independent_bytes(self, version: int) -> int:
        """Bytes of one push's messages to one worker carrying every recorded handle,
        each handle serialized on its own.

        The coordinator's pickled message shares one layout (the bucket's entries) among
        the handles of all devices, so pickle writes it once. Handles made in separate
        processes, as for real per-device shards, share nothing: this counts them so.
        """
        total = 0
        for index, by_device in sorted(self.handles.items()):
            total += encoded_size(LoadBucket(version=version, bucket=index, handles=()))
            total += sum(len(encode(h)) for h in by_device.values())
        return total


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """How one benchmark variant configures the trainer and the coordinator."""

    key: str
    label: str
    exported_devices: int | None  # None: the trainer serves every device (2 are used)
    broadcast_all: bool
    one_in_flight: bool
    zero_copy: bool = False  # SharedParameterTrainer: the parameters are the buffers
    verify: bool = False  # checksum every bucket on both sides


VARIANTS = (
    Variant(
        key="asyncrefit",
        label="asyncrefit (filtered, 2 slots)",
        exported_devices=None,
        broadcast_all=False,
        one_in_flight=False,
    ),
    Variant(
        key="filtered_8_devices",
        label="asyncrefit, 8 devices exported",
        exported_devices=EXPORTED_DEVICES,
        broadcast_all=False,
        one_in_flight=False,
    ),
    Variant(
        key="broadcast_all",
        label="A: broadcast all (8 devices)",
        exported_devices=EXPORTED_DEVICES,
        broadcast_all=True,
        one_in_flight=False,
    ),
    Variant(
        key="one_in_flight",
        label="B: one bucket in flight",
        exported_devices=None,
        broadcast_all=False,
        one_in_flight=True,
    ),
    Variant(
        key="verify",
        label="asyncrefit, verify=True",
        exported_devices=None,
        broadcast_all=False,
        one_in_flight=False,
        verify=True,
    ),
    # Last: it moves the module's parameters into shared memory for good.
    Variant(
        key="zero_copy",
        label="asyncrefit, zero-copy trainer",
        exported_devices=None,
        broadcast_all=False,
        one_in_flight=False,
        zero_copy=True,
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class VariantResult:
    """The timed pushes of one variant (median) and what its median push reported."""

    key: str
    label: str
    gbps: float
    seconds: float
    seconds_all: list[float]
    ratio_to_memcpy: float
    handle_bytes_per_worker: int
    buckets: int
    slots: int
    slot_bytes: int
    exported_devices: int
    broadcast_all: bool
    stages: dict[str, float] = field(default_factory=dict)
    handle_bytes_per_worker_independent: int | None = None
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


def median_push(timed: Sequence[tuple[float, RefitReport]]) -> tuple[float, RefitReport]:
    """The median of timed pushes, ``(seconds, report)`` (the lower one of an even count)."""
    ordered = sorted(timed, key=lambda tr: tr[0])
    return ordered[(len(ordered) - 1) // 2]


async def _run_variant(
    variant: Variant,
    *,
    module: torch.nn.Module,
    workers: Sequence[LocalWorker],
    bucket_bytes: int,
    repeats: int,
    memcpy_gbps: float,
    seed: int,
    record: list[PushEvent] | None = None,
) -> VariantResult:
    await anyio.to_thread.run_sync(fill_random, module, seed)
    devices = (
        None
        if variant.exported_devices is None
        else [cpu_device(i) for i in range(variant.exported_devices)]
    )
    exporter = RecordingExporter() if variant.broadcast_all else None
    trainer: LocalTrainer | SharedParameterTrainer
    if variant.zero_copy:
        trainer = SharedParameterTrainer(module, devices=devices)
    else:
        trainer = LocalTrainer(module, devices=devices, exporter=exporter)
    if variant.one_in_flight:
        plan = plan_buckets(trainer.specs(), bucket_bytes)
        budget = plan.max_bucket_bytes  # room for exactly one bucket: one slot
    else:
        budget = 2 * bucket_bytes
    timed: list[tuple[float, RefitReport]] = []
    async with RefitCoordinator(
        trainer=trainer,
        workers=workers,
        budget_bytes=budget,
        bucket_bytes=bucket_bytes,
        broadcast_all_handles=variant.broadcast_all,
        verify=variant.verify,
    ) as refit:
        await refit.push(version=1)  # warm-up: maps the slots, faults the workers' pages
        for r in range(repeats):
            t0 = time.perf_counter()
            report = await refit.push(version=2 + r)
            timed.append((time.perf_counter() - t0, report))
        if record is not None:  # one more push, not timed, with its events recorded
            unsubscribe = refit.subscribe(record.append)
            try:
                await refit.push(version=2 + repeats)
            finally:
                unsubscribe()
    expected = await anyio.to_thread.run_sync(module_digests, module)
    await verify_workers(workers, expected, what=f"variant {variant.key!r}")
    independent = exporter.independent_bytes(1 + repeats) if exporter is not None else None

    seconds, report = median_push(timed)
    if variant.zero_copy:  # stages nothing: every bucket in flight
        expected_slots = report.buckets
    else:
        expected_slots = 1 if variant.one_in_flight else min(2, report.buckets)
    if report.slots != expected_slots:
        raise VerificationError(
            f"variant {variant.key!r} ran with {report.slots} slots, not {expected_slots}"
        )
    gbps = report.bytes / seconds / 1e9
    return VariantResult(
        key=variant.key,
        label=variant.label,
        gbps=gbps,
        seconds=seconds,
        seconds_all=[s for s, _ in timed],
        ratio_to_memcpy=gbps / memcpy_gbps,
        handle_bytes_per_worker=max(report.handle_bytes_per_worker.values()),
        buckets=report.buckets,
        slots=report.slots,
        slot_bytes=report.slot_bytes,
        exported_devices=variant.exported_devices or len(workers),
        broadcast_all=variant.broadcast_all,
        stages=asdict(report.stages),
        handle_bytes_per_worker_independent=independent,
        verified=True,
    )


async def run_bench(
    size_mib: int,
    repeats: int,
    *,
    threads: int | None = None,
    progress: Progress | None = None,
    record: list[PushEvent] | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark once; returns a JSON-ready dict.

    ``threads`` sets torch's intra-op threads of this process (the trainer's packing
    and the memcpy reference) for the run, restored afterwards; by default torch's
    own. Worker processes copy with one thread each, as ``spawn_local_workers`` does by
    default. ``progress`` is called with a line before each phase. With ``record``,
    one more push of the asyncrefit variant (after its timed ones, not timed) is made
    and its events are appended to that list.

    Keys: ``memcpy_gbps`` (the limit: every tensor copied into one flat buffer, best
    of several runs; ``memcpy_median_gbps`` too), ``memcpy_contiguous_gbps``,
    ``refit_gbps`` and ``ratio_to_memcpy``
    (asyncrefit, median of ``repeats`` timed pushes after one warm-up),
    ``handle_bytes_per_worker`` (per push), ``stages``, ``baselines``
    (``broadcast_all``: gbps, seconds, handle_bytes_per_worker; ``one_in_flight``:
    gbps, seconds), ``filtered_8_devices``, ``variants`` (every row), ``machine``,
    ``size_bytes``, ``date`` and the set-up. Raises :class:`VerificationError`
    if a worker does not hold the trainer's bytes after a variant.
    """
    if size_mib < 1 or repeats < 1:
        raise ValueError(f"size_mib and repeats must be positive, got {size_mib}, {repeats}")
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return await _run_bench(size_mib, repeats, progress, record)
    finally:
        torch.set_num_threads(before)


async def _run_bench(
    size_mib: int, repeats: int, progress: Progress | None, record: list[PushEvent] | None
) -> dict[str, Any]:
    say: Progress = progress if progress is not None else (lambda _: None)
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = machine_info()

    say(f"building a {size_mib} MiB parameter set")
    module = await anyio.to_thread.run_sync(synthetic_model, size_mib)
    await anyio.to_thread.run_sync(fill_random, module, 0)
    tensors = [p.detach() for p in module.parameters()]
    size_bytes = sum(t.nbytes for t in tensors)
    bucket_bytes = bucket_bytes_for(size_bytes)

    say("measuring memcpy")
    memcpy = await anyio.to_thread.run_sync(measure_memcpy, tensors)
    del tensors

    results: dict[str, VariantResult] = {}
    say(f"starting {WORKERS} workers")
    from ..local import spawn_local_workers

    async with spawn_local_workers(
        functools.partial(synthetic_model, size_mib), WORKERS
    ) as workers:
        for seed, variant in enumerate(VARIANTS, start=1):
            say(f"variant {variant.label}")
            results[variant.key] = await _run_variant(
                variant,
                module=module,
                workers=workers,
                bucket_bytes=bucket_bytes,
                repeats=repeats,
                memcpy_gbps=memcpy.gbps,
                seed=seed,
                record=record if variant.key == "asyncrefit" else None,
            )

    main, a, b = results["asyncrefit"], results["broadcast_all"], results["one_in_flight"]
    zero, verified = results["zero_copy"], results["verify"]
    return {
        "date": date,
        "machine": machine,
        "size_bytes": size_bytes,
        "tensors": len(list(module.parameters())),
        "workers": WORKERS,
        "bucket_bytes": bucket_bytes,
        "budget_bytes": 2 * bucket_bytes,
        "repeats": repeats,
        "memcpy_gbps": memcpy.gbps,
        "memcpy_median_gbps": memcpy.median_gbps,
        "memcpy_contiguous_gbps": memcpy.contiguous_gbps,
        "memcpy_contiguous_median_gbps": memcpy.contiguous_median_gbps,
        "memcpy_runs": memcpy.runs,
        "refit_gbps": main.gbps,
        "refit_seconds": main.seconds,
        "ratio_to_memcpy": main.ratio_to_memcpy,
        "handle_bytes_per_worker": main.handle_bytes_per_worker,
        "refit_zero_copy_gbps": zero.gbps,
        "refit_zero_copy_seconds": zero.seconds,
        "ratio_to_memcpy_zero_copy": zero.ratio_to_memcpy,
        "verify_gbps": verified.gbps,
        "verify_cost": verified.seconds / main.seconds - 1,
        "buckets": main.buckets,
        "stages": main.stages,
        "filtered_8_devices": {
            "gbps": results["filtered_8_devices"].gbps,
            "seconds": results["filtered_8_devices"].seconds,
            "handle_bytes_per_worker": results["filtered_8_devices"].handle_bytes_per_worker,
        },
        "baselines": {
            "broadcast_all": {
                "gbps": a.gbps,
                "seconds": a.seconds,
                "handle_bytes_per_worker": a.handle_bytes_per_worker,
                "handle_bytes_per_worker_independent": a.handle_bytes_per_worker_independent,
                "ratio_to_memcpy": a.ratio_to_memcpy,
            },
            "one_in_flight": {
                "gbps": b.gbps,
                "seconds": b.seconds,
                "ratio_to_memcpy": b.ratio_to_memcpy,
            },
        },
        "variants": [r.to_dict() for r in results.values()],
    }


# --- output ---------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    """The benchmark's result as a plain-text table with the machine it ran on."""
    m = result["machine"]
    nbytes = result["size_bytes"]
    memcpy = result["memcpy_gbps"]
    lines = [
        f"asyncrefit bench, {result['date']}",
        machine_line(m),
        f"set: {nbytes / MIB:.1f} MiB in {result['tensors']} tensors (float32/bfloat16); "
        f"{result['workers']} worker processes; bucket {result['bucket_bytes'] / MIB:.0f} MiB; "
        f"median of {result['repeats']} timed pushes after 1 warm-up; memcpy: best of "
        f"{result['memcpy_runs']}",
        "",
    ]
    columns = (
        Column("variant", 34, left=True),
        Column("GB/s", 7, ".2f"),
        Column("x memcpy", 10, ".2f"),
        Column("ms/push", 10, ".1f"),
        Column("handle B/worker", 17, ","),
        Column("buckets", 9),
        Column("slots", 7),
    )
    rows: list[tuple[object, ...]] = [
        (label, gbps, gbps / memcpy, nbytes / gbps / 1e6, "-", "-", "-")
        for label, gbps in (
            ("memcpy, tensors into flat buffer", memcpy),
            ("memcpy, one contiguous copy", result["memcpy_contiguous_gbps"]),
        )
    ]
    rows += [
        (
            v["label"],
            v["gbps"],
            v["ratio_to_memcpy"],
            v["seconds"] * 1e3,
            v["handle_bytes_per_worker"],
            v["buckets"],
            v["slots"],
        )
        for v in result["variants"]
    ]
    lines += table(columns, rows)
    stages = ", ".join(f"{k} {s * 1e3:.1f}" for k, s in result["stages"].items())
    filtered = result["handle_bytes_per_worker"]
    a = result["baselines"]["broadcast_all"]
    lines += [
        "",
        f"asyncrefit stages, median push (ms; pack and load are sums over buckets and "
        f"overlap): {stages}",
        f"handle bytes per worker per push: filtered {filtered:,} (2 devices), "
        f"{result['filtered_8_devices']['handle_bytes_per_worker']:,} (8 devices); "
        f"broadcast all {a['handle_bytes_per_worker']:,} on the wire "
        f"({a['handle_bytes_per_worker'] / filtered:.2f}x: pickle writes the shared layout "
        f"once), {a['handle_bytes_per_worker_independent']:,} with each device's handle "
        f"serialized on its own ({a['handle_bytes_per_worker_independent'] / filtered:.2f}x)",
        f"verify=True costs {result['verify_cost']:+.0%} push time (CRC-32 on both sides)",
        f"target asyncrefit >= 40% of memcpy: {result['ratio_to_memcpy']:.0%} with staging "
        f"slots (pack + 2 loads: 3 copies), {result['ratio_to_memcpy_zero_copy']:.0%} with the "
        f"zero-copy trainer (2 copies)",
    ]
    return "\n".join(lines)


def run(
    size_mib: int,
    repeats: int,
    *,
    threads: int | None = None,
    progress: Progress | None = None,
    record: list[PushEvent] | None = None,
) -> dict[str, Any]:
    """:func:`run_bench` on a fresh event loop (uvloop when it imports)."""
    return anyio.run(
        functools.partial(
            run_bench, size_mib, repeats, threads=threads, progress=progress, record=record
        ),
        backend="asyncio",
        backend_options=backend_options(),
    )


def progress_line(message: str) -> None:
    """Print a progress line to stderr."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    """``asyncrefit bench``: run the benchmark, print a table or (``--json``) JSON.

    ``--trace PATH`` / ``--timeline PATH`` (attributes ``trace`` / ``timeline``, absent
    or ``None`` for neither) write one recorded push as a Chrome trace (JSON) / a PNG;
    without matplotlib, ``--timeline`` is refused (status 2) before anything runs.
    """
    if args.size_mib < 1 or args.repeats < 1:
        print("asyncrefit bench: --size-mib and --repeats must be positive", file=sys.stderr)
        return 2
    trace_path, timeline_path = getattr(args, "trace", None), getattr(args, "timeline", None)
    if timeline_path is not None:
        from .timeline import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            print(f"asyncrefit bench: {exc}", file=sys.stderr)
            return 2
    record: list[PushEvent] | None = [] if trace_path or timeline_path else None
    try:
        result = run(args.size_mib, args.repeats, progress=progress_line, record=record)
    except VerificationError as exc:
        print(f"asyncrefit bench: VERIFICATION FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    if record is not None:
        from .timeline import chrome_trace, draw_timeline

        if trace_path is not None:
            with open(trace_path, "w", encoding="utf-8") as out:
                json.dump(chrome_trace(record), out)
            progress_line(f"wrote the trace of the recorded push to {trace_path}")
        if timeline_path is not None:
            draw_timeline(record, timeline_path)
            progress_line(f"drew the recorded push in {timeline_path}")
    return 0


def format_plan(size_mib: int, bucket_bytes: int) -> str:
    """The buckets of the synthetic ``size_mib`` set for ``bucket_bytes``, as a table."""
    specs = synthetic_specs(size_mib)
    plan = plan_buckets(specs, bucket_bytes)
    lines = [
        f"synthetic set: {len(specs)} tensors, {plan.payload_bytes / MIB:.2f} MiB; "
        f"bucket {bucket_bytes / MIB:g} MiB, alignment {plan.alignment} B",
        "",
    ]
    columns = (
        Column("bucket", 6),
        Column("tensors", 9),
        Column("MiB", 10, ".2f"),
        Column("first .. last tensor", left=True, gap=2),
    )
    rows = [
        (b.index, len(b.entries), b.nbytes / MIB, f"{b.entries[0].name} .. {b.entries[-1].name}")
        for b in plan.buckets
    ]
    lines += table(columns, rows)
    padded = sum(b.nbytes for b in plan.buckets)
    lines += [
        "",
        f"total: {len(plan.buckets)} buckets, {len(specs)} tensors, "
        f"{plan.payload_bytes / MIB:.2f} MiB payload ({padded / MIB:.2f} MiB with padding); "
        f"largest bucket {plan.max_bucket_bytes / MIB:.2f} MiB, so 2 slots need "
        f"{2 * plan.max_bucket_bytes / MIB:.2f} MiB of staging",
    ]
    return "\n".join(lines)


def plan_main(args: argparse.Namespace) -> int:
    """``asyncrefit plan``: print how the synthetic set is cut into buckets."""
    try:
        print(format_plan(args.size_mib, int(args.bucket_mib * MIB)))
    except PlanError as exc:
        print(f"asyncrefit plan: {exc}", file=sys.stderr)
        return 2
    return 0
