"""Where the time of a direct push goes, seen from the trainer's process.

:class:`PushTimeline` wraps the steps of a push (the coordinator's describe, each
worker's begin, each call of the source's writes and the thread that issues them, the
flush, each commit; on vLLM, the engine link's begin and commit) while it is entered,
and records when each starts and ends, in ms since ``push`` was called. Outside the
``with`` nothing is wrapped. The benchmarks run a few more pushes under it after their
timed ones (the wrappers cost a few microseconds each) and print the median of each
mark (:meth:`PushTimeline.table`)::

    with PushTimeline() as timeline:
        for v in ...:
            await refit.push(v)
    print(timeline.table())

A mark ``write<#2`` is the second start of a source write in the push; ``at`` is its
median time since the push began and ``step`` the median time since the mark before it.
``gate<`` is when the push opened the gate its first write waited at (every worker
began), ``bucket<#k`` when the source's thread starts writing the k-th bucket (reads
which tensors go where, then issues the copies). The GPU's own activity is not seen:
on a GPU, the copies start some microseconds after ``bucket<#1`` and end before
``commit>``.
"""

from __future__ import annotations

import collections
import functools
import statistics
import time
from types import TracebackType
from typing import Any

Mark = tuple[str, float]


class PushTimeline:
    """Record the steps of every push made while entered (see the module)."""

    def __init__(self) -> None:
        self._marks: list[Mark] = []
        self.pushes: list[list[Mark]] = []
        self._restore: list[tuple[object, str, Any]] = []

    # --- wrapping ------------------------------------------------------------------------

    def _mark(self, label: str) -> None:
        self._marks.append((label, time.perf_counter()))

    def _wrap_async(self, owner: object, name: str, label: str, *, push: bool = False) -> None:
        original = getattr(owner, name)
        marks = self._marks

        @functools.wraps(original)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            if push:
                marks.clear()
            marks.append((label + "<", time.perf_counter()))
            try:
                return await original(*args, **kwargs)
            finally:
                marks.append((label + ">", time.perf_counter()))
                if push:
                    self.pushes.append(list(marks))

        self._restore.append((owner, name, original))
        setattr(owner, name, wrapped)

    def _wrap_sync(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)
        marks = self._marks

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            marks.append((label + "<", time.perf_counter()))
            try:
                return original(*args, **kwargs)
            finally:
                marks.append((label + ">", time.perf_counter()))

        self._restore.append((owner, name, original))
        setattr(owner, name, wrapped)

    def __enter__(self) -> PushTimeline:
        from asyncrefit import RefitCoordinator
        from asyncrefit._core import _coordinator, _push
        from asyncrefit.abc import WriteGate
        from asyncrefit.trainer import _direct

        self._wrap_async(RefitCoordinator, "push", "push", push=True)
        self._wrap_async(_coordinator, "describe_sources", "describe")
        self._wrap_async(_push.Push, "_begin", "begin")
        self._wrap_async(_direct.DirectWriter, "write", "write")
        self._wrap_async(_direct.DirectWriter, "write_gated", "write")
        self._wrap_sync(_direct.DirectWriter, "_write_all", "thread")
        self._wrap_sync(WriteGate, "open", "gate")
        self._wrap_sync(_direct.DirectWriter, "_write", "bucket")
        self._wrap_async(_direct.DirectWriter, "flush", "flush")
        self._wrap_async(_push.Push, "_commit", "commit")
        try:
            from asyncrefit.vllm import _link
        except ImportError:
            pass
        else:
            self._wrap_async(_link._EngineLink, "begin", "engine-begin")
            self._wrap_async(_link._EngineLink, "commit", "engine-commit")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    # --- the summary ---------------------------------------------------------------------

    def summary(self) -> list[dict[str, Any]]:
        """Per mark seen in every push, in order: its median time since the push began
        (``at_ms``) and since the mark before it (``step_ms``)."""
        steps: dict[str, list[float]] = collections.defaultdict(list)
        ats: dict[str, list[float]] = collections.defaultdict(list)
        order: list[str] = []
        for marks in self.pushes:
            start = marks[0][1]
            previous = start
            seen: collections.Counter[str] = collections.Counter()
            for label, t in marks:
                seen[label] += 1
                key = f"{label}#{seen[label]}"
                if key not in ats:
                    order.append(key)
                ats[key].append((t - start) * 1e3)
                steps[key].append((t - previous) * 1e3)
                previous = t
        n = len(self.pushes)
        return [
            {
                "mark": key,
                "at_ms": statistics.median(ats[key]),
                "step_ms": statistics.median(steps[key]),
            }
            for key in order
            if len(ats[key]) == n
        ]

    def table(self, *, title: str = "timeline") -> str:
        rows = self.summary()
        lines = [f"{title}: median of {len(self.pushes)} pushes, ms since push() was called"]
        lines.append(f"  {'mark':<22} {'at':>8} {'step':>8}")
        lines += [f"  {r['mark']:<22} {r['at_ms']:8.3f} {r['step_ms']:8.3f}" for r in rows]
        return "\n".join(lines)
