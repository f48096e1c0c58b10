"""The one check that every worker holds the trainer's parameters, bitwise, by digest.

The trainer's side is :func:`module_digests` (a :func:`~asyncrefit._worker._receiver.tensor_digest`
per parameter, by name); each worker answers ``parameter_digests()`` the same way.
:func:`mismatches` asks every worker at once and lists, per worker, the parameters
whose digest differs (missing and extra names included); :func:`verify_workers`
raises :class:`VerificationError` naming the first worker that differs. The demo, the
benchmark, the soak and the scripts in ``benchmarks/`` all check through these.

Resource handling: the workers are asked concurrently, in one task group; nothing is
held after the call.

Error handling: a worker that fails to answer fails the call with its error (all the
questions are cancelled); a worker that answers other bytes is
:class:`VerificationError` from :func:`verify_workers`, a list of names from
:func:`mismatches`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import anyio

from .._worker._receiver import tensor_digest

if TYPE_CHECKING:
    import torch


class VerificationError(RuntimeError):
    """A worker does not hold the trainer's bytes."""


class DigestWorker(Protocol):
    """A worker that can tell the digest of each of its parameters."""

    @property
    def name(self) -> str:
        """The worker's name (in messages)."""
        ...

    async def parameter_digests(self) -> Mapping[str, str]:
        """``tensor_digest`` of each parameter, by name."""
        ...


def module_digests(module: torch.nn.Module) -> dict[str, str]:
    """:func:`~asyncrefit._worker._receiver.tensor_digest` of each parameter, by name."""
    return {name: tensor_digest(p) for name, p in module.named_parameters()}


def differing(expected: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    """The names, sorted, whose digest in ``got`` is not the one in ``expected``
    (a name missing from either side counts)."""
    return sorted(n for n in expected.keys() | got.keys() if got.get(n) != expected.get(n))


async def mismatches(
    workers: Sequence[DigestWorker], expected: Mapping[str, str]
) -> dict[str, list[str]]:
    """Ask every worker, concurrently, for its digests; by worker name (in the order of
    ``workers``), the parameters that differ from ``expected``: empty where it holds
    the trainer's bytes."""
    got: dict[str, list[str]] = {}

    async def one(worker: DigestWorker) -> None:
        got[worker.name] = differing(expected, await worker.parameter_digests())

    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(one, worker)
    return {w.name: got[w.name] for w in workers}


async def verify_workers(
    workers: Sequence[DigestWorker], expected: Mapping[str, str], *, what: str
) -> None:
    """Raise :class:`VerificationError` unless every worker holds ``expected``'s digests.

    ``what`` starts the message (the variant or run that was checked); it names the
    worker, how many parameters differ and the first few.
    """
    for name, wrong in (await mismatches(workers, expected)).items():
        if wrong:
            raise VerificationError(
                f"{what}: worker {name} does not hold the trainer's bytes for {len(wrong)} "
                f"of {len(expected)} parameters (first: {wrong[:3]})"
            )
