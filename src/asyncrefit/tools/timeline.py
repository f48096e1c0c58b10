"""A picture of a push, from its :mod:`asyncrefit.events`: a trace file or a PNG.

Record a push's events (``refit.subscribe(events.append)``), then either

- :func:`chrome_trace`: a dict in the Chrome trace event format (write it with
  ``json.dump``), which Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open, or
- :func:`draw_timeline`: a PNG drawn with matplotlib (``pip install
  'asyncrefit[timeline]'``).

Both show the same lanes and intervals. Each push (version) is one process, named
``asyncrefit push <version>``; its lanes (threads, named by ``"M"`` metadata events
``process_name`` / ``thread_name``) are ``push`` (the push-level moments), one
``slot <n>`` per staging slot and one ``worker <name>`` per worker. Times are in
microseconds (``ts`` / ``dur``) from the moment the push was called
(:attr:`PushBegun.started`; the first event's time when that was not recorded).

Complete events (``"ph": "X"``):

- ``pack`` (slot lane): from when bucket's pack began to when every source had
  packed and exported it (:class:`BucketPacked`); ``args``: ``bucket``, ``slot``,
  ``bytes``.
- ``notify`` (worker lane): from when the bucket's handle went out to the worker
  (:attr:`BucketAcked.sent`) to the start of its copy. Requests are pipelined, so a
  handle may go out while the worker still copies the previous bucket: the bar then
  starts when that copy ended, and ``args["sent_ms"]`` keeps the time it went out.
- ``copy`` (worker lane): the last :attr:`BucketAcked.seconds` (what the worker
  reported for its copy) before its ack was received; ``args``: ``bucket``,
  ``slot``, ``seconds``.

Instant events (``"ph": "i"``):

- ``ack`` (worker lane): the worker's ack of a bucket was received;
- ``push begun`` (push lane): every worker was told to begin;
- ``worker failed`` (the failed worker's lane): the failure that ended the push;
- ``push committed`` / ``push aborted`` (push lane): the end of the push.

Bars never overlap within a lane: an interval that would begin before the previous
one on its lane ended begins when it ended (durations are never negative). Within a
lane, events are in time order.

Error handling: events of pushes other than the one drawn are ignored by
:func:`draw_timeline`; events it does not know are ignored by both; a stream
without any event of a push raises :class:`ValueError`. :func:`draw_timeline`
raises :class:`ImportError` naming the extra to install when matplotlib is missing.

Resource handling: :func:`draw_timeline` renders off screen (matplotlib's Agg
canvas, not pyplot: no window, no global backend switch) and frees its figure.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..events import (
    BucketAcked,
    BucketPacked,
    Event,
    PushAborted,
    PushBegun,
    PushCommitted,
    WorkerFailed,
)

__all__ = ("PushTimeline", "chrome_trace", "draw_timeline", "require_matplotlib", "timelines")

#: What to install when :func:`draw_timeline` finds no matplotlib.
INSTALL_HINT = "pip install 'asyncrefit[timeline]'"
PUSH_LANE = "push"


@dataclass(frozen=True, slots=True)
class Span:
    """A bar: ``name`` on ``lane`` from ``start`` to ``end`` (seconds from the push start)."""

    lane: str
    name: str
    start: float
    end: float
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Mark:
    """A moment: ``name`` on ``lane`` at ``at`` (seconds from the push start)."""

    lane: str
    name: str
    at: float
    args: dict[str, Any]


@dataclass(slots=True)
class PushTimeline:
    """The lanes, bars and moments of one push, times in seconds from its start."""

    version: int
    origin: float  # perf_counter seconds of the push start
    lanes: list[str]  # the push lane, the slot lanes by index, the worker lanes
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    bytes: int | None = None
    seconds: float | None = None
    outcome: str = "unfinished"  # "committed", "aborted: <cause>" or "unfinished"


def _slot_lane(slot: int) -> str:
    return f"slot {slot}"


def _worker_lane(worker: str) -> str:
    return f"worker {worker}"


def _one_push(version: int, events: list[Event]) -> PushTimeline:
    begun = next((e for e in events if isinstance(e, PushBegun)), None)
    origin = begun.started if begun is not None else min(_first_time(e) for e in events)
    slots = sorted({e.slot for e in events if isinstance(e, (BucketPacked, BucketAcked))})
    workers: list[str] = list(begun.workers) if begun is not None else []
    for e in events:
        name = e.worker if isinstance(e, (BucketAcked, WorkerFailed)) else None
        if name is not None and name not in workers:
            workers.append(name)
    lanes = [PUSH_LANE, *map(_slot_lane, slots), *map(_worker_lane, workers)]
    timeline = PushTimeline(version=version, origin=origin, lanes=lanes)
    if begun is not None:
        timeline.bytes = begun.bytes

    def rel(t: float) -> float:
        return t - origin

    ends = dict.fromkeys(lanes, -float("inf"))  # where the last bar of each lane ended

    def span(lane: str, name: str, start: float, end: float, args: dict[str, Any]) -> float:
        start = max(start, ends[lane])
        end = max(end, start)
        ends[lane] = end
        timeline.spans.append(Span(lane, name, start, end, args))
        return end

    # Bars in the order they began on their lane: packs by start, a worker's buckets
    # by when their handles went out.
    for e in sorted(
        (e for e in events if isinstance(e, BucketPacked)), key=lambda e: (e.started, e.time)
    ):
        span(
            _slot_lane(e.slot),
            "pack",
            rel(e.started),
            rel(e.time),
            {"bucket": e.bucket, "slot": e.slot, "bytes": e.bytes},
        )
    for e in sorted(
        (e for e in events if isinstance(e, BucketAcked)), key=lambda e: (e.sent, e.time)
    ):
        lane = _worker_lane(e.worker)
        acked = rel(e.time)
        copy_start = max(rel(e.sent), acked - max(e.seconds, 0.0))
        args = {"bucket": e.bucket, "slot": e.slot}
        copy_start = span(
            lane, "notify", rel(e.sent), copy_start, {**args, "sent_ms": rel(e.sent) * 1e3}
        )
        span(lane, "copy", copy_start, acked, {**args, "seconds": e.seconds})
        timeline.marks.append(Mark(lane, "ack", acked, args))

    for e in events:
        if isinstance(e, PushBegun):
            timeline.marks.append(
                Mark(
                    PUSH_LANE,
                    "push begun",
                    rel(e.time),
                    {"buckets": e.buckets, "bytes": e.bytes, "workers": list(e.workers)},
                )
            )
        elif isinstance(e, WorkerFailed):
            timeline.marks.append(
                Mark(
                    _worker_lane(e.worker),
                    "worker failed",
                    rel(e.time),
                    {"error": e.error, "message": e.message},
                )
            )
        elif isinstance(e, PushCommitted):
            timeline.bytes, timeline.seconds, timeline.outcome = e.bytes, e.seconds, "committed"
            timeline.marks.append(
                Mark(PUSH_LANE, "push committed", rel(e.time), {"seconds": e.seconds})
            )
        elif isinstance(e, PushAborted):
            timeline.seconds, timeline.outcome = e.seconds, f"aborted: {e.cause}"
            timeline.marks.append(
                Mark(
                    PUSH_LANE,
                    "push aborted",
                    rel(e.time),
                    {"cause": e.cause, "incomplete": list(e.incomplete)},
                )
            )
    timeline.marks.sort(key=lambda m: m.at)
    return timeline


def _first_time(event: Event) -> float:
    started = getattr(event, "started", None)
    sent = getattr(event, "sent", None)
    return min(t for t in (event.time, started, sent) if isinstance(t, float))


def timelines(events: Iterable[Event]) -> list[PushTimeline]:
    """The events grouped by push (version), in the order the pushes first appear."""
    by_version: dict[int, list[Event]] = {}
    known = (PushBegun, BucketPacked, BucketAcked, WorkerFailed, PushCommitted, PushAborted)
    for event in events:
        if isinstance(event, known):
            by_version.setdefault(event.version, []).append(event)
    return [_one_push(version, evs) for version, evs in by_version.items()]


# --- the Chrome trace event format ----------------------------------------------------


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _meta(pid: int, tid: int, what: str, **args: object) -> dict[str, Any]:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": args}


def chrome_trace(events: Iterable[Event]) -> dict[str, Any]:
    """The pushes of ``events`` in the Chrome trace event format (a JSON-ready dict).

    ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``: one
    process per push, one thread per lane, the event names of this module's
    docstring. Metadata events come first, then each lane's events in time order.
    Raises :class:`ValueError` when ``events`` holds no push event.
    """
    pushes = timelines(events)
    if not pushes:
        raise ValueError("no push events to trace")
    meta: list[dict[str, Any]] = []
    body: list[dict[str, Any]] = []
    for pid, push in enumerate(pushes, start=1):
        meta += [
            _meta(pid, 0, "process_name", name=f"asyncrefit push {push.version}"),
            _meta(pid, 0, "process_sort_index", sort_index=pid),
        ]
        tids = {lane: tid for tid, lane in enumerate(push.lanes)}
        for lane, tid in tids.items():
            meta += [
                _meta(pid, tid, "thread_name", name=lane),
                _meta(pid, tid, "thread_sort_index", sort_index=tid),
            ]
        lane_events: list[tuple[int, float, int, dict[str, Any]]] = []
        for s in push.spans:
            lane_events.append(
                (
                    tids[s.lane],
                    s.start,
                    len(lane_events),
                    {
                        "ph": "X",
                        "name": s.name,
                        "cat": "asyncrefit",
                        "pid": pid,
                        "tid": tids[s.lane],
                        "ts": _us(s.start),
                        "dur": max(0.0, _us(s.end) - _us(s.start)),
                        "args": s.args,
                    },
                )
            )
        for m in push.marks:
            lane_events.append(
                (
                    tids[m.lane],
                    m.at,
                    len(lane_events),
                    {
                        "ph": "i",
                        "name": m.name,
                        "cat": "asyncrefit",
                        "pid": pid,
                        "tid": tids[m.lane],
                        "ts": _us(m.at),
                        "s": "p" if m.lane == PUSH_LANE else "t",
                        "args": m.args,
                    },
                )
            )
        body += [e for *_, e in sorted(lane_events, key=lambda x: (x[0], x[1], x[2]))]
    return {
        "traceEvents": meta + body,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "asyncrefit.tools.timeline",
            "versions": [p.version for p in pushes],
        },
    }


# --- the picture ----------------------------------------------------------------------

#: Bar colours (matplotlib's tab10), one per kind of bar.
COLOURS = {"pack": "tab:blue", "notify": "tab:orange", "copy": "tab:green"}


def require_matplotlib() -> None:
    """Raise :class:`ImportError` naming the extra to install if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"drawing a timeline needs matplotlib, which did not import ({exc}): {INSTALL_HINT}"
        ) from exc


def _title(push: PushTimeline) -> str:
    size = f"{push.bytes / 2**20:.1f} MiB" if push.bytes is not None else "? MiB"
    took = f"{push.seconds * 1e3:.1f} ms" if push.seconds is not None else "unfinished"
    rate = ""
    if push.bytes is not None and push.seconds:
        rate = f", {push.bytes / push.seconds / 1e9:.2f} GB/s"
    return f"asyncrefit push {push.version}: {size} in {took}{rate} ({push.outcome})"


def draw_timeline(
    events: Iterable[Event], path: str | os.PathLike[str], *, version: int | None = None
) -> PushTimeline:
    """Draw one push of ``events`` as a PNG (or any format matplotlib writes) at ``path``.

    One horizontal lane per slot and per worker (and one for the push's own moments),
    bars for ``pack`` / ``notify`` / ``copy`` in distinct colours, a tick per ack, a
    legend, the time axis in milliseconds from the push start, and a title with the
    version, bytes and seconds. Draws ``version``, by default the last push in
    ``events``; returns the :class:`PushTimeline` drawn.

    Error handling: :class:`ImportError` (naming ``pip install
    'asyncrefit[timeline]'``) without matplotlib; :class:`ValueError` when no event
    of the push is there.

    Resource handling: rendered on a private Agg canvas (no window, pyplot's state
    untouched); the figure is freed when the function returns.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    pushes = timelines(events)
    if version is not None:
        pushes = [p for p in pushes if p.version == version]
    if not pushes:
        which = f"of version {version}" if version is not None else "of any push"
        raise ValueError(f"no events {which} to draw")
    push = pushes[-1]

    lanes = push.lanes
    row = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}  # first lane on top
    height = 0.6
    fig = Figure(figsize=(11, 1.2 + 0.45 * len(lanes)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, colour in COLOURS.items():
        bars = [s for s in push.spans if s.name == name]
        if not bars:
            continue
        # notify sits thinner under copy, so a queued handle reads as waiting
        h = height * (0.5 if name == "notify" else 1.0)
        for s in bars:
            ax.broken_barh(
                [(s.start * 1e3, (s.end - s.start) * 1e3)],
                (row[s.lane] - h / 2, h),
                facecolors=colour,
                edgecolors="none",
            )
    for m in push.marks:
        y = row[m.lane]
        x = m.at * 1e3
        if m.name == "ack":
            ax.plot([x, x], [y - height / 2, y + height / 2], color="black", linewidth=0.8)
        elif m.name == "worker failed":
            ax.plot([x], [y], marker="X", color="tab:red", markersize=9)
        else:  # the push's own moments: a line across every lane
            colour = "tab:red" if m.name == "push aborted" else "dimgray"
            ax.axvline(x, color=colour, linestyle="--", linewidth=0.8)
            ax.annotate(
                m.name,
                (x, row[PUSH_LANE]),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color=colour,
            )
    ax.set_yticks(list(row.values()), list(row))
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("milliseconds since the push was called")
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(_title(push))
    handles: list[Any] = [Patch(color=c, label=n) for n, c in COLOURS.items()]
    handles.append(Line2D([], [], color="black", linewidth=0.8, label="ack"))
    fig.legend(handles=handles, loc="outside lower center", fontsize=8, ncols=len(handles))
    fig.savefig(os.fspath(path))
    return push
