"""A trainer in its own process on the GPU, serving its source to a coordinator in the
test process (:class:`~asyncrefit.trainer.RankServer`): module-level, so spawn can run
it. The test kills it in the middle of a push."""

from __future__ import annotations

from typing import Any

import anyio
import torch

from asyncrefit import LocalTrainer
from asyncrefit.trainer import RankServer
from asyncrefit.transport.cuda_ipc import CudaIpcExporter

from .moe_models import train_step
from .vllm_models import load_trainer


def trainer_main(checkpoint: str, path: str, seed: int, ready: Any, device: str) -> None:
    """Load the checkpoint in bf16 on ``device`` (cuda:0, or the CPU for a rehearsal),
    take one optimizer step, serve pushes until the coordinator closes."""
    model = load_trainer(checkpoint).to(device, torch.bfloat16)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, seed=seed)
    if device == "cpu":
        source = LocalTrainer(model)
    else:
        exporter = CudaIpcExporter(0)
        source = LocalTrainer(model, exporter=exporter, devices=[exporter.device_id])

    async def serve() -> None:
        async with RankServer(source, path) as server:
            ready.put("listening")
            while not (await server.serve_push()).closed:
                pass

    anyio.run(serve)
