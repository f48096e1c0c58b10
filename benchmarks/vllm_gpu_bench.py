"""Refit a vLLM engine on one GPU: asyncrefit against vLLM's own IPC transfer and the copy limit.

    python benchmarks/vllm_gpu_bench.py [--tiny] [--repeats 5] [--out x.json] [--record]

Run it on a GPU machine with vLLM installed (``benchmarks/gpu/install.sh`` installs the
offline bundle; then ``export PYTHONPATH=SITE:$PYTHONPATH``). ``--tiny`` (2 layers,
hidden 256) is a quick smoke run; without it the model has Llama-2-7B's shapes.

A ``vllm.LLM`` (one GPU, ``enforce_eager``, bf16, no tokenizer, ``--max-model-len``,
``--gpu-memory-utilization``) serves a Llama-2-7B-shaped model (hidden 4096,
intermediate 11008, 32 layers, 32 heads, vocab 32000, untied: 291 tensors, 13.48 GB in
bf16). The trainer is a ``transformers`` ``LlamaForCausalLM`` of the same config in
bf16 on ``cuda:0`` in this process (random values), and in one run its weights are
pushed into the engine by:

- **limit** (the one-copy limit): a device-to-device ``copy_`` of the trainer's 291
  tensors into preallocated tensors of the same shapes, in this process, one stream,
  synchronized (13.48 GB read + 13.48 GB written); CUDA events;
- **asyncrefit direct** (the default where the engine exports its parameters): the
  same trainer writes the engine's own parameters by the copy plan the engine learned
  from its loaders (``vllm/_direct.py``), on its stream, one copy per byte; no bucket
  is loaded and nothing is staged (the budget bounds what one write call covers);
  the push begins the engine while it reads the trainer's tensors;
- **direct, read first**: the same, but each push reads the trainer's tensors before
  it begins the engine (as pushes did before they began ahead): the baseline of that;
- **asyncrefit staged**: ``RefitCoordinator(direct_write=False)`` with
  ``LocalTrainer(model, exporter=CudaIpcExporter(0))`` into the workers of
  ``connect_llm(llm)``; buckets of ``--budget-gib / 2``, budget two buckets (2 slots,
  ping-pong), as ``benchmarks/cuda_ipc_bench.py`` chooses them;
- **asyncrefit zero-copy**: the same with ``CudaSharedParameterTrainer(model)`` (the
  trainer's parameters moved into CUDA IPC-shared slabs: no pack, one copy);
- **vLLM IPC, packed / unpacked**: vLLM's own ``"ipc"`` weight-transfer backend, on a
  second engine (vLLM takes one backend per engine): ``start_weight_update``, the
  trainer side's send (``packed=True``: chunks of 1 GiB staged in one IPC buffer;
  ``packed=False``: one IPC handle per tensor, all in one ``update_weights``),
  ``finish_weight_update``.

The asyncrefit engine loads a zero-filled safetensors checkpoint (a sparse file written
here: no disk space, no download) instead of ``load_format="dummy"``: asyncrefit's vLLM
worker reads the names and shapes the model accepts from the engine's safetensors
files. The vLLM IPC engine uses ``load_format="dummy"`` on the same config.

Every row is timed from outside the library: wall clock (``time.perf_counter``) around
each whole refit (``await refit.push(v)``; start + send + finish for vLLM IPC), after
``--warmup`` refits, ``--repeats`` timed refits, each after a small change of two
parameters (embedding and layer 0's ``q_proj``) and a device synchronize (not timed).
The table gives the median, min and max in ms; ``x limit`` is the one-copy limit's
median over the row's median (1.0 would be one plain copy of every byte; a refit
through a staging buffer copies each byte twice); peak extra MiB is the most
device-wide GPU memory (``torch.cuda.mem_get_info``, this process and the engine's)
taken during one more refit after the timed ones beyond what was in use just before
it, polled every ~1 ms from a thread (which would contend for this process's GIL: it
runs during no timed refit). After each row's last refit, a checksum of the engine's embedding
and of layer 0's fused ``qkv_proj`` (the int64 sum of the bf16 bit patterns, through
``llm.collective_rpc``) is compared with the trainer's: OK or MISMATCH.

Each row may fail on its own: its error goes to stderr with the traceback, the row is
recorded as failed, and the run goes on. ``--out PATH`` writes the JSON; ``--record``
appends a dated section to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from push_timeline import PushTimeline

MIB = 2**20
GIB = 2**30
RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## vLLM refit on one GPU"
SCRIPT = "benchmarks/vllm_gpu_bench.py"

#: Llama-2-7B (random weights): 291 tensors, 13.48 GB in bf16.
LLAMA_7B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
#: A smoke-test model: 2 layers, hidden 256 (head size 64, which every attention
#: backend takes).
TINY: dict[str, Any] = {
    **LLAMA_7B,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}

DIRECT = "asyncrefit direct"
DIRECT_READ_FIRST = "direct, read first"
STAGED = "asyncrefit staged"
ZERO_COPY = "asyncrefit zero-copy"
IPC_PACKED = "vLLM IPC packed"
IPC_UNPACKED = "vLLM IPC unpacked"
LIMIT = "one-copy limit"


def say(message: str) -> None:
    print(f"[vllm-gpu-bench] {message}", file=sys.stderr, flush=True)


# --- the trainer and the checkpoint --------------------------------------------------------


def make_trainer(model_config: dict[str, Any]) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` in bf16 on ``cuda:0``, random normal * 0.02 (built on the
    meta device, then given memory: no initialization on the host)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**model_config)
    with torch.device("meta"):
        model: torch.nn.Module = LlamaForCausalLM(config)  # type: ignore[no-untyped-call, unused-ignore]
    model = model.to(torch.bfloat16)
    model.to_empty(device="cuda")
    # to_empty leaves the rotary buffers uninitialized: make them again (the benchmark
    # never runs the trainer's forward, but keep the model a correct one).
    inner: Any = model.get_submodule("model")
    with torch.device("cuda"):
        inner.rotary_emb = type(inner.rotary_emb)(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    torch.cuda.synchronize()
    return model.eval()


def write_checkpoint(path: Path, model_config: dict[str, Any], model: torch.nn.Module) -> None:
    """``config.json`` and a zero-filled ``model.safetensors`` of the trainer's tensors.

    The safetensors file is written sparse (its header, then a hole as long as the
    data): it takes no disk space and reads as zeros.
    """
    from transformers import LlamaConfig

    config = LlamaConfig(**model_config)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, p in model.named_parameters():
        if p.dtype != torch.bfloat16:
            raise ValueError(f"{name} is {p.dtype}, expected bfloat16")
        header[name] = {
            "dtype": "BF16",
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)


def perturb(model: torch.nn.Module, step: int) -> None:
    """A small change of the two checksummed parameters (a stand-in for an optimizer
    step, cheap), then a device synchronize."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    with torch.no_grad():
        for p in _checked(model).values():
            p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 1e-3)
    torch.cuda.synchronize()


def _checked(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {
        "embed": params["model.embed_tokens.weight"],
        "q_proj": params["model.layers.0.self_attn.q_proj.weight"],
    }


def _bits(t: torch.Tensor) -> int:
    return int(t.detach().contiguous().view(torch.int16).to(torch.int64).sum().item())


def trainer_checksums(model: torch.nn.Module) -> dict[str, int]:
    """The int64 sums of the bf16 bit patterns of the embedding and of layer 0's q, k
    and v together (vLLM's ``qkv_proj`` is them concatenated)."""
    params = dict(model.named_parameters())
    attn = "model.layers.0.self_attn."
    qkv = sum(_bits(params[f"{attn}{x}_proj.weight"]) for x in "qkv")
    return {"embed": _bits(params["model.embed_tokens.weight"]), "qkv_proj": qkv}


def _engine_checksums(worker: Any, vocab: int) -> dict[str, int]:
    """Run in each vLLM worker (``collective_rpc``): the same sums as
    :func:`trainer_checksums`, of the engine's own parameters. Self-contained: it is
    pickled by value."""
    import torch

    def bits(t: torch.Tensor) -> int:
        return int(t.detach().contiguous().view(torch.int16).to(torch.int64).sum().item())

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    inner = model.model
    return {
        "embed": bits(inner.embed_tokens.weight[:vocab]),
        "qkv_proj": bits(inner.layers[0].self_attn.qkv_proj.weight),
    }


def check(llm: Any, model: torch.nn.Module, vocab: int) -> str:
    """``"OK"`` when every worker's checksums are the trainer's, else ``"MISMATCH ..."``."""
    want = trainer_checksums(model)
    got: list[dict[str, int]] = llm.collective_rpc(_engine_checksums, args=(vocab,))
    bad = [g for g in got if g != want]
    return "OK" if not bad else f"MISMATCH (trainer {want}, engine {bad[0]})"


# --- measuring --------------------------------------------------------------------------------


class FreeMemoryPoller:
    """The least device-wide free GPU memory seen while open (a thread polls
    ``torch.cuda.mem_get_info`` every ``interval`` seconds); ``baseline`` is the free
    memory on entry."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.baseline = 0
        self.least = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        free, _ = torch.cuda.mem_get_info(0)
        self.least = min(self.least, free)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> FreeMemoryPoller:
        torch.cuda.synchronize()
        self.baseline = self.least = torch.cuda.mem_get_info(0)[0]
        self._thread = threading.Thread(target=self._run, name="mem-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    @property
    def extra_mib(self) -> float:
        return (self.baseline - self.least) / MIB


def summary(name: str, times_ms: Sequence[float], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "times_ms": list(times_ms),
        "median_ms": statistics.median(times_ms),
        "min_ms": min(times_ms),
        "max_ms": max(times_ms),
        **extra,
    }


def timed_sync(
    refit: Callable[[int], None], model: torch.nn.Module, warmup: int, repeats: int
) -> tuple[list[float], float]:
    """Warm-up refits, then ``repeats`` timed ones (ms), then one more refit for the peak
    extra MiB: the poller's thread (1 kHz) would contend for this process's GIL, so it
    runs during none of the timed refits."""
    version = 1
    for _ in range(warmup):
        perturb(model, version)
        refit(version)
        version += 1
    times: list[float] = []
    for _ in range(repeats):
        perturb(model, version)
        start = time.perf_counter()
        refit(version)
        times.append((time.perf_counter() - start) * 1e3)
        version += 1
    perturb(model, version)
    with FreeMemoryPoller() as poller:
        refit(version)
    return times, poller.extra_mib


async def timed_async(
    refit: Callable[[int], Awaitable[Any]], model: torch.nn.Module, warmup: int, repeats: int
) -> tuple[list[float], float]:
    """:func:`timed_sync` for ``await refit(version)``."""
    version = 1
    for _ in range(warmup):
        perturb(model, version)
        await refit(version)
        version += 1
    times: list[float] = []
    for _ in range(repeats):
        perturb(model, version)
        start = time.perf_counter()
        await refit(version)
        times.append((time.perf_counter() - start) * 1e3)
        version += 1
    perturb(model, version)
    with FreeMemoryPoller() as poller:
        await refit(version)
    return times, poller.extra_mib


# --- the rows ---------------------------------------------------------------------------------


def measure_limit(model: torch.nn.Module, repeats: int) -> dict[str, Any]:
    """Device-to-device ``copy_`` of every parameter into a preallocated one (CUDA
    events), after one warm-up."""
    params = [p.detach() for p in model.parameters()]
    dst = [torch.empty_like(p) for p in params]
    nbytes = sum(p.nbytes for p in params)
    cuda: Any = torch.cuda  # Event is untyped in torch's stubs

    def copy() -> None:
        for d, s in zip(dst, params, strict=True):
            d.copy_(s)

    with torch.no_grad():
        copy()
        torch.cuda.synchronize()
        times: list[float] = []
        with FreeMemoryPoller() as poller:
            for _ in range(repeats):
                begin, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
                begin.record()
                copy()
                end.record()
                end.synchronize()
                times.append(float(begin.elapsed_time(end)))
    dst.clear()
    torch.cuda.empty_cache()
    row = summary(LIMIT, times, peak_extra_mib=poller.extra_mib, destination_bytes=nbytes)
    row["read_write_gbps"] = 2 * nbytes / (row["median_ms"] * 1e-3) / 1e9
    row["payload_gbps"] = nbytes / (row["median_ms"] * 1e-3) / 1e9
    return row


async def asyncrefit_row(
    name: str,
    llm: Any,
    model: torch.nn.Module,
    *,
    zero_copy: bool,
    direct: bool = False,
    budget_bytes: int,
    warmup: int,
    repeats: int,
    vocab: int,
    timeline: int = 0,
    ahead: bool = True,
) -> dict[str, Any]:
    from asyncrefit import LocalTrainer, RefitCoordinator
    from asyncrefit.planning import plan_buckets
    from asyncrefit.trainer import CudaSharedParameterTrainer
    from asyncrefit.transport.cuda_ipc import CudaIpcExporter
    from asyncrefit.vllm import connect_llm

    source: Any
    if zero_copy:  # the parameters move into the trainer's slabs (and stay there)
        source = CudaSharedParameterTrainer(model, device=0)
    else:
        exporter = CudaIpcExporter(0)
        source = LocalTrainer(model, exporter=exporter, devices=[exporter.device_id])
    # As benchmarks/cuda_ipc_bench.py: buckets of half the budget, 2 slots of the
    # largest bucket the plan makes.
    bucket_bytes = budget_bytes // 2
    plan = plan_buckets(source.specs(), bucket_bytes)
    slots_bytes = 2 * plan.max_bucket_bytes
    reports: list[Any] = []
    async with (
        connect_llm(llm) as workers,
        RefitCoordinator(
            trainer=source,
            workers=workers,
            budget_bytes=slots_bytes,
            bucket_bytes=bucket_bytes,
            direct_write=direct,
        ) as refit,
    ):
        if not ahead:  # the baseline: read the trainer's tensors, then begin
            refit._begins_ahead = lambda: False  # type: ignore[method-assign]

        async def push(version: int) -> None:
            reports.append(await refit.push(version))

        times, extra = await timed_async(push, model, warmup, repeats)
        report = reports[-1]
        timed = [dataclasses.asdict(r.stages) for r in reports[-repeats - 1 : -1]]
        traced = PushTimeline()
        with traced:  # after the timed refits: its wrappers are in none of them
            for version in range(report.version + 1, report.version + 1 + timeline):
                perturb(model, version)
                await push(version)
    if timeline:
        say(traced.table(title=f"{name} timeline"))
    return summary(
        name,
        times,
        peak_extra_mib=extra,
        check=check(llm, model, vocab),
        bucket_bytes=bucket_bytes,
        budget_bytes=slots_bytes,
        buckets=report.buckets,
        bytes=report.bytes,
        transports=sorted(report.bytes_per_transport),
        stages_ms={k: statistics.median(t[k] for t in timed) * 1e3 for k in timed[0]},
        timeline=traced.summary() if timeline else [],
    )


def engine_calls(llm: Any, repeats: int = 30) -> dict[str, dict[str, float]]:
    """What one of vLLM's own engine calls costs on this machine (the engine idle): an
    RPC to every worker that does nothing (``check_health``) and a prefix-cache reset;
    median and min in ms. The control channel takes a direct push's begin and commit
    off the first; the second stays in every push."""
    found: dict[str, dict[str, float]] = {}
    calls: dict[str, Callable[[], object]] = {
        "collective_rpc (no-op)": lambda: llm.collective_rpc("check_health"),
        "reset_prefix_cache": lambda: llm.reset_prefix_cache(),
    }
    for name, call in calls.items():
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        found[name] = {"median_ms": statistics.median(times), "min_ms": min(times)}
    return found


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` (0.32) over an in-process ``LLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update()

    def shutdown_weight_transfer_engine(self) -> None:
        shutdown = getattr(self.llm, "shutdown_weight_transfer_engine", None)
        if shutdown is not None:
            shutdown()


def vllm_ipc_sender(llm: Any, model: torch.nn.Module, packed: bool) -> Callable[[], None]:
    """One whole refit through vLLM's IPC backend (start, send, finish), as the
    installed vLLM does it, after its one-time init.

    vLLM 0.32: a trainer-side ``IPCTrainerWeightTransferEngine`` over a client of the
    ``LLM``; ``packed`` is agreed at init, and ``send_weights`` runs
    ``start_weight_update``, ``update_weights`` per chunk and ``finish_weight_update``.
    vLLM 0.26: the static ``IPCWeightTransferEngine.trainer_send_weights`` with a
    callable ``send_mode`` that calls ``llm.update_weights``, between
    ``start_weight_update`` and ``finish_weight_update``; ``packed`` rides each update.
    """
    from vllm.distributed.weight_transfer import ipc_engine

    trainer_cls = getattr(ipc_engine, "IPCTrainerWeightTransferEngine", None)
    if trainer_cls is not None:  # 0.32 on
        from vllm.distributed.weight_transfer.base import ModuleSource

        info = ipc_engine.IPCTrainerInitInfo(packed=packed, rank=0)
        engine = trainer_cls.trainer_init(info, client=LLMClient(llm), source=ModuleSource(model))

        def send_032() -> None:
            engine.send_weights()

        return send_032

    # 0.26
    llm.init_weight_transfer_engine({"init_info": {}})
    send_weights = getattr(ipc_engine.IPCWeightTransferEngine, "trainer_send_weights")  # noqa: B009

    def send_mode(info: Any) -> None:
        llm.update_weights({"update_info": dataclasses.asdict(info)})

    def send_026() -> None:
        start = getattr(llm, "start_weight_update", None)
        if start is not None:
            start()
        send_weights(iter(model.named_parameters()), {"send_mode": send_mode, "packed": packed})
        llm.finish_weight_update()

    return send_026


def vllm_ipc_row(
    name: str,
    llm: Any,
    model: torch.nn.Module,
    *,
    packed: bool,
    warmup: int,
    repeats: int,
    vocab: int,
) -> dict[str, Any]:
    send = vllm_ipc_sender(llm, model, packed)

    def refit(version: int) -> None:
        send()

    times, extra = timed_sync(refit, model, warmup, repeats)
    torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
    return summary(name, times, peak_extra_mib=extra, check=check(llm, model, vocab), packed=packed)


def run_row(rows: list[dict[str, Any]], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one row; a failure is printed (with its traceback) and recorded, not raised."""
    say(name)
    try:
        row = fn()
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        say(f"{name} FAILED: {exc!r}")
        row = {"name": name, "error": repr(exc)}
    else:
        if row.get("check", "OK") != "OK":
            say(f"{name}: {row['check']}")
    rows.append(row)


# --- the engines ------------------------------------------------------------------------------


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "enforce_eager": True,
        "dtype": "bfloat16",
        "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "seed": 0,
    }


@contextlib.contextmanager
def engine(path: Path, **kwargs: Any) -> Iterator[Any]:
    """A ``vllm.LLM`` on ``path``; shut down fully on exit (engine core, memory)."""
    from vllm import LLM

    free_before = torch.cuda.mem_get_info(0)[0]
    llm = LLM(model=str(path), **kwargs)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        _wait_for_memory(free_before)


def _wait_for_memory(free_before: int, timeout: float = 120.0) -> None:
    """Wait until the engine's processes gave their GPU memory back (within 1 GiB)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free = torch.cuda.mem_get_info(0)[0]
        if free >= free_before - GIB:
            return
        time.sleep(0.5)
    say(
        f"the engine's GPU memory did not come back in {timeout:.0f} s "
        f"({(free_before - torch.cuda.mem_get_info(0)[0]) / GIB:.1f} GiB still taken)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import vllm

    from asyncrefit.tools._machine import machine_info
    from asyncrefit.vllm import engine_args

    model_config = TINY if args.tiny else LLAMA_7B
    vocab = int(model_config["vocab_size"])
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(gpu=True),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "vllm": str(getattr(vllm, "__version__", "unknown")),
        "model": model_config,
        "tiny": args.tiny,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "budget_bytes": int(args.budget_gib * GIB),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
    }
    say("building the trainer's model")
    model = make_trainer(model_config)
    params = list(model.parameters())
    result["tensors"] = len(params)
    result["bytes"] = sum(p.nbytes for p in params)
    say(f"{len(params)} tensors, {result['bytes'] / 1e9:.2f} GB")
    rows: list[dict[str, Any]] = []
    result["rows"] = rows
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    try:
        write_checkpoint(workdir, model_config, model)
        run_row(rows, LIMIT, functools.partial(measure_limit, model, args.repeats))
        common = engine_kwargs(args)
        # vLLM's own IPC backend first: the zero-copy row moves the trainer's
        # parameters into slabs, so it runs last.
        if not args.skip_vllm_ipc:
            say("starting the vLLM IPC engine")
            try:
                with engine(
                    workdir,
                    load_format="dummy",
                    weight_transfer_config={"backend": "ipc"},
                    **common,
                ) as llm:
                    for name, packed in ((IPC_PACKED, True), (IPC_UNPACKED, False)):
                        run_row(
                            rows,
                            name,
                            functools.partial(
                                vllm_ipc_row,
                                name,
                                llm,
                                model,
                                packed=packed,
                                warmup=args.warmup,
                                repeats=args.repeats,
                                vocab=vocab,
                            ),
                        )
            except Exception as exc:  # the engine itself: its rows fail, the others run
                traceback.print_exc(file=sys.stderr)
                _fail_missing(rows, (IPC_PACKED, IPC_UNPACKED), f"engine: {exc!r}")
        say("starting the asyncrefit engine")
        try:
            with engine(workdir, load_format="safetensors", **common, **engine_args()) as llm:
                result["engine_calls"] = engine_calls(llm)
                for name, zero_copy, direct, ahead in (
                    (DIRECT, False, True, True),
                    (DIRECT_READ_FIRST, False, True, False),
                    (STAGED, False, False, True),
                    (ZERO_COPY, True, False, True),
                ):
                    call = functools.partial(
                        asyncrefit_row,
                        name,
                        llm,
                        model,
                        zero_copy=zero_copy,
                        direct=direct,
                        budget_bytes=int(args.budget_gib * GIB),
                        warmup=args.warmup,
                        repeats=args.repeats,
                        vocab=vocab,
                        timeline=args.timeline if direct and ahead else 0,
                        ahead=ahead,
                    )
                    run_row(rows, name, functools.partial(anyio.run, call, backend="asyncio"))
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            _fail_missing(rows, (DIRECT, DIRECT_READ_FIRST, STAGED, ZERO_COPY), f"engine: {exc!r}")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


def _fail_missing(rows: list[dict[str, Any]], names: Sequence[str], error: str) -> None:
    done = {r["name"] for r in rows}
    rows.extend({"name": n, "error": error} for n in names if n not in done)


# --- the report -------------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    from asyncrefit.tools._table import Column, table

    m = result["machine"]
    rows = {r["name"]: r for r in result["rows"]}
    limit = rows.get(LIMIT, {})
    limit_ms = limit.get("median_ms")
    shape = "tiny Llama (2 layers, hidden 256)" if result["tiny"] else "Llama-2-7B shapes"
    lines = [
        f"vLLM refit on one GPU, {result['date']}: {result['device']}, driver {m['driver']}, "
        f"torch {result['torch']} (CUDA {m['cuda']}), vLLM {result['vllm']}, "
        f"Python {m['python']}",
        f"{result['tensors']} bf16 tensors ({shape}), {result['bytes'] / 1e9:.2f} GB; "
        f"{result['warmup']} warm-up + {result['repeats']} timed refits per row; "
        f"asyncrefit budget {result['budget_bytes'] / GIB:g} GiB; "
        f"gpu_memory_utilization {result['gpu_memory_utilization']}",
        "",
    ]
    columns = (
        Column("row", 22, left=True),
        Column("median ms", 10, ".2f"),
        Column("min", 9, ".2f"),
        Column("max", 9, ".2f"),
        Column("x one-copy limit", 17, ".2f"),
        Column("peak extra MiB", 15, ".0f"),
        Column("check", 6, left=True, gap=2),
    )
    out: list[tuple[object, ...] | str] = []
    for r in result["rows"]:
        if "error" in r:
            out.append(f"{r['name']:<22}  FAILED: {r['error']}")
            continue
        ratio: object = limit_ms / r["median_ms"] if limit_ms else "-"
        peak: object = "-" if r["name"] == LIMIT else r["peak_extra_mib"]
        verdict = r.get("check", "-")
        out.append(
            (
                r["name"],
                r["median_ms"],
                r["min_ms"],
                r["max_ms"],
                ratio,
                peak,
                verdict if len(verdict) < 12 else "MISMATCH",
            )
        )
    lines += table(columns, out, gap=1)
    lines.append("")
    if limit_ms:
        lines.append(
            f"one-copy limit: {limit_ms:.2f} ms, {limit['payload_gbps']:.0f} GB/s copied "
            f"({limit['read_write_gbps']:.0f} GB/s read + written), CUDA events; its "
            f"destination ({limit['destination_bytes'] / MIB:.0f} MiB) is allocated before "
            "the timing"
        )
    for ours in (DIRECT, STAGED):
        mine = rows.get(ours, {})
        for other in (IPC_PACKED, IPC_UNPACKED):
            o = rows.get(other, {})
            if "median_ms" in mine and "median_ms" in o:
                lines.append(
                    f"{ours} vs {other}: {o['median_ms'] / mine['median_ms']:.2f}x faster "
                    "(median over median)"
                )
    ahead, first = rows.get(DIRECT, {}), rows.get(DIRECT_READ_FIRST, {})
    if "median_ms" in ahead and "median_ms" in first:
        lines.append(
            f"{DIRECT} (begun while the trainer is read) vs {DIRECT_READ_FIRST}: "
            f"{first['median_ms'] - ahead['median_ms']:.2f} ms less a push (median minus median)"
        )
    for r in result["rows"]:
        if "stages_ms" in r:
            s = ", ".join(f"{k} {v:.2f}" for k, v in r["stages_ms"].items())
            via = "+".join(r.get("transports", ["?"]))
            lines.append(
                f"{r['name']}: {r['buckets']} buckets of <= {r['bucket_bytes'] // MIB} MiB, "
                f"budget {r['budget_bytes'] / MIB:.0f} MiB, via {via}; "
                f"stages (ms, median of the timed refits): {s}"
            )
        if r.get("check", "OK") != "OK":
            lines.append(f"{r['name']}: {r['check']}")
    for call, t in result.get("engine_calls", {}).items():
        lines.append(
            f"one vLLM engine call, {call}: {t['median_ms']:.2f} ms (min {t['min_ms']:.2f})"
        )
    lines += [
        "x one-copy limit: the limit's median over the row's median (wall clock around each "
        "whole refit);",
        "peak extra MiB: device-wide GPU memory taken during one more refit beyond that "
        "just before it (polled by a thread at 1 kHz, which runs during no timed refit)",
    ]
    return "\n".join(lines)


INTRO = f"""
{SECTION} (`{SCRIPT}`)

    python {SCRIPT} [--tiny] [--repeats 5] [--out x.json] [--record]

A `vllm.LLM` on one GPU (enforce-eager, bf16) serving Llama-2-7B shapes (291 tensors,
13.48 GB), refit from a `transformers` trainer in the same process on the same GPU by
asyncrefit (written directly into the engine's parameters by its copy plan, staged
through 2 CUDA IPC slots, and zero-copy from IPC-shared slabs) and
by vLLM's own `"ipc"` weight-transfer backend (packed and unpacked, on an engine of its
own), against the one-copy limit (a device-to-device `copy_` of every tensor, CUDA
events) measured in the same run. Wall clock around each whole refit after warm-ups;
peak extra GPU memory polled device-wide; each row checked by checksums of the
engine's embedding and layer 0's `qkv_proj`. See the script's docstring.
"""


def record(result: dict[str, Any], text: str, argv: Sequence[str] | None) -> None:
    from asyncrefit.tools._table import append_to_section, recorded_command, results_section

    command = recorded_command(SCRIPT, argv).replace(" --record", "")
    title = (
        f"{result['date'][:10]}: {result['device']}, torch {result['torch']}, "
        f"vLLM {result['vllm']}" + (" (tiny)" if result["tiny"] else "")
    )
    section = results_section(title, command, text, result)
    if SECTION not in RESULTS.read_text():
        section = INTRO + section
    append_to_section(RESULTS, SECTION, section)
    say(f"recorded in {RESULTS}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 256 (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed refits per row (5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up refits per row (2)")
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=2.0,
        help="asyncrefit's staging budget: 2 slots of half of it (2.0)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="vLLM's (0.35)")
    parser.add_argument("--max-model-len", type=int, default=512, help="vLLM's (512)")
    parser.add_argument("--skip-vllm-ipc", action="store_true", help="no vLLM IPC rows")
    parser.add_argument(
        "--workdir", default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    parser.add_argument(
        "--timeline",
        type=int,
        default=0,
        help="traced direct refits after the timed ones (benchmarks/push_timeline.py)",
    )
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--record", action="store_true", help=f"append the table to {RESULTS.name}")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if not torch.cuda.is_available():
        print("vllm_gpu_bench: needs a CUDA GPU (none is visible here)", file=sys.stderr)
        return 2
    # Before vLLM is imported: settings the engine and its processes read.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # CUDA is initialized here before the engine starts: its processes must spawn.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # collective_rpc with a function (the checksums) and vLLM IPC's update_info (CUDA
    # IPC handles: tuples of torch types) travel to the engine core pickled.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    result = run(args)
    text = format_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.record:
        record(result, text, argv)
    print(f"device: {result['device']}; torch {result['torch']}; vLLM {result['vllm']}")
    print(text)
    failed = [r["name"] for r in result["rows"] if "error" in r or r.get("check", "OK") != "OK"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
