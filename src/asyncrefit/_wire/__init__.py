"""The wire stack: how the coordinator talks to a worker or trainer rank in another process.

Bottom-up:

1. :mod:`._channel`: whole frames (8-byte length, payload) over a connected stream
   socket, cancel-safe (:class:`FrameChannel`, Unix and TCP listeners and connects);
   :mod:`._framing`: the same frames over an anyio byte stream or a blocking socket
   (what vLLM's worker processes, which have no event loop of their own, use).
2. :mod:`._pickling`: fast pickling of the small frozen records that cross at every
   bucket; :mod:`._messages`: the codec (:func:`encode` / :func:`decode`) and the
   message vocabulary (requests, replies, :class:`Hello`, :class:`ErrorReply`).
3. :mod:`._refs`: handles by reference on one connection (a load in a few bytes).
4. :mod:`._mux`: :class:`RequestChannel`, many outstanding requests over one channel,
   replies matched by id (the one client); :mod:`._serve`: the one serve loop of the
   peer (read, decode, dispatch, answer, in order).
5. :mod:`._errors`: the one error map, channel failures and error replies to the
   library's typed errors (:func:`map_exceptions`).

This package imports nothing from the rest of asyncrefit at import time except
leaf modules (devices, plans, transport records, the exception hierarchy), so those may
import from it.
"""
