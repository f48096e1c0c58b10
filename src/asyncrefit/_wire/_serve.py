"""The one serve loop: a peer's side of a :class:`~asyncrefit._wire._mux.RequestChannel`.

A local worker process (:mod:`asyncrefit.local._server`) and a trainer rank
(:mod:`asyncrefit.trainer._rank`) serve their coordinator the same way: read a frame,
decode it (handles by reference, through the connection's
:class:`~asyncrefit._wire._refs.RefDecoder`), hand the request to the peer's handler,
encode the reply under the request's id and send it; one request at a time, in the
order they arrived, so an answer means every earlier request was carried out.

Error handling: the handler answers a failed request with an error reply itself
(:func:`~asyncrefit._wire._errors.error_reply`); a load naming a handle the connection
never carried is answered with the error here. The channel ending or failing (or a
reply's send timing out) ends the loop, which reports it by returning ``None``: the
coordinator is gone. Resource handling: the loop owns nothing; the channel and the
decoder are the caller's, so a caller may serve one connection in several calls (a
rank serves one push per call), and a call cancelled while it waits for a frame
leaves the connection usable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ._channel import FrameChannel
from ._errors import error_reply
from ._messages import encode
from ._refs import RefDecoder, UnknownHandleError

__all__ = ("Handler", "serve")

#: Answers one request (never raises for a failed request: answers with the error).
Handler = Callable[[Any], Awaitable[Any]]

_LOST = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)


async def serve(
    channel: FrameChannel,
    refs: RefDecoder,
    handle: Handler,
    *,
    until: Callable[[Any], bool],
    send_timeout: float,
) -> tuple[Any] | None:
    """Serve requests in order until one that ``until`` accepts was answered.

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
            reply: Any = error_reply(exc)
        else:
            reply = await handle(request)
        try:
            await channel.send(encode((request_id, reply)), within=send_timeout)
        except (*_LOST, TimeoutError):
            return None
        if until(request):
            return (request,)
