"""Actor classes for the Ray tests: plain classes, made remote with ``ray.remote`` at use.

Ray workers import this module by name (the driver's ``sys.path`` is theirs), so the
classes and factories here are pickled by reference.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from asyncrefit import DeviceId
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.abc import BucketAck
from asyncrefit.planning import Bucket
from asyncrefit.ray import RefitTrainerMixin, RefitWorkerMixin, current_node_id
from asyncrefit.transport import Handle, ShmHandle


class WarningLog:
    """Records every warning and unraisable exception of this (actor) process."""

    def __init__(self) -> None:
        self.entries: list[str] = []
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        sys.unraisablehook = self._unraisable

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        self.entries.append(f"{category.__name__}: {message} ({filename}:{lineno})")

    def _unraisable(self, unraisable: Any) -> None:
        self.entries.append(f"unraisable: {unraisable.exc_value!r} in {unraisable.object!r}")


class FakeEngine:
    """Stands in for an async engine (vLLM's AsyncLLM): bound to the loop it first ran on.

    Its device query is a coroutine that waits for a reply scheduled on that loop, as
    an engine waits on its sockets; awaiting it from any other loop raises.
    """

    def __init__(self, device: str) -> None:
        self.device_name = device
        self.loop: asyncio.AbstractEventLoop | None = None
        self.query_threads: list[int] = []

    async def device(self) -> str:
        loop = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = loop
        elif loop is not self.loop:
            raise RuntimeError("the engine was awaited from another event loop")
        reply: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.001, reply.set_result, self.device_name)
        self.query_threads.append(threading.get_ident())
        return await reply


class InferenceActor(RefitWorkerMixin):
    """An inference actor: a module, a fake async engine, and knobs for fault drills."""

    def __init__(
        self, factory: Callable[[], torch.nn.Module], device: str, shared: bool = False
    ) -> None:
        self.log = WarningLog()
        torch.set_num_threads(1)
        self.model = factory()
        self.model.eval()
        self.init_refit(self.model, device=device, shared_parameters=shared)
        self.engine = FakeEngine(device)
        self.node: str | None = None
        self.device_query = "engine"
        self.hang_at: int | None = None
        self.reached_hang: anyio.Event | None = None
        self.segments: set[str] = set()
        self.handle_devices: set[DeviceId] = set()
        self.refit_threads: set[int] = set()

    async def configure(
        self,
        *,
        device: str | None = None,
        node: str | None = None,
        device_query: str = "engine",
        hang_at: int | None = None,
    ) -> None:
        """Set the device the engine reports, the node, how the query answers, a hang."""
        await anyio.lowlevel.checkpoint()
        if device is not None:
            self.engine.device_name = device
        self.node = node
        self.device_query = device_query
        self.hang_at = hang_at
        self.reached_hang = anyio.Event()  # made here, on the actor's loop
        self.segments.clear()
        self.handle_devices.clear()

    async def report_device_id_async(self) -> DeviceId:
        """Awaits the engine on this actor's loop (or misbehaves, as configured)."""
        node = self.node if self.node is not None else current_node_id()
        if self.device_query == "coroutine":  # forgot to await the engine
            return self.engine.device()  # type: ignore[return-value]
        if self.device_query == "ref":  # returned an ObjectRef instead of its value
            import ray

            return ray.put(DeviceId(node=node, device=self.engine.device_name))  # type: ignore[return-value]
        return DeviceId(node=node, device=await self.engine.device())

    async def refit_load(self, version: int, bucket: int, handles: tuple[Handle, ...]) -> BucketAck:
        self.refit_threads.add(threading.get_ident())
        for handle in handles:
            self.handle_devices.add(handle.device)
            if isinstance(handle, ShmHandle):
                self.segments.add(handle.segment)
        if self.hang_at == bucket:
            if self.reached_hang is not None:
                self.reached_hang.set()
            await anyio.sleep_forever()
        return await super().refit_load(version, bucket, handles)

    async def wait_for_hang(self) -> None:
        """Returns once a load reached the configured hang."""
        if self.reached_hang is None:
            raise RuntimeError("configure(hang_at=...) first")
        await self.reached_hang.wait()

    async def info(self) -> dict[str, Any]:
        """What the tests check: pid, threads, warnings, handles seen."""
        await anyio.lowlevel.checkpoint()
        return {
            "pid": os.getpid(),
            "loop_thread": threading.get_ident(),
            "engine_threads": sorted(set(self.engine.query_threads)),
            "refit_threads": sorted(self.refit_threads),
            "warnings": list(self.log.entries),
            "segments": sorted(self.segments),
            "handle_devices": sorted(self.handle_devices),
        }


class TrainerActor(RefitTrainerMixin):
    """A trainer shard: a module it "trains" deterministically, published for refits."""

    def __init__(
        self, factory: Callable[[], torch.nn.Module], devices: list[str] | None = None
    ) -> None:
        torch.set_num_threads(1)
        self.factory = factory
        self.model = factory()
        self.init_refit_source(self.model, devices=devices)
        self.hang_at: int | None = None
        self.reached_hang: anyio.Event | None = None
        self._kept_weight: torch.nn.Parameter | None = None

    async def configure(self, devices: list[str] | None) -> None:
        """Serve ``devices`` from now on; the weights go back to the factory's."""
        await self.refit_source.aclose()
        fresh = dict(self.factory().named_parameters())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(fresh[name])
        self.init_refit_source(self.model, devices=devices)

    async def reshape_first_weight(self, rows: int | None) -> None:
        """Give the first layer's weight ``rows`` rows (zeros: the parameter set no longer
        matches the workers'), or (``None``) its own weight back."""
        await anyio.lowlevel.checkpoint()
        layer = self.model.get_submodule("0")
        if rows is None:
            assert self._kept_weight is not None
            layer.weight = self._kept_weight
            return
        kept = self._kept_weight = layer.get_parameter("weight")
        layer.weight = torch.nn.Parameter(torch.zeros(rows, kept.shape[1]))

    async def hang_export_at(self, bucket: int) -> None:
        """Make the export of ``bucket`` hang (a trainer stuck mid-push)."""
        await anyio.lowlevel.checkpoint()
        self.hang_at = bucket
        self.reached_hang = anyio.Event()

    async def wait_for_hang(self) -> None:
        """Returns once an export reached the configured hang."""
        if self.reached_hang is None:
            raise RuntimeError("hang_export_at(...) first")
        await self.reached_hang.wait()

    async def refit_source_export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        if self.hang_at == bucket.index:
            if self.reached_hang is not None:
                self.reached_hang.set()
            await anyio.sleep_forever()
        return await super().refit_source_export(bucket, slot, devices)

    async def step(self, seed: int) -> None:
        """One deterministic "optimizer step": every replica given ``seed`` stays equal."""

        def run() -> None:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype))

        await anyio.to_thread.run_sync(run)

    async def digests(self) -> dict[str, str]:
        await anyio.lowlevel.checkpoint()
        return {n: tensor_digest(p) for n, p in self.model.named_parameters()}

    async def pid(self) -> int:
        await anyio.lowlevel.checkpoint()
        return os.getpid()


class ShardedTrainerActor(RefitTrainerMixin):
    """One rank of an FSDP2 trainer: a transformer sharded with ``fully_shard`` (fp32).

    The driver forms the ranks' process group (``init_trainer_group``), then calls
    :meth:`setup` on every rank. Training steps, the gathered digests and the ranks'
    exports are collectives: the driver calls them on every rank concurrently.
    """

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.exports: list[tuple[int, int, float, str | None]] = []
        self.hang_at: int | None = None
        self.reached_hang: anyio.Event | None = None

    async def setup(self, devices: list[str], gather_timeout: float) -> bool:
        """Shard the model over the group's ranks; publish it. Returns ``gathers``."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from .sharded import TinyTransformer, make_transformer

        await anyio.lowlevel.checkpoint()
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        model = make_transformer()
        assert isinstance(model, TinyTransformer)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # No sharded=...: the DTensor parameters make it a rank's source.
        self.init_refit_source(model, devices=devices, gather_timeout=gather_timeout)
        self.reached_hang = anyio.Event()
        return (await self.refit_source.describe()).gathers

    async def train_step(self, step: int) -> float:
        """A real optimizer step (FSDP2's collectives: call it on every rank at once)."""
        from torch.nn import functional as F

        from .sharded import VOCAB

        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None

        def run() -> float:
            gen = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, VOCAB, (4, 16), generator=gen)
            logits = model(tokens)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            return float(loss.detach())

        return await anyio.to_thread.run_sync(run)

    async def gathered_digests(self) -> dict[str, str]:
        """Every parameter's full value, cast to bf16, digested (a collective: all ranks)."""
        model = self.model
        assert model is not None

        def run() -> dict[str, str]:
            return {
                name: tensor_digest(p.full_tensor().to(torch.bfloat16))  # type: ignore[attr-defined]
                for name, p in model.named_parameters()
            }

        return await anyio.to_thread.run_sync(run)

    async def hang_export_at(self, bucket: int) -> None:
        """Make the export of ``bucket`` hang before it gathers (a rank stuck mid-push)."""
        await anyio.lowlevel.checkpoint()
        self.hang_at = bucket

    async def wait_for_hang(self) -> None:
        assert self.reached_hang is not None
        await self.reached_hang.wait()

    async def refit_source_export(
        self, bucket: Bucket, slot: int, devices: Sequence[DeviceId]
    ) -> tuple[Handle, ...]:
        if self.hang_at == bucket.index:
            assert self.reached_hang is not None
            self.reached_hang.set()
            await anyio.sleep_forever()
        start = time.monotonic()
        try:
            handles = await super().refit_source_export(bucket, slot, devices)
        except Exception as exc:
            self.exports.append((bucket.index, len(devices), time.monotonic() - start, repr(exc)))
            raise
        self.exports.append((bucket.index, len(devices), time.monotonic() - start, None))
        return handles

    async def export_log(self) -> list[tuple[int, int, float, str | None]]:
        """(bucket, devices asked for, seconds, error) of every export, in the order run."""
        await anyio.lowlevel.checkpoint()
        return list(self.exports)

    async def clear_export_log(self) -> None:
        await anyio.lowlevel.checkpoint()
        self.exports.clear()

    async def pid(self) -> int:
        await anyio.lowlevel.checkpoint()
        return os.getpid()
