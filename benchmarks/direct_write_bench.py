"""Direct write against the staged path and the one-copy limit, CPU or GPU, one run.

    python benchmarks/direct_write_bench.py --device cpu --consumers 1 2 --repeats 5 --record
    python benchmarks/direct_write_bench.py --device cuda --consumers 1 2 4 --out r.json  # 7B set

A trainer (this process) holds a parameter set with Llama-2 shapes (``--layers``,
``--hidden``, ``--inter``, ``--vocab``; on a GPU the defaults are Llama-2-7B in bf16,
291 tensors, 13.48 GB; on the CPU a float32 set of 2 layers of width 1024, ~330 MB)
and pushes it into ``n`` local worker processes on the same device, for every ``n`` of
``--consumers``. For each ``n``, in one run:

- **one-copy limit**: the same tensors copied once into each of ``n`` scratch sets in
  this process (``Tensor.copy_``, as the trainer's write does; on a GPU timed by CUDA
  events, on the CPU by the wall clock; torch's threads as the push has them). That is
  the limit of a push as the issue defines it: every byte written once into every
  consumer, tensor by tensor;
- **flat memcpy**: the same bytes as one flat ``copy_`` per consumer, with no
  per-tensor cost at all: the hardware's limit (``x memcpy`` in the table);
- **direct write**: workers started with ``shared_parameters=True``; the
  coordinator's :class:`~asyncrefit.LocalTrainer` writes each tensor straight into the
  workers' exported parameters (begun ahead, every bucket handed to its thread at a
  gate while the workers begin). Zero staging bytes;
- **direct, read first**: the same workers and writes, but each push reads the
  trainer's tensors before it begins the workers (as pushes did before they began
  ahead: the read and the begins one after the other). The baseline of the begin
  ahead; its pushes alternate with the direct write's, into the same workers;
- **direct, ungated**: the same, begun ahead, but the buckets handed to the trainer's
  thread in batches of up to the budget once every worker began (as pushes did before
  gated writes), also alternating;
- **direct, 1 stream** and **direct, 4 streams**: the direct write with its copies on
  one CUDA stream (as pushes did before they spread them over two) and on four, also
  alternating (GPU only);
- **staged**: workers without shared parameters; the trainer packs each bucket into a
  staging slot (shared memory on the CPU, ``CudaIpcExporter`` on a GPU) and each
  worker copies it out: two copies per byte, two slots of ``--bucket-mib``.

A push is timed from outside the library: wall clock around ``await refit.push``,
after ``--warmup`` pushes; median and range of ``--repeats``. After each variant every
worker's parameters are compared with the trainer's (checksums computed by the worker).
``--record`` appends the table to ``benchmarks/RESULTS.md``; ``--out`` writes JSON.
``--timeline N``: after the timed pushes of each direct-write variant, ``N`` more under
:class:`push_timeline.PushTimeline`, whose table (when each step of a push starts and
ends, medians) is printed and kept in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit import LocalTrainer, RefitCoordinator
from asyncrefit.local import LocalWorker, spawn_local_workers
from asyncrefit.tools._machine import machine_info, machine_line
from asyncrefit.tools._table import (
    Column,
    append_to_section,
    recorded_command,
    results_section,
    table,
)
from asyncrefit.tools.bench import llama_specs, module_from_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from push_timeline import PushTimeline

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## Direct write into workers"
MIB = 1 << 20


class Shaped(torch.nn.Module):
    """The parameter set; ``forward`` returns a checksum per tensor (for checks)."""

    def __init__(self, shape: dict[str, Any]) -> None:
        super().__init__()
        specs = llama_specs(
            shape["layers"], shape["vocab"], shape["hidden"], shape["inter"], dtype=shape["dtype"]
        )
        module_from_specs(specs, device=shape["device"], root=self)

    def forward(self, x: Any = None) -> torch.Tensor:
        return checksums(list(self.parameters()))


def make_model(shape: dict[str, Any]) -> torch.nn.Module:
    """The worker factory (module level: spawned processes import it)."""
    return Shaped(shape)


def checksums(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Two int64 sums per tensor over its bit patterns, one weighted by position."""
    out = []
    chunk = 1 << 24  # elements at a time: the int64 temporaries stay small
    for p in params:
        bits = p.detach().reshape(-1).view(torch.int16 if p.element_size() == 2 else torch.int32)
        plain = torch.zeros((), dtype=torch.int64, device=bits.device)
        weighted = torch.zeros((), dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), chunk):
            wide = bits[start : start + chunk].to(torch.int64)
            weights = torch.arange(start + 1, start + 1 + wide.numel(), device=wide.device)
            plain += wide.sum()
            weighted += (wide * (weights % 65521)).sum()
        out.append(torch.stack([plain, weighted]))
    result = torch.stack(out).cpu()
    if params and params[0].device.type == "cuda":
        torch.cuda.empty_cache()  # give the temporaries back: workers share one GPU
    return result


def fill(module: torch.nn.Module, seed: int) -> None:
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(generator=gen)
    if device.type == "cuda":
        torch.cuda.synchronize()


def limit_seconds(
    params: Sequence[torch.Tensor], consumers: int, repeats: int, *, flat: bool = False
) -> list[float]:
    """One copy of every tensor into each of ``consumers`` scratch sets, per repeat
    (``flat``: of all their bytes as one buffer, ``consumers`` times into one scratch
    buffer: the same bytes written, without 4 x 13.5 GB of scratch on a GPU)."""
    cuda = params[0].device.type == "cuda"
    if flat:
        nbytes = sum(p.numel() * p.element_size() for p in params)
        sources = [torch.empty(nbytes, dtype=torch.uint8, device=params[0].device)]
        scratch = [[torch.empty_like(sources[0])]] * consumers
    else:
        sources = list(params)
        scratch = [[torch.empty_like(p) for p in params] for _ in range(consumers)]

    def once() -> float:
        if cuda:
            events: Any = torch.cuda
            begin, end = events.Event(enable_timing=True), events.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        with torch.no_grad():
            for dsts in scratch:
                for d, s in zip(dsts, sources, strict=True):
                    d.copy_(s)
        if cuda:
            end.record()
            end.synchronize()
            return float(begin.elapsed_time(end)) / 1e3
        return time.perf_counter() - start

    once()
    times = [once() for _ in range(repeats)]
    scratch.clear()
    sources.clear()
    if cuda:
        torch.cuda.empty_cache()
    return times


#: The ways a direct push is run, alternating push by push: the library's own
#: ("direct write": begun ahead, every bucket handed to the trainer's thread at a gate
#: while the workers begin) and its earlier forms, as baselines in the same run.
MODES: dict[str, dict[str, Any]] = {
    "direct write": {"ahead": True, "gated": True, "streams": None},
    "direct, read first": {"ahead": False, "gated": True, "streams": None},
    "direct, ungated": {"ahead": True, "gated": False, "streams": None},
    "direct, 1 stream": {"ahead": True, "gated": True, "streams": 1},
    "direct, 4 streams": {"ahead": True, "gated": True, "streams": 4},
}
#: The modes that differ only on a GPU (the CPU has no streams).
GPU_MODES = ("direct, 1 stream", "direct, 4 streams")


async def time_pushes(
    model: torch.nn.Module,
    workers: Sequence[LocalWorker],
    make_trainer: Callable[[], LocalTrainer],
    budget: int,
    warmup: int,
    repeats: int,
    timeline: int = 0,
    *,
    modes: Sequence[str] = ("direct write",),
) -> dict[str, dict[str, Any]]:
    """Time pushes, by mode (see :data:`MODES`; the first one is traced).

    With several modes the pushes alternate between them (one coordinator, the same
    workers), so drift and the order of rows weigh on both alike.
    """
    from asyncrefit._core import _push

    times: dict[str, list[float]] = {m: [] for m in modes}
    stages: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    traced = PushTimeline()
    gated_writes = _push._takes_gated_writes
    source = make_trainer()
    streams = source._copy_streams

    def use(mode: str) -> None:
        current[0] = MODES[mode]
        source._copy_streams = current[0]["streams"] or streams

    async with RefitCoordinator(
        trainer=source, workers=workers, budget_bytes=budget, timeout=600
    ) as refit:
        current = [MODES[modes[0]]]
        begins_ahead = refit._begins_ahead
        refit._begins_ahead = lambda: current[0]["ahead"] and begins_ahead()  # type: ignore[method-assign]
        _push._takes_gated_writes = lambda kind: current[0]["gated"] and gated_writes(kind)  # type: ignore[assignment]
        try:
            pushes = (warmup + repeats) * len(modes)
            for v in range(1, pushes + 1):
                mode = modes[(v - 1) % len(modes)]
                use(mode)
                await anyio.to_thread.run_sync(fill, model, v)
                start = time.perf_counter()
                report = await refit.push(v)
                if v > warmup * len(modes):
                    times[mode].append(time.perf_counter() - start)
                    stages[mode].append(dataclasses.asdict(report.stages))
            use(modes[0])
            with traced:  # after the timed pushes: its wrappers are in none of them
                for version in range(v + 1, v + 1 + timeline):
                    await anyio.to_thread.run_sync(fill, model, version)
                    await refit.push(version)
        finally:
            _push._takes_gated_writes = gated_writes  # type: ignore[assignment]
        want = checksums(list(model.parameters()))
        for w in workers:
            got = await w.forward(None)
            if not torch.equal(got, want):
                raise AssertionError(f"{w.name} does not hold the trainer's tensors")
    return {
        mode: {
            "seconds": times[mode],
            "stages": {k: statistics.median(s[k] for s in stages[mode]) for k in stages[mode][0]},
            "slots": report.slots,
            "staging_bytes": report.slots * report.slot_bytes,
            "peak_budget_bytes": report.peak_budget_bytes,
            "transports": report.bytes_per_transport,
            "buckets": report.buckets,
            "timeline": traced.summary() if timeline and mode == modes[0] else [],
            "timeline_table": traced.table() if timeline and mode == modes[0] else "",
        }
        for mode in modes
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    shape = {
        "layers": args.layers,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "inter": args.inter,
        "dtype": "bfloat16" if cuda else "float32",
        "device": "cuda" if cuda else "cpu",
    }
    model = make_model(shape)
    params = list(model.parameters())
    payload = sum(p.numel() * p.element_size() for p in params)
    bucket = args.bucket_mib * MIB
    dev = None
    if cuda:
        from asyncrefit._cuda import cuda_device

        dev = cuda_device(0)
    rows: dict[str, Any] = {}
    modes = tuple(m for m in MODES if cuda or m not in GPU_MODES)
    for n in args.consumers:
        print(f"-- {n} consumer(s)", file=sys.stderr, flush=True)
        limit = limit_seconds(params, n, args.repeats)
        rows[f"{n}: one-copy limit"] = {"consumers": n, "seconds": limit, "staging_bytes": 0}
        print(f"   one-copy limit: {statistics.median(limit) * 1e3:.2f} ms", file=sys.stderr)
        flat = limit_seconds(params, n, args.repeats, flat=True)
        rows[f"{n}: flat memcpy"] = {
            "consumers": n,
            "seconds": flat,
            "staging_bytes": 0,
            "memcpy": True,
        }
        print(f"   flat memcpy: {statistics.median(flat) * 1e3:.2f} ms", file=sys.stderr)
        devices = [dev] * n if dev is not None else None
        factory = functools.partial(make_model, shape)
        for name, shared in (("direct write", True), ("staged", False)):
            async with spawn_local_workers(
                factory, n, devices=devices, shared_parameters=shared, start_timeout=600
            ) as workers:
                if cuda:
                    from asyncrefit.transport.cuda_ipc import CudaIpcExporter

                    def trainer() -> LocalTrainer:
                        return LocalTrainer(model, exporter=CudaIpcExporter(0), devices=[dev])
                else:

                    def trainer() -> LocalTrainer:
                        return LocalTrainer(model)

                # Direct write into the same workers, pushes alternating between the
                # library's way and its baselines (MODES).
                results = await time_pushes(
                    model,
                    workers,
                    trainer,
                    2 * bucket,
                    args.warmup,
                    args.repeats,
                    args.timeline if shared else 0,
                    modes=modes if shared else ("direct write",),
                )
            for mode, result in results.items():
                label = mode if shared else name
                result["consumers"] = n
                rows[f"{n}: {label}"] = result
                ms = statistics.median(result["seconds"]) * 1e3
                parts = " ".join(f"{k} {v * 1e3:.2f}" for k, v in result["stages"].items())
                print(f"   {label}: {ms:.2f} ms ({parts})", file=sys.stderr)
                if result["timeline_table"]:
                    print(result["timeline_table"], file=sys.stderr)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(gpu=cuda),
        "device": args.device,
        "shape": shape,
        "tensors": len(params),
        "payload_bytes": payload,
        "bucket_bytes": bucket,
        "repeats": args.repeats,
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    columns = [
        Column("consumers: variant", 24, left=True),
        Column("median ms", 10, ".2f"),
        Column("min-max ms", 16),
        Column("GB/s written", 13, ".1f"),
        Column("x one-copy", 11, ".3f"),
        Column("x memcpy", 9, ".3f"),
        Column("staging MiB", 12, ".0f"),
    ]
    payload = result["payload_bytes"]
    out = []
    limits = {
        r["consumers"]: statistics.median(r["seconds"])
        for k, r in result["rows"].items()
        if k.endswith("limit")
    }
    memcpy = {
        r["consumers"]: statistics.median(r["seconds"])
        for r in result["rows"].values()
        if r.get("memcpy")
    }
    for key, r in result["rows"].items():
        s = r["seconds"]
        med = statistics.median(s)
        n = r["consumers"]
        out.append(
            [
                key,
                med * 1e3,
                f"{min(s) * 1e3:.2f}-{max(s) * 1e3:.2f}",
                payload * n / med / 1e9,
                limits[n] / med,
                memcpy[n] / med if n in memcpy else "-",
                r["staging_bytes"] / MIB,
            ]
        )
    head = (
        f"{machine_line(result['machine'])}\n"
        f"{result['tensors']} {result['shape']['dtype']} tensors, "
        f"{payload / 1e9:.2f} GB per consumer, buckets of {result['bucket_bytes'] // MIB} MiB "
        f"(staged: 2 slots), {result['repeats']} timed pushes\n"
    )
    return head + "\n".join(table(columns, out, gap=1, rule=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--consumers", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--inter", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--timeline", type=int, default=0, help="traced direct pushes after the timed ones"
    )
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--record", action="store_true", help=f"append to {RESULTS.name}")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.consumers = args.consumers or ([1, 2, 4] if cuda else [1, 2])
    args.layers = args.layers if args.layers is not None else (32 if cuda else 2)
    args.hidden = args.hidden or (4096 if cuda else 1024)
    args.inter = args.inter or (11008 if cuda else 2816)
    args.bucket_mib = args.bucket_mib or (1024 if cuda else 64)
    result = anyio.run(run, args)
    text = format_table(result)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.record:
        m = result["machine"]
        where = m.get("gpu") if cuda else f"{m['cpu']}, {m['cores']} cores"
        title = f"{result['date'][:10]}: {args.device}, {where}, torch {m['torch']}"
        command = recorded_command("benchmarks/direct_write_bench.py", argv)
        append_to_section(RESULTS, SECTION, results_section(title, command, text, result))
    return 0


if __name__ == "__main__":  # worker processes are spawned
    sys.exit(main())
