"""Models on the GPU for the CUDA tests: module-level factories, so spawned workers build them.

Each factory seeds torch's CPU generator, builds the module on the CPU and moves it to
``cuda`` (the current device of the calling process), so every call gives the same
values, in the trainer and in every worker.
"""

from __future__ import annotations

import torch


class OnDevice(torch.nn.Module):
    """Wraps a module on the GPU: inputs move to its device, outputs come back to the CPU."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = next(self.inner.parameters()).device
        out: torch.Tensor = self.inner(x.to(device))
        return out.cpu()


def make_gpu_mlp() -> torch.nn.Module:
    """A two-layer MLP (~0.5 M float32 parameters) on the GPU."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )
    return OnDevice(net).to("cuda")


def make_gpu_mixed() -> torch.nn.Module:
    """Parameters of several dtypes (float32, bfloat16, float16, float64) and a zero-size one."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(333, 77))
    m.b = torch.nn.Parameter(torch.randn(50_000).to(torch.bfloat16))
    m.c = torch.nn.Parameter(torch.randn(55, 5).to(torch.float16))
    m.empty = torch.nn.Parameter(torch.empty(0, 4))
    m.d = torch.nn.Parameter(torch.randn(3).double())
    m.e = torch.nn.Parameter(torch.randn(256, 256).to(torch.bfloat16))
    return m.to("cuda")


#: Bytes of :func:`make_gpu_medium`'s parameters (6 float32 matrices of 4 Mi elements).
MEDIUM_BYTES = 6 * 4 * 2**22


def make_gpu_medium() -> torch.nn.Module:
    """96 MiB of float32 matrices on the GPU: enough for several large buckets."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    for i in range(6):
        m.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(2048, 2048)))
    return m.to("cuda")


def write_then_die(destinations: object, sends: object, repeats: int) -> None:
    """A trainer process that opens ``destinations`` (a worker's, on GPU 0), issues
    ``repeats`` writes of ones into every place, records the worker's completion event
    after them, says so on ``sends`` (a connection) and exits at once, its writes still
    running: what a trainer killed mid-push leaves behind."""
    import os

    from asyncrefit.transport.destinations import Destinations, open_destinations

    assert isinstance(destinations, Destinations)
    opened = open_destinations(destinations)
    with torch.no_grad():
        for _ in range(repeats):
            for places in opened.places.values():
                for place, _box in places:
                    place.fill_(1.0)
    assert opened.mark()
    sends.send("recorded")  # type: ignore[attr-defined]
    os._exit(0)
