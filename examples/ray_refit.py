"""Refit across a Ray cluster: trainer shards and inference workers as Ray async actors.

Run:
    .venv/bin/python examples/ray_refit.py                    # starts a local cluster
    .venv/bin/python examples/ray_refit.py --address auto     # joins an existing one

On every node of the cluster, for each of ``--devices`` (virtual CPU) devices, it
starts one trainer shard and ``--workers`` inference actors on that device. The shards
are data-parallel replicas (as DDP ranks are): they take identical steps, so they hold
identical weights. After every step the driver awaits a refit: each inference actor is
served by the shard on its own node and device, and is sent only that shard's handles.
Each version is checked bitwise (parameter digests and a forward pass).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from asyncrefit import RefitCoordinator
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.ray import RayTrainerSource, RayWorker, RefitTrainerMixin, RefitWorkerMixin


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)
    )


def digests(module: torch.nn.Module) -> dict[str, str]:
    return {name: tensor_digest(p) for name, p in module.named_parameters()}


class Trainer(RefitTrainerMixin):
    """One trainer shard: a policy, its optimizer, and the refit source over it."""

    def __init__(self, device: str) -> None:
        torch.set_num_threads(1)
        self.policy = make_policy()
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=1e-3)
        self.init_refit_source(self.policy, devices=[device])

    async def train_step(self, step: int) -> float:
        def run() -> float:
            batch = torch.randn(32, 128, generator=torch.Generator().manual_seed(step))
            loss = self.policy(batch).pow(2).mean()  # your RL loss here
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            return float(loss.detach())

        return await anyio.to_thread.run_sync(run)  # the actor's loop stays responsive

    async def digests(self) -> dict[str, str]:
        return digests(self.policy)

    async def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.policy(x)  # type: ignore[no-any-return]


class Policy(RefitWorkerMixin):
    """One inference actor: the module it serves (stands in for an engine) on a device."""

    def __init__(self, device: str) -> None:
        torch.set_num_threads(1)
        self.policy = make_policy().eval()
        self.init_refit(self.policy, device=device)

    async def generate(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.policy(x)  # type: ignore[no-any-return]


async def run(nodes: list[str], devices: int, workers_per_device: int, steps: int) -> None:
    trainers: list[Any] = []  # Ray actor handles
    policies: list[Any] = []
    names: list[str] = []
    for n, node in enumerate(nodes):
        on_node = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        for d in range(devices):
            device = f"cpu:{d}"
            trainer_cls = ray.remote(Trainer).options(num_cpus=0, scheduling_strategy=on_node)
            trainers.append(trainer_cls.remote(device))
            for w in range(workers_per_device):
                policy_cls = ray.remote(Policy).options(num_cpus=0, scheduling_strategy=on_node)
                policies.append(policy_cls.remote(device))
                names.append(f"node{n}-{device}-policy{w}")
    print(f"{len(nodes)} node(s): {len(trainers)} trainer shards, {len(policies)} inference actors")

    sources = [RayTrainerSource(t, name=f"shard-{i}") for i, t in enumerate(trainers)]
    workers = [RayWorker(p, name=name) for p, name in zip(policies, names, strict=True)]
    async with RefitCoordinator(trainer=sources, workers=workers, budget_bytes=1 << 20) as refit:
        for step in range(1, steps + 1):
            losses = [await t.train_step.remote(step) for t in trainers]
            report = await refit.push(version=step)  # every actor now holds `step`
            print(f"step {step}: loss {losses[0]:.4f}; {report}")
            want = await trainers[0].digests.remote()
            assert all([await t.digests.remote() == want for t in trainers]), "replicas differ"
            assert all([await w.parameter_digests() == want for w in workers]), "not refit"
            x = torch.randn(4, 128)
            expected = await trainers[0].forward.remote(x)
            for p in policies:
                assert torch.equal(await p.generate.remote(x), expected)
        print(f"verified: {len(workers)} actors hold version {refit.version}, bit for bit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--address", default=None, help="an existing cluster (e.g. auto)")
    parser.add_argument("--devices", type=int, default=2, help="virtual devices per node (2)")
    parser.add_argument("--workers", type=int, default=2, help="inference actors per device (2)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (3)")
    args = parser.parse_args()
    if args.address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
        ray.init(num_cpus=2, include_dashboard=False)
    else:
        ray.init(address=args.address)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
        anyio.run(run, nodes, args.devices, args.workers, args.steps)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
