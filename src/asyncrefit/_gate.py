"""The gate a push holds its first direct write at until every worker began."""

from __future__ import annotations

import threading


class WriteGate:
    """A one-shot gate between a push (on its event loop) and a source's thread.

    A push hands its first direct write to a source (a
    :class:`~asyncrefit.abc.GatedWritingSource`) while its workers are still
    beginning: the source gets ready (its thread, the tensors to write, where they go)
    and :meth:`wait` blocks that thread until the push opens the gate (every worker
    began: the writes may go) or shuts it (the push failed or was cancelled first:
    nothing may be written). The push opens or shuts each gate exactly once, from its
    event loop; :meth:`wait` may be called from any thread, any number of times.
    """

    __slots__ = ("_decided", "_open")

    def __init__(self) -> None:
        self._decided = threading.Event()
        self._open = False

    def __repr__(self) -> str:
        state = "open" if self._open else "shut" if self._decided.is_set() else "pending"
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
        """Let nothing be written (unless the gate was opened already)."""
        self._decided.set()

    def wait(self) -> bool:
        """Block until the gate is decided: ``True`` if the writes may go."""
        self._decided.wait()
        return self._open
