"""Hostile inputs, generated: each gives the right outcome or a typed error, and nothing
reaches a worker before validation passed."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrefit import (
    BudgetTooSmallError,
    ParameterMismatchError,
    RefitCoordinator,
    VersionError,
    cpu_device,
)

from .fakes import FakeWorker

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.bool,
]
MUTATIONS = ["none", "rename", "shape", "dtype", "drop", "extra"]


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=gen).to(dtype)
    t = torch.randn(shape, generator=gen).to(dtype)
    flat = t.view(-1)
    specials = [float("nan"), float("inf"), -float("inf"), -0.0]
    for i, v in enumerate(specials[: flat.numel()]):
        flat[i * 7 % max(1, flat.numel())] = v
    return t


@st.composite
def tensor_sets(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(
        st.lists(st.text("abcdef.", min_size=1, max_size=5), min_size=1, max_size=6, unique=True)
    )
    tensors = {}
    for i, name in enumerate(names):
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        t = values(shape, draw(st.sampled_from(DTYPES)), seed=i)
        if len(shape) == 2 and draw(st.booleans()):
            t = t.t()  # non-contiguous
        tensors[name] = t
    return tensors


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (NaN compares equal to itself this way)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def mutate(params: dict[str, torch.Tensor], how: str) -> str | None:
    """Apply a mismatch to a worker's parameters; the name it must be reported under."""
    name = sorted(params)[0]
    t = params[name]
    if how == "rename":
        params[name + "x"] = params.pop(name)
        return min(name, name + "x")
    if how == "shape":
        params[name] = torch.zeros(*t.shape, 2, dtype=t.dtype)
        return name
    if how == "dtype":
        params[name] = torch.zeros(
            t.shape, dtype=torch.float32 if t.dtype != torch.float32 else torch.int32
        )
        return name
    if how == "drop":
        del params[name]
        return name
    if how == "extra":
        params["~extra"] = torch.zeros(3)
        return "~extra"
    return None


async def scenario(
    tensors: dict[str, torch.Tensor], how: str, budget: str, same_device: bool
) -> None:
    workers = []
    for i in range(3):
        params = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in tensors.items()}
        device = cpu_device(0 if same_device else i)
        # whole: a tensor over the budget is refused (parts: tests/test_parts.py)
        workers.append(FakeWorker(name=f"w{i}", device=device, parameters=params, whole=True))
    bad_name = mutate(workers[1].parameters, how)
    workers[1].__post_init__()
    before = [{n: t.clone() for n, t in w.parameters.items()} for w in workers]
    largest = max(t.nbytes for t in tensors.values())
    total = sum(t.nbytes for t in tensors.values())
    budget_bytes = {
        "ample": 2 * total + 4096,
        "exact": max(1, largest),
        "too_small": largest - 1,
    }[budget]
    expected: type[Exception] | None = None
    if how == "dtype":
        # Dtypes decide the sizes a plan needs: a dtype mismatch is found before the
        # budget is checked against the plan.
        expected = ParameterMismatchError
    elif budget == "too_small" and largest > 1:
        expected = BudgetTooSmallError
    elif bad_name is not None:
        expected = ParameterMismatchError

    async def run() -> None:
        async with RefitCoordinator(
            trainer=tensors, workers=workers, budget_bytes=max(1, budget_bytes), bucket_bytes=512
        ) as refit:
            await refit.push(2)
            for w in workers:
                for name, t in tensors.items():
                    assert torch.equal(raw(w.parameters[name]), raw(t)), name
            with pytest.raises(VersionError):
                await refit.push(1)

    if expected is None:
        await run()
        return
    with pytest.raises(expected) as info:
        await run()
    if isinstance(info.value, ParameterMismatchError):
        assert info.value.worker == "w1" and info.value.parameter == bad_name
    for w, snapshot in zip(workers, before, strict=True):
        assert w.calls == [], "a worker was written to before validation passed"
        for name, t in snapshot.items():
            assert torch.equal(raw(w.parameters[name]), raw(t))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=tensor_sets(),
    how=st.sampled_from(MUTATIONS),
    budget=st.sampled_from(["ample", "exact", "too_small"]),
    same_device=st.booleans(),
)
def test_hostile_parameter_sets(
    loop: str, tensors: dict[str, torch.Tensor], how: str, budget: str, same_device: bool
) -> None:
    options: dict[str, Any] = {"use_uvloop": loop == "uvloop"}
    anyio.run(scenario, tensors, how, budget, same_device, backend_options=options)
