"""The one error map: how a failure on the wire becomes the library's typed error.

Owns the translation at every edge where the coordinator reaches another process: a
channel that failed or timed out, a peer that answered with an :class:`ErrorReply`,
and (for :mod:`asyncrefit.ray`) Ray's own errors. Each edge raises the errors of its
:class:`Side`: :data:`WORKER` (:class:`~asyncrefit.WorkerDiedError`,
:class:`~asyncrefit.WorkerTimeoutError`, :class:`~asyncrefit.WorkerRemoteError` and
its subclasses) or :data:`SOURCE` (:class:`~asyncrefit.SourceDiedError`,
:class:`~asyncrefit.SourceTimeoutError`, :class:`~asyncrefit.SourceRemoteError`).

In the style of httpcore's ``map_exceptions``: :func:`map_exceptions` is a context
manager over a mapping from exception classes to translations, the first match wins,
anything else passes unchanged. :func:`raised_errors` is the map for a peer called in
this process (its own exception, attributed to it by its kind). :func:`map_wire` is that map for a
:class:`~asyncrefit._wire._mux.RequestChannel` client, with an asynchronous
``on_lost`` hook in which the client releases what the lost peer held (shielded, by
the hook) before the typed error is raised.

Remote errors travel as data: :func:`error_reply` records the error's kind
(:data:`~asyncrefit._wire._messages.RemoteKind`) where it was raised, by its class,
and the receiving side picks the typed error from that kind; only a reply without a
kind (a peer that sends type names alone) falls back to the type's name.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from .._exceptions import (
    IntegrityError,
    SourceDiedError,
    SourceError,
    SourceRemoteError,
    SourceTimeoutError,
    StaleWeightsError,
    WorkerDiedError,
    WorkerError,
    WorkerIntegrityError,
    WorkerProtocolError,
    WorkerRemoteError,
    WorkerStaleWeightsError,
    WorkerTimeoutError,
    remote_error,
)
from ._messages import ErrorReply, RemoteKind
from ._mux import ChannelFailedError

__all__ = (
    "SOURCE",
    "WORKER",
    "ExceptionMapping",
    "Lost",
    "RemoteFailure",
    "Side",
    "error_reply",
    "map_exceptions",
    "map_wire",
    "protocol_reply",
    "raise_for_error",
    "raised_errors",
    "remote_kind",
)

#: Exception class -> the typed error to raise instead (given the caught one).
ExceptionMapping = Mapping[type[BaseException], Callable[[Any], BaseException]]


@contextmanager
def map_exceptions(mapping: ExceptionMapping, *, chain: bool = True) -> Iterator[None]:
    """Raise ``mapping[cls](exc)`` for an exception of the first class it matches.

    ``chain``: the caught exception becomes the typed error's ``__cause__``
    (otherwise the typed error stands alone). Exceptions no class matches, those whose
    translation returns them unchanged, and cancellation, pass unchanged.
    """
    try:
        yield
    except Exception as exc:
        for cls, translate in mapping.items():
            if isinstance(exc, cls):
                error = translate(exc)
                if error is exc:
                    raise
                raise error from (exc if chain else None)
        raise


# --- remote errors as data -------------------------------------------------------------


def remote_kind(exc: BaseException) -> RemoteKind:
    """The kind of a failure a peer reports, by its class."""
    if isinstance(exc, IntegrityError):
        return "integrity"
    if isinstance(exc, StaleWeightsError):
        return "stale_weights"
    return "error"


def error_reply(exc: BaseException) -> ErrorReply:
    """The reply to a request that raised ``exc``: its type name, message and kind."""
    return ErrorReply(type=type(exc).__name__, message=str(exc), kind=remote_kind(exc))


def protocol_reply(message: str) -> ErrorReply:
    """The reply to a request the peer does not understand (kind ``"protocol"``)."""
    return ErrorReply(type="ProtocolError", message=message, kind="protocol")


class RemoteFailure(Exception):
    """A peer answered a request with ``reply`` (an :class:`ErrorReply`): wire-internal,
    :func:`map_wire` turns it into the side's remote error."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.type}: {reply.message}")
        self.reply = reply


def raise_for_error(reply: Any) -> Any:
    """``reply``, unless it is an :class:`ErrorReply`: then :class:`RemoteFailure`."""
    if isinstance(reply, ErrorReply):
        raise RemoteFailure(reply)
    return reply


# --- the sides -------------------------------------------------------------------------

_WORKER_KINDS: dict[str, type[WorkerRemoteError]] = {
    "integrity": WorkerIntegrityError,
    "stale_weights": WorkerStaleWeightsError,
}


def _worker_remote(name: str, remote_type: str, message: str, kind: RemoteKind) -> Exception:
    if not kind:  # a peer that names the type only
        return remote_error(name, remote_type, message)
    if kind == "protocol":
        return WorkerProtocolError(name, message)
    return _WORKER_KINDS.get(kind, WorkerRemoteError)(name, remote_type, message)


def _source_remote(name: str, remote_type: str, message: str, kind: RemoteKind) -> Exception:
    return SourceRemoteError(name, remote_type, message)


@dataclass(frozen=True, slots=True)
class Side:
    """The typed errors of one side of the wire, each made from (peer name, detail).

    ``errors``: the base class of the side's typed errors (they pass :func:`raised_errors`
    unchanged). ``unavailable``: the peer cannot be reached for now and may still be
    working (Ray's ``ActorUnavailableError``).
    """

    errors: type[Exception]
    died: Callable[[str, str], Exception]
    timeout: Callable[[str, str], Exception]
    unavailable: Callable[[str, str], Exception]
    remote: Callable[[str, str, str, RemoteKind], Exception]

    def from_reply(self, name: str, reply: ErrorReply) -> Exception:
        """The error for ``name``'s :class:`ErrorReply`."""
        return self.remote(name, reply.type, reply.message, reply.kind)

    def from_exception(self, name: str, exc: BaseException) -> Exception:
        """The error for an exception ``name`` raised (and that came back as an object)."""
        return self.remote(name, type(exc).__name__, str(exc), remote_kind(exc))


#: An inference worker's errors.
WORKER = Side(
    errors=WorkerError,
    died=WorkerDiedError,
    timeout=WorkerTimeoutError,
    unavailable=WorkerTimeoutError,
    remote=_worker_remote,
)
#: A trainer source's errors.
SOURCE = Side(
    errors=SourceError,
    died=SourceDiedError,
    timeout=SourceTimeoutError,
    unavailable=SourceError,
    remote=_source_remote,
)


def _unchanged(exc: BaseException) -> BaseException:
    return exc


def raised_errors(
    side: Side, name: str, *, passing: tuple[type[Exception], ...] = ()
) -> ExceptionMapping:
    """The translation of what peer ``name``, called in this process, raised.

    The side's own typed errors, and those of the classes in ``passing`` (the caller
    handles them), pass unchanged; any other exception becomes the side's remote error
    of its kind (:func:`remote_kind`, as an :func:`error_reply` would carry it), the
    exception chained as ``__cause__``.
    """
    mapping: dict[type[BaseException], Callable[[Any], BaseException]]
    mapping = dict.fromkeys((side.errors, *passing), _unchanged)
    mapping[Exception] = lambda exc: side.from_exception(name, exc)
    return mapping


# --- the map of a request channel's client ------------------------------------------------


class Lost(enum.Enum):
    """How a peer was lost: it did not answer in time, or it went away."""

    TIMEOUT = "timeout"
    DIED = "died"


#: The channel failures outside a :class:`RequestChannel` (a greeting's read).
_CHANNEL_LOST = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)

OnLost = Callable[[Lost, BaseException], Awaitable[tuple[Lost, str]]]


def _lost_how(exc: BaseException) -> Lost:
    cause = exc.cause if isinstance(exc, ChannelFailedError) else exc
    return Lost.TIMEOUT if isinstance(cause, TimeoutError) else Lost.DIED


@asynccontextmanager
async def map_wire(
    side: Side, name: str | Callable[[], str], on_lost: OnLost
) -> AsyncIterator[None]:
    """Translate a request's failures on the wire into ``side``'s typed errors.

    ``name`` names the peer (a callable: asked when an error is raised, for a peer
    whose name the greeting tells).

    An error reply (:class:`RemoteFailure`): the side's remote error. A timeout (a
    ``TimeoutError``, or a channel whose send timed out) or a lost channel
    (:class:`ChannelFailedError`, anyio's end-of-stream, broken or closed errors):
    ``await on_lost(how, exc)`` first, in which the caller closes the channel and
    releases what the peer held (shielded: it runs while the request fails) and which
    returns how to report it and the detail; then the side's timeout or died error.
    Typed errors are raised without the wire's exception chained (it is internal).
    """
    try:
        yield
    except RemoteFailure as exc:
        raise side.from_reply(_named(name), exc.reply) from None
    except (TimeoutError, ChannelFailedError, *_CHANNEL_LOST) as exc:
        how, detail = await on_lost(_lost_how(exc), exc)
        error = side.timeout if how is Lost.TIMEOUT else side.died
        raise error(_named(name), detail) from None


def _named(name: str | Callable[[], str]) -> str:
    return name if isinstance(name, str) else name()
