"""A push into FP8 weights (quantized as the trainer writes) against the bf16 push, one run.

    python benchmarks/fp8_bench.py --device cuda --out r.json        # the 7B set, one GPU
    python benchmarks/fp8_bench.py --device cpu --layers 2 --repeats 3

A trainer (this process) holds the Llama-2-shaped set of
``benchmarks/direct_write_bench.py`` (on a GPU Llama-2-7B in bf16: 291 tensors,
13.48 GB) and pushes it into one local worker process on the same device, written
directly (``shared_parameters=True``), in one run:

- **bf16 one-copy limit**: every tensor copied once in this process (the physical
  limit of the bf16 push: one copy per byte written);
- **bf16 push**: the worker holds bf16 parameters; the trainer writes them;
- **fp8 quantize limit**: every linear weight quantized in this process with
  :func:`~asyncrefit.quantization.fp8_block_quantize` (128 x 128 blocks) and its
  scales computed, the rest copied: what the FP8 push cannot beat;
- **fp8 push**: the worker holds its linear layers' weights in ``float8_e4m3fn`` with
  ``weight_scale_inv`` (an FP8 checkpoint's layout); the trainer pushes with
  ``LocalTrainer(quantization=Fp8Blocks(...))``, quantizing as it writes.

Wall clock around ``await refit.push`` (median and range of ``--repeats`` after a
warm-up); the limits by CUDA events on a GPU. After each push the worker's tensors
are compared bitwise with the trainer's (the fp8 ones with the trainer's quantization).
``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from asyncrefit import LocalTrainer, RefitCoordinator
from asyncrefit.local import spawn_local_workers
from asyncrefit.quantization import Fp8Blocks, fp8_block_quantize, fp8_block_scales
from asyncrefit.tools._machine import machine_info, machine_line
from asyncrefit.tools.bench import llama_specs, module_from_specs

BLOCK = (128, 128)


def quantized(name: str) -> bool:
    """The linear layers' weights (an FP8 checkpoint quantizes those; not the head)."""
    return name.endswith("_proj.weight")


class Held(torch.nn.Module):
    """The worker's parameters: the set in bf16, or with FP8 linear weights and scales.
    ``forward`` returns a digest per tensor (its bytes summed, weighted by position)."""

    def __init__(self, shape: dict[str, Any], fp8: bool) -> None:
        super().__init__()
        specs = []
        for spec in llama_specs(
            shape["layers"], shape["vocab"], shape["hidden"], shape["inter"], dtype=shape["dtype"]
        ):
            if fp8 and quantized(spec.name):
                m, n = spec.shape
                specs.append(type(spec)(name=spec.name, shape=spec.shape, dtype="float8_e4m3fn"))
                scales = (-(-m // BLOCK[0]), -(-n // BLOCK[1]))
                specs.append(
                    type(spec)(name=f"{spec.name}_scale_inv", shape=scales, dtype="float32")
                )
            else:
                specs.append(spec)
        module_from_specs(specs, device=shape["device"], root=self)

    def forward(self, x: Any = None) -> torch.Tensor:
        return digests(list(self.parameters()))


def make_held(shape: dict[str, Any], fp8: bool) -> torch.nn.Module:
    """The worker factory (module level: spawned processes import it)."""
    return Held(shape, fp8)


def digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    out = []
    for t in tensors:
        raw = t.detach().reshape(-1).view(torch.uint8).to(torch.int64)
        weights = torch.arange(1, raw.numel() + 1, device=raw.device) % 65521
        out.append(torch.stack([raw.sum(), (raw * weights).sum()]))
    return torch.stack(out).cpu()


def expected(model: torch.nn.Module, fp8: bool) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for name, p in model.named_parameters():
        if fp8 and quantized(name):
            q, s = fp8_block_quantize(p.detach(), BLOCK)
            found += [q, s]
        else:
            found.append(p.detach())
    return found


def timed(fn: Callable[[], None], cuda: bool, repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            cuda_api: Any = torch.cuda
            begin, end = cuda_api.Event(enable_timing=True), cuda_api.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(begin.elapsed_time(end)) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return times


def limits(model: torch.nn.Module, cuda: bool, repeats: int) -> dict[str, list[float]]:
    params = dict(model.named_parameters())
    scratch = {n: torch.empty_like(p) for n, p in params.items()}
    fp8 = {
        n: (
            torch.empty(p.shape, dtype=torch.float8_e4m3fn, device=p.device),
            torch.empty((-(-p.shape[0] // BLOCK[0]), -(-p.shape[1] // BLOCK[1])), device=p.device),
        )
        for n, p in params.items()
        if quantized(n)
    }

    def copy_all() -> None:
        with torch.no_grad():
            for n, p in params.items():
                scratch[n].copy_(p)

    def quantize_all() -> None:
        with torch.no_grad():
            for n, p in params.items():
                if n in fp8:
                    q, s = fp8[n]
                    s.copy_(fp8_block_scales(p, BLOCK))
                    q.copy_(fp8_block_quantize(p, BLOCK)[0])
                else:
                    scratch[n].copy_(p)

    found = {"bf16": timed(copy_all, cuda, repeats), "fp8": timed(quantize_all, cuda, repeats)}
    scratch.clear()
    fp8.clear()
    if cuda:
        torch.cuda.empty_cache()
    return found


async def pushes(
    model: torch.nn.Module, shape: dict[str, Any], fp8: bool, budget: int, repeats: int
) -> dict[str, Any]:
    cuda = shape["device"] == "cuda"
    devices = None
    dev = None
    if cuda:
        from asyncrefit._cuda import cuda_device

        dev = cuda_device(0)
        devices = [dev]
    quantization = Fp8Blocks(block=BLOCK, ignore=(), targets=quantized) if fp8 else None
    times = []
    async with (
        spawn_local_workers(
            functools.partial(make_held, shape, fp8),
            1,
            devices=devices,
            shared_parameters=True,
            start_timeout=600,
        ) as workers,
        RefitCoordinator(
            trainer=LocalTrainer(
                model, devices=[dev] if dev is not None else None, quantization=quantization
            ),
            workers=workers,
            budget_bytes=budget,
            timeout=600,
        ) as refit,
    ):
        for version in range(1, repeats + 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.0)  # new values (exact), same magnitudes
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            report = await refit.push(version)
            if version > 1:
                times.append(time.perf_counter() - start)
        got = await workers[0].forward(None)
        want = digests(expected(model, fp8))
        if not torch.equal(got, want):
            raise AssertionError(f"the worker does not hold the trainer's tensors (fp8={fp8})")
    return {
        "seconds": times,
        "bytes": report.bytes,
        "transports": report.bytes_per_transport,
        "staging_bytes": report.slots * report.slot_bytes,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    shape = {
        "layers": args.layers if args.layers is not None else (32 if cuda else 2),
        "vocab": args.vocab,
        "hidden": args.hidden if args.hidden is not None else (4096 if cuda else 1024),
        "inter": args.inter if args.inter is not None else (11008 if cuda else 2816),
        "dtype": "bfloat16",
        "device": "cuda" if cuda else "cpu",
    }
    model = Held(shape, fp8=False)
    gen = torch.Generator(device=shape["device"]).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=gen)
    rows: dict[str, Any] = {}
    for name, times in limits(model, cuda, args.repeats).items():
        rows[f"{name} limit"] = {"seconds": times}
    budget = args.budget_mib << 20
    for fp8 in (False, True):
        rows["fp8 push" if fp8 else "bf16 push"] = await pushes(
            model, shape, fp8, budget, args.repeats
        )
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(gpu=cuda),
        "shape": shape,
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [machine_line(result["machine"]), f"shape: {result['shape']}"]
    base = statistics.median(result["rows"]["bf16 limit"]["seconds"])
    lines.append(
        f"{'variant':<12} {'median ms':>10} {'min-max ms':>16} {'x bf16 limit':>13}  bytes"
    )
    for name, row in result["rows"].items():
        t = row["seconds"]
        med = statistics.median(t)
        span = f"{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}"
        lines.append(
            f"{name:<12} {med * 1e3:>10.2f} {span:>16} {base / med:>13.3f}  {row.get('bytes', '')}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--inter", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--budget-mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = anyio.run(run, args)
    print(format_table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
