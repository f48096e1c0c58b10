"""The one serve loop: a peer's side of a :class:`~asyncrefit._wire._mux.RequestChannel`.

A local worker process (:mod:`asyncrefit.local._server`) and a trainer rank
(:mod:`asyncrefit.trainer._rank`) serve their coordinator the same way: read a frame,
decode it (handles by reference, through the connection's
:class:`~asyncrefit._wire._refs.RefDecoder`), hand the request to the peer's handler,
encode the reply under the request's id and send it; one request at a time, in the
order they arrived, so an answer means every earlier request was carried out.

Error handling: the handler answers a failed request with an error reply itself
(:func:`~asyncrefit._wire._errors.error_reply`); a load naming a handle the connection
never carried is answered with the error here (by default as any error; ``unknown``
picks the reply, e.g. a protocol error). With ``encode_failures`` a reply that does not
encode (an override returned something that does not pickle) is answered with its
error reply; otherwise the error ends the loop. ``served`` counts the requests
answered (or whose answer was attempted). The channel ending or failing (or a
reply's send timing out) ends the loop, which reports it by returning ``None``: the
coordinator is gone. Resource handling: the loop owns nothing; the channel and the
decoder are the caller's, so a caller may serve one connection in several calls (a
rank serves one push per call), and a call cancelled while it waits for a frame
leaves the connection usable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from ._channel import FrameChannel
from ._errors import error_reply
from ._messages import ErrorReply, encode
from ._refs import RefDecoder, UnknownHandleError

__all__ = ("Handler", "Served", "serve")

#: Answers one request (never raises for a failed request: answers with the error).
Handler = Callable[[Any], Awaitable[Any]]

_LOST = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)


@dataclass(slots=True)
class Served:
    """How many requests a :func:`serve` call answered (counted before the send)."""

    requests: int = 0


def _encoded(request_id: int, reply: Any, encode_failures: bool) -> bytes:
    if not encode_failures:
        return encode((request_id, reply))
    try:
        return encode((request_id, reply))
    except Exception as exc:  # a reply that does not pickle
        return encode((request_id, error_reply(exc)))


async def serve(
    channel: FrameChannel,
    refs: RefDecoder,
    handle: Handler,
    *,
    until: Callable[[Any], bool],
    send_timeout: float,
    unknown: Callable[[UnknownHandleError], ErrorReply] = error_reply,
    encode_failures: bool = False,
    served: Served | None = None,
) -> tuple[Any] | None:
    """Serve requests in order until one that ``until`` accepts was answered.

    ``unknown``: the reply to a request naming a handle never carried (``until`` then
    sees ``None``); ``encode_failures``: answer a reply that does not encode with its
    error reply; ``served``: counts the requests answered.

    Returns ``(request,)``: the request after whose answer serving stopped; ``None``:
    the channel ended or failed (the coordinator is gone).
    """
    while True:
        try:
            data = await channel.receive()
        except _LOST:
            return None
        request: Any
        try:
            request_id, request = refs.decode(data)
        except UnknownHandleError as exc:
            request_id, request = exc.request_id, None
            reply: Any = unknown(exc)
        else:
            reply = await handle(request)
        if served is not None:
            served.requests += 1
        data = _encoded(request_id, reply, encode_failures)
        try:
            await channel.send(data, within=send_timeout)
        except (*_LOST, TimeoutError):
            return None
        if until(request):
            return (request,)
