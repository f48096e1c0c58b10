"""Errors of the Ray integration, and the translation of Ray's errors into typed ones.

Ray reports a failed actor call as one of its own exceptions: the actor died
(:class:`ray.exceptions.ActorDiedError`), is unreachable for now
(:class:`ray.exceptions.ActorUnavailableError`), or its method raised
(:class:`ray.exceptions.RayTaskError`, carrying the original error as ``cause``).
:func:`worker_errors` and :func:`source_errors` turn those into asyncrefit's typed
errors at the edge, naming the actor, with the Ray error chained as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._exceptions import (
    SourceDiedError,
    SourceError,
    SourceRemoteError,
    WorkerDiedError,
    WorkerError,
    WorkerRemoteError,
    WorkerTimeoutError,
    remote_error,
)


class AwaitableReturnedError(WorkerError):
    """An actor method returned a coroutine, future or ``ObjectRef``, not a plain value."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised inside actors and pickled back by Ray: rebuild from the fields.
        return (type(self), (self.worker, self.detail))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _cause(exc: Any) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


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
    from ray import exceptions as rex

    try:
        yield
    except rex.ActorUnavailableError as exc:
        raise WorkerTimeoutError(name, f"the actor is unavailable: {_first_line(exc)}") from exc
    except rex.RayActorError as exc:
        raise WorkerDiedError(name, f"the actor died: {_first_line(exc)}") from exc
    except rex.RayTaskError as exc:
        cause = _cause(exc)
        if isinstance(cause, AwaitableReturnedError):
            raise AwaitableReturnedError(name, cause.detail) from exc
        raise remote_error(name, type(cause).__name__, str(cause)) from exc
    except rex.RayError as exc:
        raise WorkerRemoteError(name, type(exc).__name__, _first_line(exc)) from exc


@contextmanager
def source_errors(name: str) -> Iterator[None]:
    """Translate Ray's errors of a call to trainer actor ``name`` into typed ones.

    ``ActorDiedError`` (and any other ``RayActorError``): :class:`SourceDiedError`.
    ``ActorUnavailableError``: :class:`SourceError` (it may be alive and hold its
    buffers). An error raised by the method: :class:`SourceRemoteError` with its type
    and message.
    """
    from ray import exceptions as rex

    try:
        yield
    except rex.ActorUnavailableError as exc:
        raise SourceError(name, f"the actor is unavailable: {_first_line(exc)}") from exc
    except rex.RayActorError as exc:
        raise SourceDiedError(name, f"the actor died: {_first_line(exc)}") from exc
    except rex.RayTaskError as exc:
        cause = _cause(exc)
        raise SourceRemoteError(name, type(cause).__name__, str(cause)) from exc
    except rex.RayError as exc:
        raise SourceRemoteError(name, type(exc).__name__, _first_line(exc)) from exc
