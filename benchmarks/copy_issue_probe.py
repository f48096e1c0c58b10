"""What a direct write's copies and its control calls cost on one GPU, apart.

    python benchmarks/copy_issue_probe.py --out probe.json   # on a GPU machine

Two questions behind the local direct write's fixed cost (see RESULTS.md):

- **Issue.** The 7B set (291 bf16 tensors, 13.48 GB) copied once into scratch tensors of
  this process, issued four ways: a ``Tensor.copy_`` per tensor (what the trainer's write
  does, and the one-copy limit's method), the same copies alternating over two streams,
  the same copies captured once in a CUDA graph and replayed, and one ``copy_`` of a
  flat buffer of all the bytes (no per-tensor cost at all). For each: the CPU time to
  issue (wall clock of the issuing call), the GPU time (CUDA events around the copies)
  and the wall clock from the first issue to a synchronize. Median and range.
- **Round trip.** A local worker process on the GPU with shared parameters: the wall
  clock of ``begin_direct`` (the worker synchronizes its device before it answers),
  ``abort_update`` and ``weight_version`` (no device work), each awaited alone, back to
  back and after 20 ms of quiet; and the cost of an idle ``torch.cuda.synchronize()`` in
  this process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncrefit.tools._machine import machine_info, machine_line

H, INTER, V, L = 4096, 11008, 32000, 32


def shapes() -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [(V, H)]
    for _ in range(L):
        out += [(H, H)] * 4 + [(INTER, H), (INTER, H), (H, INTER), (H,), (H,)]
    return [*out, (H,), (V, H)]


class Tiny(torch.nn.Module):
    """A worker's module: one small parameter (the round trip is what is timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1024, device="cuda"))


def summary(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def issue_variants(repeats: int) -> dict[str, Any]:
    src = [torch.randn(s, device="cuda").to(torch.bfloat16) for s in shapes()]
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    cuda: Any = torch.cuda
    side = cuda.Stream()

    def per_tensor() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    def two_streams() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for k, (d, s) in enumerate(zip(dst, src, strict=True)):
            if k % 2:
                with torch.cuda.stream(side):
                    d.copy_(s)
            else:
                d.copy_(s)
        main.wait_stream(side)

    def flat() -> None:
        flat_dst.copy_(flat_src)

    graph = torch.cuda.CUDAGraph()
    capture = cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(capture):
        graph.capture_begin(capture_error_mode="thread_local")
        per_tensor()
        graph.capture_end()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0

    def replay() -> None:
        graph.replay()

    variants: dict[str, Callable[[], None]] = {
        "copy_ per tensor": per_tensor,
        "copy_ per tensor, 2 streams": two_streams,
        "CUDA graph replay": replay,
        "one flat copy_": flat,
    }
    results: dict[str, Any] = {"bytes": nbytes, "tensors": len(src), "capture_s": capture_s}
    for name, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        cpu, gpu, wall = [], [], []
        for _ in range(repeats):
            begin, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            begin.record()
            fn()
            end.record()
            issued = time.perf_counter()
            end.synchronize()
            done = time.perf_counter()
            cpu.append(issued - t)
            gpu.append(begin.elapsed_time(end) / 1e3)
            wall.append(done - t)
        results[name] = {"issue": summary(cpu), "gpu": summary(gpu), "wall": summary(wall)}
        # Correctness: the copies wrote what they read.
        if name != "one flat copy_" and not all(
            torch.equal(d, s) for d, s in zip(dst, src, strict=True)
        ):
            raise AssertionError(f"{name} did not copy every tensor")
        for d in dst:
            d.zero_()
    return results


async def round_trips(repeats: int) -> dict[str, Any]:
    from asyncrefit._cuda import cuda_device
    from asyncrefit.local import spawn_local_workers

    sync = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.cuda.synchronize()
        sync.append(time.perf_counter() - t)
    out: dict[str, Any] = {"idle torch.cuda.synchronize()": summary(sync)}
    async with spawn_local_workers(
        Tiny, 1, devices=[cuda_device(0)], shared_parameters=True, start_timeout=300
    ) as (worker,):

        def calls(v: int) -> dict[str, Callable[[], Any]]:
            return {
                "begin_direct": partial(worker.begin_direct, v),
                "abort_update": partial(worker.abort_update, v),
                "weight_version": worker.weight_version,
            }

        times: dict[str, list[float]] = {name: [] for name in calls(0)}
        for v in range(1, repeats + 21):
            for name, call in calls(v).items():
                t = time.perf_counter()
                await call()
                if v > 20:
                    times[name].append(time.perf_counter() - t)
        out.update({k: summary(v) for k, v in times.items()})
        # The same calls after 20 ms of quiet (as between pushes: the worker's loop slept).
        for kept in times.values():
            kept.clear()
        for v in range(repeats + 21, repeats + 21 + repeats // 4):
            for name, call in calls(v).items():
                await anyio.sleep(0.02)
                t = time.perf_counter()
                await call()
                times[name].append(time.perf_counter() - t)
        out.update({f"{k} after 20 ms idle": summary(v) for k, v in times.items()})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_line(machine_info(gpu=True)),
        "issue": issue_variants(args.repeats),
    }
    torch.cuda.empty_cache()
    result["round_trip"] = anyio.run(round_trips, args.repeats * 20)
    print(result["machine"])
    issue = result["issue"]
    gb, capture = issue["bytes"] / 1e9, issue["capture_s"] * 1e3
    print(f"{issue['tensors']} tensors, {gb:.2f} GB; graph capture {capture:.1f} ms")
    print(f"{'issue variant':30} {'CPU issue ms':>14} {'GPU ms':>16} {'wall ms':>16}")
    for name, r in issue.items():
        if isinstance(r, dict):
            cells = [
                f"{r[k]['median_ms']:.3f} ({r[k]['min_ms']:.2f}-{r[k]['max_ms']:.2f})"
                for k in ("issue", "gpu", "wall")
            ]
            print(f"{name:30} " + " ".join(f"{c:>16}" for c in cells))
    print(f"{'round trip':30} {'median ms':>10} {'min-max ms':>14}")
    for name, r in result["round_trip"].items():
        print(f"{name:30} {r['median_ms']:10.3f} {r['min_ms']:7.3f}-{r['max_ms']:.3f}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
