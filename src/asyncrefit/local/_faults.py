"""Fault injection for tests and drills: make a local worker crash or hang on cue."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerFaults:
    """Faults a local worker process injects into itself.

    ``crash_at_bucket``: the process exits abruptly (``os._exit``) when asked to load
    that bucket, before copying any of it. ``kill_at_bucket``: the process sends
    itself SIGKILL half-way through copying that bucket (after its first tensor).
    ``hang_at_bucket``: the worker never answers the load of that bucket (nor anything
    after it). ``load_delay``: seconds to sleep before every bucket's copy (to widen
    windows in tests). ``gpu_delay_cycles``: GPU clock cycles the worker's stream spins
    before every bucket's copies (``torch.cuda._sleep``): the copies run late on the
    device while the host carries on.
    """

    crash_at_bucket: int | None = None
    kill_at_bucket: int | None = None
    hang_at_bucket: int | None = None
    load_delay: float = 0.0
    gpu_delay_cycles: int = 0
