"""The README example: a training loop that awaits a refit after every step.

Run: .venv/bin/python examples/async_loop.py
"""

from __future__ import annotations

import anyio
import torch

from asyncrefit import RefitCoordinator
from asyncrefit.local import spawn_local_workers


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)
    )


async def main() -> None:
    policy = make_policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    async with spawn_local_workers(make_policy, 2) as workers:  # 2 inference processes
        async with RefitCoordinator(trainer=policy, workers=workers, budget_bytes=1 << 20) as refit:
            for step in range(1, 4):
                loss = policy(torch.randn(32, 128)).pow(2).mean()  # your RL loss here
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                report = await refit.push(version=step)  # every worker now holds `step`
                print(report)


if __name__ == "__main__":
    anyio.run(main)
