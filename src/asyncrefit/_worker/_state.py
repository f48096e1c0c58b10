"""What a worker holds: the pure state machine of its complete and pending versions."""

from __future__ import annotations

from .._exceptions import UpdateStateError


class VersionState:
    """Which version a worker holds completely, and which one it is receiving.

    A worker that has had even one bucket of a new version written into it holds no
    complete version until that version is committed: ``complete`` is then ``None``.
    Aborting before any byte was written keeps the previous complete version.

    A *direct* version (``begin(version, direct=True)``) is written into the worker's
    memory by the trainer, without a load per bucket: the worker counts as written
    from its begin on (an abort leaves it without a complete version), and its
    commit counts no buckets. If the coordinator then says that no byte of it was
    written (:meth:`unwritten`, before its abort: it began the worker ahead of the
    writes), the complete version held before the begin is whole again.
    """

    __slots__ = ("before", "complete", "direct", "dirty", "loaded", "pending")

    def __init__(self) -> None:
        self.complete: int | None = None
        self.pending: int | None = None
        self.dirty = False
        self.direct = False
        self.loaded: set[int] = set()
        #: The complete version held when the pending direct version began.
        self.before: int | None = None

    def __repr__(self) -> str:
        return (
            f"<VersionState complete={self.complete} pending={self.pending} "
            f"loaded={len(self.loaded)}>"
        )

    def begin(self, version: int, *, direct: bool = False) -> None:
        if self.pending is not None:
            self.abort(self.pending)
        self.pending, self.dirty, self.loaded = version, False, set()
        self.direct = direct
        if direct:  # the trainer may write from now on
            self.before = self.complete
            self.dirty, self.complete = True, None

    def check_loading(self, version: int) -> None:
        if self.pending != version:
            raise UpdateStateError(
                f"bucket of version {version} arrived, but the worker is receiving "
                f"{self.pending if self.pending is not None else 'nothing'}"
            )

    def loading(self, version: int, bucket: int) -> None:
        """Record that bytes of ``bucket`` are about to be written."""
        self.check_loading(version)
        self.dirty, self.complete = True, None
        self.loaded.add(bucket)

    def check_commit(self, version: int, buckets: int) -> None:
        """Raise :class:`UpdateStateError` unless :meth:`commit` would succeed."""
        self.check_loading(version)
        if not self.direct and len(self.loaded) != buckets:
            raise UpdateStateError(
                f"version {version} committed with {len(self.loaded)} of {buckets} buckets loaded"
            )

    def commit(self, version: int, buckets: int) -> None:
        self.check_commit(version, buckets)
        self.complete, self.pending, self.dirty, self.loaded = version, None, False, set()
        self.direct = False

    def written(self, version: int) -> bool:
        """Whether any byte of ``version`` was written and the version is not committed."""
        return self.pending == version and self.dirty

    def unwritten(self, version: int) -> None:
        """The coordinator says no byte of the pending direct ``version`` was written:
        the version held before its begin is complete again (an abort follows).

        Only the coordinator knows this of a direct version (the trainer writes without
        telling the worker); it says so only before it issued any write of the push.
        Nothing changes for another version, or one loaded bucket by bucket (the worker
        knows itself what was written then).
        """
        if self.pending == version and self.direct and not self.loaded:
            self.dirty, self.complete = False, self.before

    def abort(self, version: int) -> None:
        if self.pending is None or self.pending != version:
            return  # nothing of that version here: aborting is idempotent
        if self.dirty:
            self.complete = None
        self.pending, self.dirty, self.loaded = None, False, set()
        self.direct = False
