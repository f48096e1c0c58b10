"""Adapters: foreign objects wrapped before the coordinator takes them."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

import asyncrefit
from asyncrefit import RefitCoordinator, cpu_device
from asyncrefit._core import _adapters as adapters

from .fakes import FakeWorker
from .models import make_mlp

KIB = 1024

pytestmark = pytest.mark.timeout(60)


class Proxy:
    """Answers to any method name, as an actor handle does: it must never pass as is."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


@pytest.fixture
def proxy_package() -> Iterator[type[Proxy]]:
    """``Proxy`` as if it came from a foreign top-level package ``fakeproxies``."""
    module = types.ModuleType("fakeproxies")
    cls = type("Proxy", (Proxy,), {"__module__": "fakeproxies.handles"})
    sys.modules["fakeproxies"] = module
    saved = dict(adapters._registered)
    try:
        yield cls
    finally:
        adapters._registered.clear()
        adapters._registered.update(saved)
        del sys.modules["fakeproxies"]


def test_ray_is_adapted_by_an_entry_point_not_by_the_core() -> None:
    (entry,) = [e for e in entry_points(group=adapters.GROUP) if e.name == "ray"]
    assert entry.value == "asyncrefit.ray._adapt:adapt"
    import asyncrefit._core._coordinator as coordinator

    assert "ray" not in coordinator.__dict__
    assert "ActorHandle" not in Path(coordinator.__file__).read_text()


def test_objects_of_packages_without_an_adapter_are_taken_as_they_are() -> None:
    worker = FakeWorker.like("w", cpu_device(0), make_mlp())
    assert adapters.adapt(worker, "worker") is worker
    assert adapters.adapt(3, "source") == 3


async def test_a_registered_adapter_wraps_workers_and_sources(proxy_package: type[Proxy]) -> None:
    model = make_mlp()
    inner = [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(2)]
    roles: list[str] = []

    def unwrap(obj: Any, role: adapters.Role) -> Any:
        roles.append(role)
        return obj.target if isinstance(obj, Proxy) else None

    asyncrefit.register_adapter("fakeproxies", unwrap)
    workers = [proxy_package(w) for w in inner]
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        await refit.push(1)
        assert refit.versions() == {"w0": 1, "w1": 1}
    assert roles == ["worker", "worker"]


def test_an_adapter_given_as_a_string_is_imported_at_first_use(
    proxy_package: type[Proxy],
) -> None:
    asyncrefit.register_adapter("fakeproxies", "tests.test_adapters:_target_of")
    obj = proxy_package("inside")
    assert adapters.adapt(obj, "source") == "inside"
    assert callable(adapters._registered["fakeproxies"])


def test_an_adapter_that_declines_leaves_the_object(proxy_package: type[Proxy]) -> None:
    asyncrefit.register_adapter("fakeproxies", lambda obj, role: None)
    obj = proxy_package("x")
    assert adapters.adapt(obj, "worker") is obj


def _target_of(obj: Any, role: adapters.Role) -> Any:
    return obj.target
