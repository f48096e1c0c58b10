"""The exception hierarchy.

Every error asyncrefit raises derives from :class:`AsyncRefitError`. Messages are built
in ``__init__`` from the fields, so the fields stay available to callers that handle
the error programmatically and the message always says *what* and *where*.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio

_logger = logging.getLogger(__name__)


class AsyncRefitError(Exception):
    """Base class of every error raised by asyncrefit."""


# --- planning and validation: raised before any byte moves ---------------------------


class PlanError(AsyncRefitError):
    """The parameter set cannot be planned or does not match a worker."""


class ParameterMismatchError(PlanError):
    """A worker's declared parameters do not match the trainer's."""

    def __init__(self, worker: str, parameter: str, problem: str) -> None:
        self.worker = worker
        self.parameter = parameter
        self.problem = problem
        super().__init__(f"worker {worker!r}, parameter {parameter!r}: {problem}")


class BudgetTooSmallError(PlanError):
    """The memory budget cannot hold the largest bucket."""

    def __init__(self, budget_bytes: int, needed_bytes: int, what: str) -> None:
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        self.what = what
        super().__init__(
            f"memory budget of {budget_bytes} bytes is smaller than {what} ({needed_bytes} bytes)"
        )


class ConversionError(PlanError):
    """The trainer's parameters cannot be laid out as the engine's checkpoint tensors.

    ``parameter`` names the checkpoint tensor (or the trainer parameter) concerned.
    """

    def __init__(self, source: str, parameter: str, problem: str) -> None:
        self.source = source
        self.parameter = parameter
        self.problem = problem
        super().__init__(f"trainer source {source!r}, parameter {parameter!r}: {problem}")


class CapacityExceededError(AsyncRefitError):
    """A budget request is larger than the whole budget and could never be granted."""

    def __init__(self, requested: int, capacity: int) -> None:
        self.requested = requested
        self.capacity = capacity
        super().__init__(f"requested {requested} bytes from a budget of {capacity} bytes in total")


# --- discovery ---------------------------------------------------------------------


class DiscoveryError(AsyncRefitError):
    """The set of workers is not usable (duplicates, devices without a source)."""


class DuplicateWorkerError(DiscoveryError):
    """Two workers share a name, or the same worker was given twice."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        super().__init__(f"worker {worker!r} is given more than once")


class UnknownWorkerError(DiscoveryError, KeyError):
    """No worker of the coordinator has this name."""

    def __init__(self, worker: str, known: Collection[str]) -> None:
        self.worker = worker
        names = ", ".join(repr(n) for n in sorted(known)) or "none"
        self.message = f"no worker is named {worker!r} (workers: {names})"
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would show the message's repr
        return self.message


class UnknownDeviceError(DiscoveryError):
    """A worker reported a device that no trainer source can serve."""

    def __init__(self, worker: str, device: object, served: Iterable[object]) -> None:
        self.worker = worker
        self.device = device
        served_text = ", ".join(str(d) for d in served) or "none"
        super().__init__(
            f"worker {worker!r} is on device {device}, which no trainer source serves "
            f"(served: {served_text})"
        )


# --- versions ----------------------------------------------------------------------


class VersionError(AsyncRefitError):
    """A push asked for a version that is not newer than every version begun so far.

    ``current`` is the highest version begun; ``failed`` tells that the push which
    began it failed: some workers may hold it, so the number cannot be used again.
    """

    def __init__(self, version: int, current: int, *, failed: bool = False) -> None:
        self.version = version
        self.current = current
        self.failed = failed
        if failed:
            message = (
                f"version {version} is not newer than version {current}, which a push that "
                "failed began (some workers may hold it): push a newer version"
            )
        else:
            message = f"version {version} is not newer than the last complete version {current}"
        super().__init__(message)


# --- workers and transports ----------------------------------------------------------


class WorkerError(AsyncRefitError):
    """A worker failed; ``worker`` names it."""

    def __init__(self, worker: str, detail: str) -> None:
        self.worker = worker
        self.detail = detail
        super().__init__(f"worker {worker!r}: {detail}")


class WorkerDiedError(WorkerError):
    """A worker's process or connection went away."""


class WorkerTimeoutError(WorkerError):
    """A worker did not answer within the configured time."""


class WorkerRemoteError(WorkerError):
    """A worker raised while handling a request; ``remote_type`` is the error's type."""

    def __init__(self, worker: str, remote_type: str, message: str) -> None:
        self.remote_type = remote_type
        self.remote_message = message
        super().__init__(worker, f"{remote_type}: {message}")


class WorkerIntegrityError(WorkerRemoteError):
    """A worker's copy of a bucket did not match the trainer's checksum."""


class WorkerProtocolError(WorkerRemoteError):
    """A worker answered with something the protocol does not allow (a wrong type)."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(worker, "ProtocolError", message)


class PeerWorkerError(WorkerError):
    """A worker's step failed because another worker it shares the step with failed
    (the ranks of one inference engine run every step together); ``peer`` names the
    worker that failed and ``peer_error`` its error's type."""

    def __init__(self, worker: str, peer: str, peer_error: str, peer_detail: str) -> None:
        self.peer = peer
        self.peer_error = peer_error
        self.peer_detail = peer_detail
        super().__init__(worker, f"its peer {peer!r} failed: {peer_error}: {peer_detail}")


class WorkerStaleWeightsError(WorkerRemoteError):
    """A worker refused to commit: part of its model would keep serving old weights."""


#: Remote error types that map to a more specific local class.
_REMOTE_TYPES: dict[str, type[WorkerRemoteError]] = {
    "IntegrityError": WorkerIntegrityError,
    "StaleWeightsError": WorkerStaleWeightsError,
}


def remote_error(worker: str, remote_type: str, message: str) -> WorkerRemoteError:
    """The typed error for a failure a worker reported (``remote_type``: its class name)."""
    if remote_type == "ProtocolError":
        return WorkerProtocolError(worker, message)
    return _REMOTE_TYPES.get(remote_type, WorkerRemoteError)(worker, remote_type, message)


class UpdateStateError(AsyncRefitError):
    """A worker was asked to load or commit a version it is not receiving."""


class GatherError(AsyncRefitError):
    """A sharded trainer's gather cannot be done (an unsupported placement) or failed."""


class IntegrityError(AsyncRefitError):
    """Bytes copied out of a bucket differ from what the trainer packed."""

    def __init__(self, bucket: int, expected: int, got: int) -> None:
        self.bucket = bucket
        self.expected = expected
        self.got = got
        super().__init__(
            f"bucket {bucket}: checksum {got:#010x} after the copy, "
            f"{expected:#010x} from the trainer"
        )


class PackError(AsyncRefitError):
    """A trainer source could not pack a parameter into a bucket (or lay it out).

    ``source`` names the trainer source, ``bucket`` the bucket's index and
    ``parameter`` the parameter; ``detail`` says what went wrong (the underlying error
    is chained as ``__cause__``).
    """

    def __init__(self, source: str, bucket: int, parameter: str, detail: str) -> None:
        self.source = source
        self.bucket = bucket
        self.parameter = parameter
        self.detail = detail
        super().__init__(
            f"trainer source {source!r}, bucket {bucket}, parameter {parameter!r}: {detail}"
        )


class StaleWeightsError(AsyncRefitError):
    """A layer of an inference model would keep serving weights derived from the ones
    an update replaced; ``sources`` names the written layers it shares tensors with."""

    def __init__(self, layer: str, reason: str, sources: Iterable[str] = ()) -> None:
        self.layer = layer
        self.reason = reason
        self.sources = tuple(sources)
        super().__init__(f"layer {layer!r} would keep serving stale weights: {reason}")


class SourceError(AsyncRefitError):
    """A trainer source failed; ``source`` names it."""

    def __init__(self, source: str, detail: str) -> None:
        self.source = source
        self.detail = detail
        super().__init__(f"trainer source {source!r}: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.source, self.detail))


class SourceDiedError(SourceError):
    """A trainer source's process, actor or node went away."""


class SourceTimeoutError(SourceError):
    """A trainer source did not answer (or finish a bucket) within the timeout."""


class SourceRemoteError(SourceError):
    """A trainer source raised while handling a request; ``remote_type`` is its type."""

    def __init__(self, source: str, remote_type: str, message: str) -> None:
        self.remote_type = remote_type
        self.remote_message = message
        super().__init__(source, f"{remote_type}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.source, self.remote_type, self.remote_message))


class TransportError(AsyncRefitError):
    """A transport could not create, export or open a buffer."""


class ClosedError(AsyncRefitError):
    """The coordinator, transport or worker was used after it was closed."""


# --- a failed push -------------------------------------------------------------------


class PushError(AsyncRefitError):
    """A push failed; the workers it began hold no complete version, unless it knows better.

    ``cause`` is the typed error that failed the push (also chained as
    ``__cause__``); ``incomplete`` names every worker left without a complete version,
    and ``failed`` the worker the failure came from, when there is one. Left out are
    the workers known to hold their previous version again: those written directly
    that the push told, before any write, to take their begin back
    (:class:`~asyncrefit.abc.RestoringWorker`).
    """

    def __init__(
        self,
        version: int,
        cause: BaseException,
        incomplete: Iterable[str],
        failed: str | None,
    ) -> None:
        self.version = version
        self.cause = cause
        self.incomplete = tuple(sorted(incomplete))
        self.failed = failed
        where = f" at worker {failed!r}" if failed is not None else ""
        left = ", ".join(repr(w) for w in self.incomplete) or "none"
        super().__init__(
            f"push of version {version} failed{where}: {cause}; "
            f"workers without a complete version: {left}"
        )


# --- the wire and the backends ---------------------------------------------------


class ChannelFailedError(AsyncRefitError):
    """The channel failed (the peer closed it, or a send timed out); ``cause`` says how."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)
        self.cause = cause


class UnknownHandleError(AsyncRefitError, LookupError):
    """A load names a handle number its connection never carried; ``request_id`` is
    the load's, to answer it with the error."""

    def __init__(self, request_id: int, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class SessionError(AsyncRefitError):
    """A transition the vLLM session does not allow in its current state."""


class EngineConfigError(AsyncRefitError):
    """The vLLM engine was not started with asyncrefit's engine arguments."""


class EngineLoopError(AsyncRefitError):
    """An ``AsyncLLM`` was used from an event loop other than the one that owns it."""


class AwaitableReturnedError(WorkerError):
    """An actor method returned a coroutine, future or ``ObjectRef``, not a plain value."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised inside actors and pickled back by Ray: rebuild from the fields.
        return (type(self), (self.worker, self.detail))


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def primary_error(exc: BaseException) -> BaseException | None:
    """The one error a failed task group stands for; ``None`` if it was only cancelled.

    Worker errors come first (they name where it failed; a worker's own error before
    a :class:`PeerWorkerError` that reports it), then other asyncrefit errors, then
    anything else.
    """
    cancelled = anyio.get_cancelled_exc_class()
    leaves = [e for e in _leaves(exc) if not isinstance(e, cancelled)]
    # A worker's own failure before a peer's report of it.
    own = [e for e in leaves if isinstance(e, WorkerError) and not isinstance(e, PeerWorkerError)]
    for kind in (WorkerError, AsyncRefitError, Exception, BaseException):
        for leaf in own + leaves:
            if isinstance(leaf, kind):
                return leaf
    return None


@contextmanager
def one_error() -> Iterator[None]:
    """Let a failed task group raise the one error it stands for, not an exception group.

    A group of only cancellations propagates unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        primary = primary_error(group)
        if primary is None:
            raise
        cancelled = anyio.get_cancelled_exc_class()
        others = [e for e in _leaves(group) if e is not primary and not isinstance(e, cancelled)]
        for other in others:
            # Nothing is lost: the errors that did not win are logged, and named on the
            # one raised (a note, shown with its traceback).
            _logger.debug("besides %r: %r", primary, other, exc_info=other)
        if others:
            primary.add_note(
                f"asyncrefit: {len(others)} more error(s) in the same task group: "
                + "; ".join(f"{type(e).__name__}: {e}" for e in others[:4])
                + (" ..." if len(others) > 4 else "")
            )
        raise primary from None
