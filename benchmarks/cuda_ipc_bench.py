"""CUDA IPC refit on one GPU: asyncrefit against the copy limit and two baselines.

    python benchmarks/cuda_ipc_bench.py --out results.json           # Llama-2-7B shapes
    python benchmarks/cuda_ipc_bench.py --layers 2 --repeats 2        # a quick check

A trainer process (this one) holds a parameter set with the shapes of Llama-2-7B in
bfloat16 (291 tensors, ~13.5 GB at 32 layers) and pushes it to 1 and to 2 inference
processes on the same GPU, each copying into its own parameter tensors. In one run:

- **limit**: device-to-device copies of the same tensors, in this process: once (the
  291 tensors into one flat buffer) and twice (into the flat buffer and out again into
  a second set of tensors: pack + load); CUDA events, median of ``--repeats``;
- **asyncrefit**: ``RefitCoordinator`` with ``CudaIpcExporter``, local worker
  processes, 2 slots (ping-pong), buckets of 256 MiB, 1 GiB and 2 GiB; the trainer
  source reads a name -> tensor mapping. Two more 1 GiB rows show what two choices
  cost: ``seal`` waiting on the host (``host_sync=True``) instead of ordering the
  consumers by the slot's event, and an ``nn.Module`` as the source (its
  ``named_parameters()`` walked for every bucket);
- **per-tensor handles** (the unpacked way): every push, one IPC handle per tensor
  (``reduce_tensor``), all sent at once to every consumer, which opens each, copies,
  synchronizes, drops them and answers (raw pipes, no coordinator);
- **lock-step, all handles to all** (vLLM's IPC backend today): asyncrefit's own
  pipeline with one 1 GiB slot (wait after each bucket), the pack synchronized on the
  host before the handles go out, and every consumer sent the handles of every
  device, as if each consumer were on its own GPU (TP = consumers).

Each variant is timed from the trainer's side (wall clock of a whole push), after one
warm-up push, median of ``--repeats``; GB/s is payload bytes / seconds / 1e9. After
each variant every consumer's parameters are compared with the trainer's by a GPU
checksum per tensor (two int64 sums over the bf16 bit patterns, one position-weighted).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import multiprocessing
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch

from asyncrefit import DeviceId, LocalTrainer, ParamSpec, RefitCoordinator, RefitReport
from asyncrefit._core._plan import DEFAULT_ALIGNMENT
from asyncrefit._cuda import cuda_index
from asyncrefit.abc import BucketAck
from asyncrefit.local import LocalWorker, spawn_local_workers
from asyncrefit.planning import plan_buckets
from asyncrefit.tools._machine import machine_info
from asyncrefit.tools._table import Column, table
from asyncrefit.tools.bench import llama_specs, median_push, module_from_specs
from asyncrefit.trainer import CudaSharedParameterTrainer
from asyncrefit.transport import Handle
from asyncrefit.transport.cuda_ipc import CudaIpcExporter

MIB = 2**20
GIB = 2**30
BUCKETS = (256 * MIB, GIB, 2 * GIB)
LOCKSTEP_BUCKET = GIB


# --- the parameter set ------------------------------------------------------------------


def checksums(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor: the sum of its 16-bit patterns and a position-weighted sum (CPU int64)."""
    out = torch.zeros(len(params), 2, dtype=torch.int64, device=params[0].device)
    with torch.no_grad():
        for i, p in enumerate(params):
            bits = p.detach().reshape(-1).view(torch.int16).to(torch.int64)
            weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521
            out[i, 0] = bits.sum()
            out[i, 1] = (bits * (weights + 1)).sum()
    return out.cpu()


class LlamaShaped(torch.nn.Module):
    """The parameter set on the GPU; ``forward`` returns :func:`checksums` (for checks)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        module_from_specs(llama_specs(layers), dtype=torch.bfloat16, device="cuda", root=self)

    def forward(self, x: Any = None) -> torch.Tensor:
        return checksums(list(self.parameters()))


def make_model(layers: int) -> torch.nn.Module:
    """The worker factory (module level: spawned processes import it)."""
    return LlamaShaped(layers)


def fill(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(generator=gen)
    torch.cuda.synchronize()


# --- the limit ----------------------------------------------------------------------------


def median_ms(fn: Callable[[], None], repeats: int, device: str = "cuda") -> float:
    """Median milliseconds of ``fn`` after a warm-up: CUDA events, or on ``"cpu"`` the
    wall clock."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cpu":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        cuda: Any = torch.cuda  # Event is untyped in torch's stubs
        begin, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(begin.elapsed_time(end)))
    return statistics.median(times)


def flat_views(
    params: Sequence[torch.Tensor], device: str = "cuda"
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat byte buffer on ``device`` with room for ``params`` packed as the planner
    packs them (each 256-byte aligned), and a view of it shaped as each tensor."""
    offsets, end = [], 0
    for p in params:
        end = -(-end // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
        offsets.append(end)
        end += p.nbytes
    flat = torch.empty(end, dtype=torch.uint8, device=device)
    views = [
        flat[o : o + p.nbytes].view(p.dtype).view(p.shape)
        for o, p in zip(offsets, params, strict=True)
    ]
    return flat, views


def _limit_times(params: Sequence[torch.Tensor], repeats: int) -> dict[str, float]:
    flat, views = flat_views(params)
    second = [torch.empty_like(p) for p in params]
    other = torch.empty_like(flat)

    def pack() -> None:
        for v, p in zip(views, params, strict=True):
            v.copy_(p)

    def pack_and_load() -> None:
        pack()
        for s, v in zip(second, views, strict=True):
            s.copy_(v)

    def contiguous() -> None:
        other.copy_(flat)

    with torch.no_grad():
        return {
            "one_copy_ms": median_ms(pack, repeats),
            "two_copies_ms": median_ms(pack_and_load, repeats),
            "contiguous_copy_ms": median_ms(contiguous, repeats),
        }


def measure_limit(params: Sequence[torch.Tensor], repeats: int) -> dict[str, float]:
    """Device-to-device copy times (ms) of the parameters' bytes in this process.

    ``one_copy_ms``: every tensor into one flat buffer (256-byte aligned, as packed);
    ``two_copies_ms``: that and the flat buffer out into a second set of tensors;
    ``contiguous_copy_ms``: one copy of the flat buffer.
    """
    times = _limit_times(params, repeats)
    torch.cuda.empty_cache()
    return times


# --- asyncrefit and the lock-step baseline --------------------------------------------------


class TimedWorker:
    """A :class:`~asyncrefit.abc.Worker` that records each bucket's round trip and copy time."""

    def __init__(self, inner: LocalWorker) -> None:
        self.inner = inner
        self.loads: list[tuple[float, float]] = []  # (round trip, worker's own seconds)

    @property
    def name(self) -> str:
        return self.inner.name

    async def report_device_id_async(self) -> DeviceId:
        return await self.inner.report_device_id_async()

    async def parameter_specs(self) -> Sequence[ParamSpec]:
        return await self.inner.parameter_specs()

    async def begin_update(self, version: int) -> None:
        await self.inner.begin_update(version)

    async def load_bucket(
        self, version: int, bucket: int, handles: tuple[Handle, ...]
    ) -> BucketAck:
        start = time.perf_counter()
        ack = await self.inner.load_bucket(version, bucket, handles)
        self.loads.append((time.perf_counter() - start, ack.seconds))
        return ack

    async def commit_update(self, version: int, buckets: int) -> None:
        await self.inner.commit_update(version, buckets)

    async def abort_update(self, version: int) -> None:
        await self.inner.abort_update(version)

    async def weight_version(self) -> int | None:
        return await self.inner.weight_version()

    async def release_handles(self) -> None:
        await self.inner.release_handles()


class BenchExporter:
    """A :class:`CudaIpcExporter` that times each pack's host side (first touch of the
    slot to ``seal`` returning) and, with ``alias``, labels its handle with virtual
    devices too.

    For the lock-step baseline: with one GPU, "every device's handles" are modelled by
    the real handle relabelled for ``consumers - 1`` virtual GPUs (same bytes as real
    handles of other GPUs; each consumer still opens the one of its own device).
    """

    def __init__(self, inner: CudaIpcExporter, *, alias: bool = False) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.alias = alias
        self.packs: list[float] = []
        self._started = 0.0

    @property
    def ordered(self) -> bool:
        return self.inner.ordered

    @ordered.setter
    def ordered(self, value: bool) -> None:
        self.inner.ordered = value

    def order_after(self, slot: int, tokens: Sequence[bytes]) -> None:
        self.inner.order_after(slot, tokens)

    def allocate(self, slots: int, slot_bytes: int) -> None:
        self.inner.allocate(slots, slot_bytes)

    def buffer(self, slot: int) -> torch.Tensor:
        self._started = time.perf_counter()  # LocalTrainer asks for it as a pack starts
        return self.inner.buffer(slot)

    def seal(self, slot: int) -> None:
        self.inner.seal(slot)
        self.packs.append(time.perf_counter() - self._started)

    def handle(self, slot: int, bucket: Any, device: DeviceId) -> Handle:
        if not self.alias:
            return self.inner.handle(slot, bucket, device)
        real = self.inner.handle(slot, bucket, self.inner.device_id)
        return real if device == self.inner.device_id else dataclasses.replace(real, device=device)

    def close(self) -> None:
        self.inner.close()


async def _verify(name: str, model: torch.nn.Module, workers: Sequence[LocalWorker]) -> None:
    want = checksums(list(model.parameters()))
    for w in workers:
        got = await w.forward(None)
        if not torch.equal(got, want):
            bad = int((got != want).any(dim=1).sum())
            raise RuntimeError(f"{name}: {w.name} differs from the trainer in {bad} tensors")


async def run_refit(
    name: str,
    model: torch.nn.Module,
    workers: list[TimedWorker],
    *,
    bucket_bytes: int,
    slots: int,
    all_to_all: bool = False,
    host_sync: bool = False,
    module_source: bool = False,
    zero_copy: bool = False,
    device_ordering: bool = True,  # the fast, opt-in path; the default is a row of its own
    repeats: int,
    seed: int,
) -> dict[str, Any]:
    """Warm-up push, ``repeats`` timed pushes, verify; the median push's numbers.

    The trainer source reads the parameters from a name -> tensor mapping, or with
    ``module_source`` from the module (``named_parameters()`` at every bucket).
    """
    exporter = BenchExporter(
        CudaIpcExporter(0, host_sync=host_sync, device_ordering=device_ordering),
        alias=all_to_all,
    )
    dev = exporter.inner.device_id
    devices = [dev]
    if all_to_all:
        devices += [
            DeviceId(node=dev.node, device=f"GPU-virtual-{i}") for i in range(1, len(workers))
        ]
    source: Any = model if module_source else dict(model.named_parameters())
    trainer: Any = LocalTrainer(source, exporter=exporter, devices=devices)
    if zero_copy:  # the parameters move into the trainer's slabs (and stay there)
        trainer = CudaSharedParameterTrainer(source, device=0)
    plan = plan_buckets(trainer.specs(), bucket_bytes)
    fill(model, seed)
    timed: list[tuple[float, RefitReport]] = []
    bucket_loads: list[tuple[float, float]] = []
    packs: list[float] = []
    async with RefitCoordinator(
        trainer=trainer,
        workers=workers,
        budget_bytes=slots * plan.max_bucket_bytes,
        bucket_bytes=bucket_bytes,
        broadcast_all_handles=all_to_all,
    ) as refit:
        await refit.push(1)  # warm-up: workers map the slots
        for r in range(repeats):
            for w in workers:
                w.loads.clear()
            exporter.packs.clear()
            start = time.perf_counter()
            report = await refit.push(2 + r)
            timed.append((time.perf_counter() - start, report))
            bucket_loads += [x for w in workers for x in w.loads]
            packs += exporter.packs
        await _verify(name, model, [w.inner for w in workers])
    seconds, report = median_push(timed)
    rtt = [a for a, _ in bucket_loads]
    own = [b for _, b in bucket_loads]
    return {
        "name": name,
        "consumers": len(workers),
        "bucket_bytes": bucket_bytes,
        "slots": report.slots,
        "slot_bytes": report.slot_bytes,
        "buckets": report.buckets,
        "bytes": report.bytes,
        "seconds": seconds,
        "seconds_all": [s for s, _ in timed],
        "gbps": report.bytes / seconds / 1e9,
        "handle_bytes_per_consumer": max(report.handle_bytes_per_worker.values()),
        "stages_ms": {k: v * 1e3 for k, v in dataclasses.asdict(report.stages).items()},
        "bucket_pack_host_ms": statistics.median(packs) * 1e3 if packs else 0.0,
        "bucket_round_trip_ms": statistics.median(rtt) * 1e3,
        "bucket_worker_ms": statistics.median(own) * 1e3,
        "all_to_all": all_to_all,
        "host_sync": host_sync,
        "module_source": module_source,
        "zero_copy": zero_copy,
        "device_ordering": device_ordering and not all_to_all,
        "ordered": exporter.ordered,
        "verified": True,
    }


async def null_rpc_ms(worker: LocalWorker, count: int = 50) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await worker.weight_version()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


async def run_library_variants(
    layers: int, consumers: int, model: torch.nn.Module, repeats: int, say: Callable[[str], None]
) -> tuple[list[dict[str, Any]], float]:
    dev = CudaIpcExporter(0).device_id
    rows = []
    factory = functools.partial(make_model, layers)
    async with spawn_local_workers(factory, consumers, devices=[dev] * consumers) as workers:
        timed = [TimedWorker(w) for w in workers]
        rpc = await null_rpc_ms(workers[0])
        variants: list[tuple[str, dict[str, Any]]] = [
            (f"asyncrefit {bucket // MIB} MiB", {"bucket_bytes": bucket, "slots": 2})
            for bucket in BUCKETS
        ]
        variants += [
            (
                "asyncrefit 1 GiB, acks after the copy (default)",
                {"bucket_bytes": GIB, "slots": 2, "device_ordering": False},
            ),
            (
                "asyncrefit 1 GiB, host-sync seal",
                {"bucket_bytes": GIB, "slots": 2, "host_sync": True},
            ),
            (
                "asyncrefit 1 GiB, nn.Module source",
                {"bucket_bytes": GIB, "slots": 2, "module_source": True},
            ),
            (
                "zero-copy slabs 1 GiB (1 copy)",
                {"bucket_bytes": GIB, "slots": 2, "zero_copy": True},
            ),
            (
                "lock-step 1 GiB, all handles to all",
                {
                    "bucket_bytes": LOCKSTEP_BUCKET,
                    "slots": 1,
                    "all_to_all": True,
                    "host_sync": True,
                },
            ),
        ]
        for seed, (name, options) in enumerate(variants, start=1):
            say(f"{name}, {consumers} consumer(s)")
            try:
                row = await run_refit(
                    name, model, timed, repeats=repeats, seed=seed + 10 * consumers, **options
                )
            except Exception as exc:  # record it and go on with the other variants
                say(f"{name} FAILED: {exc!r}")
                row = {"name": name, "consumers": consumers, "error": repr(exc)}
            rows.append(row)
    return rows, rpc


# --- the per-tensor baseline ----------------------------------------------------------------


def _consumer_main(conn: Connection, layers: int) -> None:
    """A consumer of per-tensor handles: its own parameters, a pipe to the trainer."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuild: Any = rebuild_cuda_tensor
    model = make_model(layers)
    params = list(model.parameters())
    torch.cuda.synchronize()
    conn.send_bytes(b"ready")
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "load":
            uuid, records = payload
            start = time.perf_counter()
            index = cuda_index(uuid)
            opened = []
            for rec in records:
                args = list(rec)
                args[6] = index  # the producer's device index, remapped by UUID
                opened.append(rebuild(*args))
            t_open = time.perf_counter()
            with torch.no_grad():
                for p, src in zip(params, opened, strict=True):
                    p.copy_(src)
            torch.cuda.current_stream().synchronize()
            t_copy = time.perf_counter()
            del opened, src
            t_drop = time.perf_counter()
            times = (t_open - start, t_copy - t_open, t_drop - t_copy)
            conn.send_bytes(pickle.dumps(times))
        elif kind == "checksum":
            conn.send_bytes(pickle.dumps(checksums(params)))
        else:
            return


@contextlib.contextmanager
def per_tensor_consumers(layers: int, count: int) -> Iterator[list[Connection]]:
    context = multiprocessing.get_context("spawn")
    procs, conns = [], []
    try:
        for _ in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=_consumer_main, args=(child, layers), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            if not conn.poll(180) or conn.recv_bytes() != b"ready":
                raise RuntimeError("a per-tensor consumer did not start")
        yield conns
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("exit", None)))
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def run_per_tensor(
    layers: int, consumers: int, model: torch.nn.Module, repeats: int, seed: int
) -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    reduce: Any = reduce_tensor
    params = [p.detach() for p in model.parameters()]
    uuid = CudaIpcExporter(0).device_id.device
    nbytes = sum(p.nbytes for p in params)
    fill(model, seed)
    timed: list[float] = []
    sizes: list[int] = []
    consumer_times: list[tuple[float, float, float]] = []
    with per_tensor_consumers(layers, consumers) as conns:
        for r in range(repeats + 1):
            torch.cuda.current_stream().synchronize()
            start = time.perf_counter()
            records = [reduce(p)[1] for p in params]
            payload = pickle.dumps(("load", (uuid, records)), protocol=5)
            for conn in conns:
                conn.send_bytes(payload)
            replies = [pickle.loads(conn.recv_bytes()) for conn in conns]
            if r:  # the first push is the warm-up
                timed.append(time.perf_counter() - start)
                sizes.append(len(payload))
                consumer_times += replies
        want = checksums(params)
        for conn in conns:
            conn.send_bytes(pickle.dumps(("checksum", None)))
            if not torch.equal(pickle.loads(conn.recv_bytes()), want):
                raise RuntimeError("per-tensor baseline: a consumer differs from the trainer")
    torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
    seconds = statistics.median(timed)
    return {
        "name": "per-tensor handles",
        "consumers": consumers,
        "tensors": len(params),
        "bytes": nbytes,
        "seconds": seconds,
        "seconds_all": timed,
        "gbps": nbytes / seconds / 1e9,
        "handle_bytes_per_consumer": max(sizes),
        "consumer_open_ms": statistics.median(t[0] for t in consumer_times) * 1e3,
        "consumer_copy_ms": statistics.median(t[1] for t in consumer_times) * 1e3,
        "consumer_drop_ms": statistics.median(t[2] for t in consumer_times) * 1e3,
        "verified": True,
    }


# --- the run --------------------------------------------------------------------------------


def run(layers: int, repeats: int, consumer_counts: Sequence[int]) -> dict[str, Any]:
    def say(message: str) -> None:
        print(f"[cuda-bench] {message}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(gpu=True),
        "layers": layers,
        "repeats": repeats,
    }
    say("building the trainer's parameters")
    model = make_model(layers)
    params = [p.detach() for p in model.parameters()]
    fill(model, 0)
    result["tensors"] = len(params)
    result["bytes"] = sum(p.nbytes for p in params)
    say("measuring the copy limit")
    result["limit"] = measure_limit(params, repeats)
    result["runs"] = []
    result["null_rpc_ms"] = {}
    for n in consumer_counts:
        rows, rpc = anyio.run(
            functools.partial(run_library_variants, layers, n, model, repeats, say),
            backend="asyncio",
            backend_options={"use_uvloop": True},
        )
        result["runs"] += rows
        result["null_rpc_ms"][n] = rpc
        say(f"per-tensor handles, {n} consumer(s)")
        try:
            result["runs"].append(run_per_tensor(layers, n, model, repeats, seed=100 + n))
        except Exception as exc:  # record it and go on
            say(f"per-tensor handles FAILED: {exc!r}")
            result["runs"].append(
                {"name": "per-tensor handles", "consumers": n, "error": repr(exc)}
            )
    return result


def format_table(result: dict[str, Any]) -> str:
    m, lim = result["machine"], result["limit"]
    nbytes = result["bytes"]
    one, two = lim["one_copy_ms"], lim["two_copies_ms"]
    load = two - one  # the second copy alone
    lines = [
        f"CUDA IPC refit, {result['date']}: {m['gpu']}, driver {m['driver']}, torch "
        f"{m['torch']} (CUDA {m['cuda']}), Python {m['python']}",
        f"{result['tensors']} bf16 tensors (Llama-2-7B shapes, {result['layers']} layers), "
        f"{nbytes / 1e9:.2f} GB; median of {result['repeats']} pushes after 1 warm-up",
        "",
        f"limit, 1 copy (pack)      {one:8.2f} ms  {nbytes / one / 1e6:7.0f} GB/s",
        f"limit, 2 copies (+ load)  {two:8.2f} ms  {nbytes / two / 1e6:7.0f} GB/s",
        f"contiguous copy           {lim['contiguous_copy_ms']:8.2f} ms  "
        f"{nbytes / lim['contiguous_copy_ms'] / 1e6:7.0f} GB/s",
        "",
    ]
    columns = (
        Column("variant", 38, left=True),
        Column("n", 2),
        Column("ms", 9, ".2f"),
        Column("GB/s", 7, ".0f"),
        Column("x limit", 9, ".2f"),
        Column("handle B/consumer", 19, ","),
        Column("buckets", 8),
    )
    rows: list[tuple[object, ...] | str] = []
    for r in result["runs"]:
        n = r["consumers"]
        if "error" in r:
            rows.append(f"{r['name']:<38}{n:>2}  FAILED: {r['error']}")
            continue
        # one pack + one load per consumer; zero-copy has no pack
        limit_ms = n * load if r.get("zero_copy") else one + n * load
        ms = r["seconds"] * 1e3
        rows.append(
            (
                r["name"],
                n,
                ms,
                r["gbps"],
                limit_ms / ms,
                r["handle_bytes_per_consumer"],
                r.get("buckets", r.get("tensors", 0)),
            )
        )
    lines += table(columns, rows)
    lines += [
        "",
        "x limit: the limit's time (1 pack + n loads; n loads for zero-copy) over the push's",
        "time",
        "",
    ]
    for r in result["runs"]:
        if "error" in r:
            continue
        if "stages_ms" in r:
            s = ", ".join(f"{k} {v:.2f}" for k, v in r["stages_ms"].items())
            lines.append(
                f"{r['name']} n={r['consumers']}: {s}; per bucket: pack (host) "
                f"{r['bucket_pack_host_ms']:.2f}, round trip {r['bucket_round_trip_ms']:.2f}, "
                f"in worker {r['bucket_worker_ms']:.2f}"
            )
        else:
            lines.append(
                f"{r['name']} n={r['consumers']}: consumer open {r['consumer_open_ms']:.2f}, "
                f"copy {r['consumer_copy_ms']:.2f}, drop {r['consumer_drop_ms']:.2f}"
            )
    rpc = ", ".join(f"n={n}: {ms:.3f} ms" for n, ms in result["null_rpc_ms"].items())
    lines.append(f"null round trip to a worker (weight_version): {rpc}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=32, help="transformer layers (32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per variant (5)")
    parser.add_argument("--consumers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=str, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_ipc_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run(args.layers, args.repeats, args.consumers)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
