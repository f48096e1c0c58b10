"""Handles by reference on one connection: a bucket's notification in a few bytes.

A trainer source hands out the same handle object for a slot at every push while the
handle's value is unchanged (see ``_SourceBase._handles_for``). On a connection that
lasts across pushes the coordinator's side therefore sends each handle in full once,
under a number, and from then on only its number: a :class:`LoadBucket` goes out as
``(request id, version, bucket, numbers, new handles)``, a plain tuple of some 25
bytes pickled (a request is ``(request id, request)``: the length tells them apart).
The worker's side turns it back into the :class:`LoadBucket` with the very handle
objects it decoded the first time, which its endpoint recognises by identity (no
hashing, no validation again).

Both ends keep the same table without saying anything more to each other: numbers
are given in the order handles first go out, and each :class:`BeginUpdate` starts a
new generation on both sides, in the order the frames travel: what the last push did
not use is dropped, so handles that change (a checksum at every push, re-allocated
slots) do not accumulate. The encoder must see every request in the order it goes on
the wire, the decoder every request in the order it arrived; a connection that failed
is not reused, so neither table outlives its connection.
"""

from __future__ import annotations

from typing import Any

from .._exceptions import UnknownHandleError
from ..transport._base import Handle
from ._messages import BeginUpdate, LoadBucket, decode, encode

__all__ = ("RefDecoder", "RefEncoder", "UnknownHandleError")


class RefEncoder:
    """The sending side's table: turns requests into frames' payloads."""

    __slots__ = ("_before", "_next", "_now")

    def __init__(self) -> None:
        # id(handle) -> (the handle, its number); an entry holds its handle, so the id
        # is not reused while it is here.
        self._now: dict[int, tuple[Handle, int]] = {}
        self._before: dict[int, tuple[Handle, int]] = {}
        self._next = 0

    def __len__(self) -> int:
        """How many handles the table holds (both generations)."""
        return len(self._now.keys() | self._before.keys())

    def encode(self, request_id: int, request: object) -> bytes:
        """The payload of ``(request_id, request)``, a :class:`LoadBucket` by reference.

        Call it for every request, in the order they go out. The table changes only
        once the payload was made (a request that fails to pickle changes nothing).
        """
        if isinstance(request, LoadBucket):
            refs, new, seen, after = self._refer(request)
            data = encode((request_id, request.version, request.bucket, refs, new))
            self._now.update(seen)
            self._next = after
            return data
        data = encode((request_id, request))
        if isinstance(request, BeginUpdate):
            self._before, self._now = self._now, {}
        return data

    def _refer(
        self, load: LoadBucket
    ) -> tuple[tuple[int, ...], tuple[Handle, ...], dict[int, tuple[Handle, int]], int]:
        """``load``'s numbers and new handles, the entries they add to this generation
        and the next number after them; the table itself is left as it is."""
        refs: list[int] = []
        new: list[Handle] = []
        seen: dict[int, tuple[Handle, int]] = {}
        now, before, after = self._now, self._before, self._next
        for handle in load.handles:
            key = id(handle)
            known = seen.get(key) or now.get(key)
            if known is None or known[0] is not handle:
                known = before.get(key)
                if known is None or known[0] is not handle:
                    known = (handle, after)
                    after += 1
                    new.append(handle)
                seen[key] = known
            refs.append(known[1])
        return tuple(refs), tuple(new), seen, after


class RefDecoder:
    """The receiving side's table: turns frames' payloads back into requests."""

    __slots__ = ("_before", "_next", "_now")

    def __init__(self) -> None:
        self._now: dict[int, Handle] = {}
        self._before: dict[int, Handle] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._now) + len(self._before)

    def decode(self, data: bytes) -> tuple[int, Any]:
        """``(request id, request)`` of a payload; a load by reference comes back as
        its :class:`LoadBucket`, with the handle objects this side decoded first.

        Call it for every payload, in the order they arrived. Raises
        :class:`UnknownHandleError` for a number this side never received.
        """
        message = decode(data)
        if len(message) == 2:
            request_id, request = message
            if isinstance(request, BeginUpdate):
                self._before, self._now = self._now, {}
            return request_id, request
        request_id, version, bucket, refs, new = message
        return request_id, self._resolve(request_id, version, bucket, refs, new)

    def _resolve(
        self,
        request_id: int,
        version: int,
        bucket: int,
        refs: tuple[int, ...],
        new: tuple[Handle, ...],
    ) -> LoadBucket:
        now, before = self._now, self._before
        for handle in new:
            now[self._next] = handle
            self._next += 1
        handles: list[Handle] = []
        for number in refs:
            known = now.get(number)
            if known is None:
                known = before.pop(number, None)
                if known is None:
                    raise UnknownHandleError(
                        request_id,
                        f"bucket {bucket} of version {version} names handle {number}, "
                        "which this connection never carried",
                    )
                now[number] = known
            handles.append(known)
        return LoadBucket(version=version, bucket=bucket, handles=tuple(handles))
