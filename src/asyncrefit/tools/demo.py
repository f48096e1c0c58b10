"""``asyncrefit demo``: train a small transformer, push it to local workers, verify.

Every optimizer step is followed by a push; after each push every worker must hold
bitwise the trainer's parameters (digests), report the pushed version, and compute
logits bitwise equal to the trainer's on a fixed batch, which differ from the
previous version's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from .._core._coordinator import RefitCoordinator
from .._loop import backend_options
from ..local._client import LocalWorker, spawn_local_workers
from ._failure import report_failure
from ._table import Column, table
from ._verify import mismatches, module_digests
from .demo_model import ModelConfig, build_model, copy_task_batch

if TYPE_CHECKING:
    import torch

    from ..metrics import RefitMetrics

BUDGET_BYTES = 8 * 2**20
"""Staging budget: two 4 MiB buckets in flight, so the ~13 MiB model takes several."""

TRAIN_BATCH = 16
EVAL_BATCH = 4
SEQUENCE = 64
LEARNING_RATE = 3e-3
DATA_SEED = 0
EVAL_SEED = 1


class _Progress:
    """A one-line progress bar on a text stream (stderr); silent when disabled."""

    def __init__(self, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self._total = max(1, total)
        self._done = 0
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._width = 30

    def advance(self, what: str, units: int = 1) -> None:
        """Count ``units`` more done and show ``what`` is next."""
        self._done = min(self._total, self._done + units)
        self.show(what)

    def show(self, what: str) -> None:
        """Redraw the bar with the label ``what``."""
        if not self._enabled:
            return
        filled = self._width * self._done // self._total
        bar = "#" * filled + "-" * (self._width - filled)
        pct = 100 * self._done // self._total
        self._stream.write(f"\r[{bar}] {pct:3d}% {what:<28.28}")
        self._stream.flush()

    def close(self) -> None:
        """Erase the bar."""
        if self._enabled:
            self._stream.write("\r" + " " * (self._width + 40) + "\r")
            self._stream.flush()


def _reference_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The trainer's logits as a worker computes them: eval mode, no grad, one thread."""
    import torch

    threads = torch.get_num_threads()
    training = model.training
    torch.set_num_threads(1)  # workers run with one thread: same kernels, same bits
    model.eval()
    try:
        with torch.no_grad():
            logits: torch.Tensor = model(tokens)
    finally:
        model.train(training)
        torch.set_num_threads(threads)
    return logits


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` of positions ``0..t-2`` against tokens ``1..t-1``."""
    from torch.nn import functional as F

    pred = logits[:, :-1]
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tokens[:, 1:].reshape(-1))


def _train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
) -> float:
    """One AdamW step of next-token cross-entropy; returns the loss before the step."""
    import torch

    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = _next_token_loss(model(tokens), tokens)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.item())


async def _check(
    workers: list[LocalWorker],
    version: int | None,
    digests: dict[str, str],
    tokens: torch.Tensor,
    logits: torch.Tensor,
) -> dict[str, dict[str, bool]]:
    """Check every worker's digests (:func:`~asyncrefit.tools._verify.mismatches`), then
    ask every worker, concurrently, for its version and logits; compare."""
    import torch

    wrong = await mismatches(workers, digests)
    checks: dict[str, dict[str, bool]] = {}

    async def one(worker: LocalWorker) -> None:
        got_version = await worker.weight_version()
        got_logits = await worker.forward(tokens)
        checks[worker.name] = {
            "digests": not wrong[worker.name],
            "version": got_version == version,
            "logits": isinstance(got_logits, torch.Tensor) and torch.equal(got_logits, logits),
        }

    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(one, worker)
    return {w.name: checks[w.name] for w in workers}


@asynccontextmanager
async def _attached(metrics: RefitMetrics | None, refit: RefitCoordinator) -> AsyncIterator[None]:
    """``metrics`` attached to ``refit`` (as ``"demo"``) for the block, if any."""
    detach = metrics.attach(refit, "demo") if metrics is not None else None
    try:
        yield
    finally:
        if detach is not None:
            detach()


async def run_demo(
    workers: int = 2,
    steps: int = 3,
    *,
    progress: bool = False,
    metrics: RefitMetrics | None = None,
    after_push: Callable[[int], Awaitable[object]] | None = None,
) -> dict[str, Any]:
    """Train the demo transformer for ``steps`` steps, pushing after each; verify each push.

    Starts ``workers`` local worker processes, each building the same model, and pushes
    through a :class:`RefitCoordinator` with an 8 MiB budget (4 MiB buckets). Returns a
    JSON-ready dict: ``verified`` (every check of every push passed), ``workers``,
    ``steps``, ``parameters``, and ``pushes``, one dict per push with ``version``,
    ``bytes``, ``seconds``, ``gbps``, ``handle_bytes_per_worker``, ``buckets``,
    ``loss``, ``verified`` and the individual ``checks`` (plus the report's other
    fields). ``progress`` draws a progress bar on stderr. ``metrics`` are attached to
    the demo's coordinator (as ``"demo"``) while it is open; ``after_push(version)`` is
    awaited after each push was verified (to look at the metrics between pushes).

    Raises :class:`ValueError` for fewer than one worker or step, and the library's
    :class:`AsyncRefitError` subclasses if starting workers or a push fails.
    """
    import torch

    if workers < 1 or steps < 1:
        raise ValueError(f"need at least one worker and one step, got {workers} and {steps}")
    bar = _Progress(2 + 3 * steps, enabled=progress)
    started = time.perf_counter()
    bar.show(f"starting {workers} workers")

    model = build_model()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    data = torch.Generator().manual_seed(DATA_SEED)
    eval_tokens = copy_task_batch(torch.Generator().manual_seed(EVAL_SEED), EVAL_BATCH, SEQUENCE)
    previous = await anyio.to_thread.run_sync(_reference_logits, model, eval_tokens)

    pushes: list[dict[str, Any]] = []
    try:
        async with spawn_local_workers(build_model, workers) as pool:
            startup = time.perf_counter() - started
            bar.advance("checking initial weights")
            # Same factory, same seed: before any push the workers compute what we do.
            initial = await _check(pool, None, module_digests(model), eval_tokens, previous)
            initial_ok = all(all(c.values()) for c in initial.values())
            async with (
                RefitCoordinator(trainer=model, workers=pool, budget_bytes=BUDGET_BYTES) as refit,
                _attached(metrics, refit),
            ):
                bar.advance("training step 1")
                for step in range(1, steps + 1):
                    tokens = copy_task_batch(data, TRAIN_BATCH, SEQUENCE)
                    loss = await anyio.to_thread.run_sync(_train_step, model, optimizer, tokens)
                    bar.advance(f"pushing version {step}")

                    report = await refit.push(version=step)
                    bar.advance(f"verifying version {step}")

                    logits = await anyio.to_thread.run_sync(_reference_logits, model, eval_tokens)
                    digests = await anyio.to_thread.run_sync(module_digests, model)
                    checks = await _check(pool, step, digests, eval_tokens, logits)
                    changed = not torch.equal(logits, previous)
                    coordinator_ok = all(v == step for v in refit.versions().values())
                    ok = (
                        changed and coordinator_ok and all(all(c.values()) for c in checks.values())
                    )
                    entry = report.to_dict()
                    entry.update(
                        loss=loss,
                        eval_loss=float(_next_token_loss(logits, eval_tokens).item()),
                        verified=ok,
                        logits_changed=changed,
                        checks=checks,
                    )
                    pushes.append(entry)
                    previous = logits
                    if after_push is not None:
                        await after_push(step)
                    bar.advance(f"training step {step + 1}" if step < steps else "shutting down")
    finally:
        bar.close()

    return {
        "verified": initial_ok and all(p["verified"] for p in pushes),
        "workers": workers,
        "steps": steps,
        "parameters": parameters,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "model": asdict(ModelConfig()),
        "budget_bytes": BUDGET_BYTES,
        "initial_match": initial_ok,
        "startup_seconds": startup,
        "total_seconds": time.perf_counter() - started,
        "pushes": pushes,
    }


def _handle_bytes(per_worker: dict[str, int]) -> str:
    values = sorted(set(per_worker.values()))
    return str(values[0]) if len(values) == 1 else "/".join(str(v) for v in values)


def format_table(result: dict[str, Any]) -> str:
    """The human rendering of :func:`run_demo`'s result: one row per push."""
    mib = result["parameter_bytes"] / 2**20
    lines = [
        f"asyncrefit demo: {result['parameters']:,} parameters ({mib:.1f} MiB), "
        f"{result['workers']} workers, {result['steps']} steps, "
        f"budget {result['budget_bytes'] / 2**20:.0f} MiB "
        f"(workers up in {result['startup_seconds']:.1f} s)",
        "",
    ]
    columns = (
        Column("version", 7),
        Column("loss", 7, ".3f"),
        Column("buckets", 7),
        Column("MiB", 6, ".2f"),
        Column("ms", 7, ".1f"),
        Column("GB/s", 6, ".2f"),
        Column("handle B/worker", 15),
        Column("verified", left=True),
    )
    rows = [
        (
            p["version"],
            p["loss"],
            p["buckets"],
            p["bytes"] / 2**20,
            p["seconds"] * 1e3,
            p["gbps"],
            _handle_bytes(p["handle_bytes_per_worker"]),
            "✓" if p["verified"] else "✗",
        )
        for p in result["pushes"]
    ]
    lines += table(columns, rows, gap=2, rule=True)
    lines.append("")
    if result["verified"]:
        lines.append(
            f"all {len(result['pushes'])} pushes verified on {result['workers']} workers: "
            "parameters, versions and logits bitwise equal to the trainer's "
            f"({result['total_seconds']:.1f} s in all)"
        )
    else:
        what = "initial weights differ; " if not result["initial_match"] else ""
        bad = [str(p["version"]) for p in result["pushes"] if not p["verified"]]
        lines.append(f"NOT verified: {what}failed versions: {', '.join(bad) or 'none'}")
    return "\n".join(lines)


@contextmanager
def _metrics_served(port: int | None) -> Iterator[RefitMetrics | None]:
    """Metrics on a registry of their own, served on ``127.0.0.1:port`` for the block."""
    if port is None:
        yield None
        return
    from prometheus_client import CollectorRegistry

    from ..metrics import RefitMetrics, serve_metrics  # ImportError naming the extra

    metrics = RefitMetrics(CollectorRegistry())
    try:
        with serve_metrics(port, registry=metrics.registry) as server:
            print(f"asyncrefit demo: metrics on {server.url}", file=sys.stderr, flush=True)
            yield metrics
    finally:
        metrics.close()


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed ``demo`` arguments; returns the exit status.

    0 if every push verified, 1 if not or if the demo failed, 2 for bad arguments.
    With ``--json`` stdout holds exactly one JSON object whatever happens: the result,
    or ``{"verified": false, "error": ...}`` when the demo raised any exception
    (starting workers, training, a push, verifying, rendering) or the arguments are
    bad. Failures are also told on stderr (see :func:`asyncrefit.tools._failure.report_failure`);
    workers are stopped and shared memory released by :func:`run_demo` on every path.

    ``--metrics-port PORT`` serves the demo coordinator's Prometheus metrics on
    ``127.0.0.1:PORT`` while the demo runs (``0``: a free port); the address is told on
    stderr before the demo starts, ``asyncrefit demo: metrics on http://...``. The
    server is closed when the demo ends, whatever happens.
    """
    port = getattr(args, "metrics_port", None)
    if args.workers < 1 or args.steps < 1 or (port is not None and not 0 <= port <= 65535):
        message = "--workers and --steps must be at least 1, --metrics-port 0 to 65535"
        if args.json:
            print(json.dumps({"verified": False, "error": f"ValueError: {message}"}))
        print(f"asyncrefit demo: {message}", file=sys.stderr)
        return 2
    try:
        with _metrics_served(port) as metrics:
            run = functools.partial(
                run_demo,
                args.workers,
                args.steps,
                progress=not args.json and sys.stderr.isatty(),
                metrics=metrics,
            )
            result = anyio.run(run, backend="asyncio", backend_options=backend_options())
        text = json.dumps(result) if args.json else format_table(result)
    except Exception as exc:
        return report_failure("demo", exc, as_json=args.json)
    print(text)
    return 0 if result["verified"] else 1
