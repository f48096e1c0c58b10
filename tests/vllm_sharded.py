"""FSDP2 trainer ranks that push into a vLLM engine: module-level, so spawn can run them.

Each rank process joins a gloo group, loads the tiny ``transformers`` Llama checkpoint
the engine serves (fp32), shards it with ``fully_shard`` (every decoder layer, then
the root) and serves a :class:`~asyncrefit.trainer.DTensorSource` behind a
:class:`~asyncrefit.trainer.RankServer`. For step ``s`` it waits until the test asks
for version ``s`` (``wanted``), then trains (one AdamW step on tokens seeded by
``s``), so the push's first request arrives while it still trains; then every rank
gathers every parameter (``full_tensor()``, a collective), and rank 0 loads them,
cast to the engine's dtype, into a plain ``transformers`` model and sends the test
that model's greedy tokens and its parameters. Then it serves the push. After its last
step it serves until the coordinator closes.
"""

from __future__ import annotations

import io
import os
import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrefit.transport.shm import list_segments

from .vllm_models import PROMPTS, greedy, load_trainer


@dataclass(frozen=True)
class RankPlan:
    """What a rank process does."""

    world: int
    port: int
    directory: str  # where the ranks' sockets live
    checkpoint: str
    steps: int
    dtype: str  # the engine's: the greedy reference runs in it
    tokens: int
    lr: float = 1e-2


def _train(model: Any, optimizer: torch.optim.Optimizer, step: int, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(step))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _gathered_greedy(model: Any, reference: Any, plan: RankPlan) -> list[list[int]] | None:
    """Gather every parameter on every rank; rank 0's greedy tokens with them (else None)."""
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    if reference is None:
        return None
    params = dict(reference.named_parameters())
    assert set(params) == set(full), set(params) ^ set(full)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(full[name])  # cast to the engine's dtype
    return greedy(reference, PROMPTS, plan.tokens)


def _state_bytes(model: Any) -> bytes:
    """``model``'s parameters (the gathered ones, in the engine's dtype), serialised."""
    buffer = io.BytesIO()
    torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, buffer)
    return buffer.getvalue()


def rank_main(rank: int, plan: RankPlan, asks: list[Any], results: Any) -> None:
    import anyio
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncrefit import cpu_device
    from asyncrefit.trainer import DTensorSource, RankServer, rank_path

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port))
    dist.init_process_group("gloo", rank=rank, world_size=plan.world)
    try:
        mesh = init_device_mesh("cpu", (plan.world,))
        model: Any = load_trainer(Path(plan.checkpoint)).train()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr)
        vocab = model.config.vocab_size
        reference = None
        if rank == 0:
            reference = load_trainer(Path(plan.checkpoint)).to(getattr(torch, plan.dtype))
        # Rank r serves device cpu:r; the engine's one worker is on cpu:0, so rank 1
        # serves no worker, and must gather all the same.
        source = DTensorSource(model, devices=[cpu_device(rank)])
        server = RankServer(source, rank_path(plan.directory, rank))

        async def serve() -> None:
            async with server:
                for step in range(1, plan.steps + 1):
                    asked = await anyio.to_thread.run_sync(asks[step - 1].wait, 300.0)
                    assert asked, f"version {step} was never asked for"
                    _train(model, optimizer, step, vocab)
                    expected = _gathered_greedy(model, reference, plan)
                    if expected is not None:
                        assert reference is not None
                        results.put(("expected", step, expected, _state_bytes(reference)))
                    results.put(("serving", rank, step, time.monotonic()))
                    outcome = await server.serve_push()
                    results.put(("served", rank, step, outcome.version, outcome.ok))
                    if outcome.closed:
                        results.put(("closed", rank, step))
                        return
                while not (await server.serve_push()).closed:
                    pass
                results.put(("closed", rank, plan.steps))

        anyio.run(serve)
    finally:
        dist.destroy_process_group()


class Inbox:
    """The ranks' messages, taken by kind (others are kept for later)."""

    def __init__(self, results: Any) -> None:
        self._results = results
        self._pending: list[tuple[Any, ...]] = []

    def take(self, kind: str, timeout: float = 120.0) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            for i, item in enumerate(self._pending):
                if item[0] == kind:
                    return self._pending.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind!r} from the trainer ranks")
            try:
                self._pending.append(self._results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                pass


@dataclass
class Ranks:
    """The running rank processes, their messages, and the steps they may train."""

    processes: list[Any]
    inbox: Inbox
    asks: list[Any]  # one multiprocessing Event per step

    def ask(self, step: int) -> None:
        """Let the ranks train ``step`` (and then serve its push)."""
        self.asks[step - 1].set()

    def release(self) -> None:
        """Let the ranks run through every step (a failed test: they find the
        coordinator gone at their next ``serve_push`` and end)."""
        for event in self.asks:
            event.set()


@contextmanager
def trainer_ranks(plan: RankPlan) -> Iterator[Ranks]:
    """Start the ranks; on exit wait for them (released), kill stragglers."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    asks = [context.Event() for _ in range(plan.steps)]
    processes = [
        context.Process(target=rank_main, args=(r, plan, asks, results), daemon=True)
        for r in range(plan.world)
    ]
    for p in processes:
        p.start()
    ranks = Ranks(processes=processes, inbox=Inbox(results), asks=asks)
    try:
        yield ranks
    finally:
        ranks.release()
        for p in processes:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
        results.close()
        results.join_thread()


def rank_segments(processes: list[Any]) -> list[str]:
    """Shared-memory segments made by the rank processes and still there."""
    pids = {p.pid for p in processes}
    return [s for s in list_segments() if int(s.split("-")[1]) in pids]
