"""Errors of the Ray integration, and the translation of Ray's errors into typed ones.

Ray reports a failed actor call as one of its own exceptions: the actor died
(:class:`ray.exceptions.ActorDiedError`), is unreachable for now
(:class:`ray.exceptions.ActorUnavailableError`), or its method raised
(:class:`ray.exceptions.RayTaskError`, carrying the original error as ``cause``).
:func:`ray_errors` is the one table that turns those into a side's typed errors
(:mod:`asyncrefit._wire._errors`: the same map as every other edge), naming the actor,
with the Ray error chained as ``__cause__``; :func:`worker_errors` and
:func:`source_errors` apply it for an inference actor and a trainer actor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._exceptions import AwaitableReturnedError
from .._wire._errors import SOURCE, WORKER, ExceptionMapping, Side, map_exceptions


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _cause(exc: Any) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def ray_errors(side: Side, name: str) -> ExceptionMapping:
    """The translation of Ray's errors of a call to actor ``name``, into ``side``'s.

    ``ActorUnavailableError``: ``side.unavailable`` (the call may or may not have
    run); any other ``RayActorError``: ``side.died``; ``RayTaskError``: the method's
    error, as ``side``'s remote error (an :class:`AwaitableReturnedError` of an
    inference actor keeps its type); any other ``RayError``: a remote error of that
    type and its first line.
    """
    from ray import exceptions as rex

    def raised(exc: BaseException) -> BaseException:
        cause = _cause(exc)
        if side is WORKER and isinstance(cause, AwaitableReturnedError):
            return AwaitableReturnedError(name, cause.detail)
        return side.from_exception(name, cause)

    return {
        rex.ActorUnavailableError: lambda exc: side.unavailable(
            name, f"the actor is unavailable: {_first_line(exc)}"
        ),
        rex.RayActorError: lambda exc: side.died(name, f"the actor died: {_first_line(exc)}"),
        rex.RayTaskError: raised,
        rex.RayError: lambda exc: side.remote(name, type(exc).__name__, _first_line(exc), "error"),
    }


@contextmanager
def worker_errors(name: str) -> Iterator[None]:
    """Translate Ray's errors of a call to inference actor ``name`` into typed ones.

    ``ActorDiedError`` (and any other ``RayActorError``): :class:`WorkerDiedError`;
    the process is gone, so it reads no buffer any more. ``ActorUnavailableError``:
    :class:`WorkerTimeoutError`, since the call may or may not have run and the actor
    may still be reading (the coordinator then holds the buffer back until the actor
    confirms an abort or is removed). An error raised by the method:
    :class:`WorkerRemoteError` with its type and message (or its more specific
    subclass, such as :class:`~asyncrefit.WorkerIntegrityError`; an
    :class:`AwaitableReturnedError` keeps its type).
    """
    with map_exceptions(ray_errors(WORKER, name)):
        yield


@contextmanager
def source_errors(name: str) -> Iterator[None]:
    """Translate Ray's errors of a call to trainer actor ``name`` into typed ones.

    ``ActorDiedError`` (and any other ``RayActorError``): :class:`SourceDiedError`.
    ``ActorUnavailableError``: :class:`SourceError` (it may be alive and hold its
    buffers). An error raised by the method: :class:`SourceRemoteError` with its type
    and message.
    """
    with map_exceptions(ray_errors(SOURCE, name)):
        yield
