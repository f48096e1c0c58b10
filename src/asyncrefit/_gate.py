"""The gate a push holds its first direct write at until every worker began."""

from __future__ import annotations

import threading


class WriteGate:
    """A gate between a push (on its event loop) and a source's thread.

    A push hands its direct writes to a source (a
    :class:`~asyncrefit.abc.GatedWritingSource`) while its workers are still
    beginning: :meth:`wait` blocks the source's thread until the push opens the gate
    (every worker began and the plan holds: the writes may go) or shuts it (nothing may
    be written). Shut after it opened (the push failed or was cancelled meanwhile), the
    gate is :attr:`stopped`: the source writes no further bucket. The push opens it at
    most once and shuts it in every case, from its event loop; the source's thread
    reads it, from any thread, any number of times.
    """

    __slots__ = ("_decided", "_open", "_stopped")

    def __init__(self) -> None:
        self._decided = threading.Event()
        self._open = False
        self._stopped = False

    def __repr__(self) -> str:
        if self._open:
            state = "stopped" if self._stopped else "open"
        else:
            state = "shut" if self._decided.is_set() else "pending"
        return f"<WriteGate {state}>"

    @property
    def decided(self) -> bool:
        """Whether the gate was opened or shut."""
        return self._decided.is_set()

    def open(self) -> None:
        """Let the writes go (unless the gate was shut already)."""
        if not self._decided.is_set():
            self._open = True
            self._decided.set()

    def shut(self) -> None:
        """Let nothing be written; once open, no further bucket (:attr:`stopped`)."""
        if self._open:
            self._stopped = True
        self._decided.set()

    @property
    def stopped(self) -> bool:
        """Whether the gate was shut after it opened: write no further bucket."""
        return self._stopped

    def wait(self) -> bool:
        """Block until the gate is decided: ``True`` if the writes may go."""
        self._decided.wait()
        return self._open
