"""What a push did: :class:`RefitReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """Seconds spent per stage of a push.

    ``pack`` and ``load`` are sums over buckets (pack: filling and exporting a slot;
    load: from sending a bucket's handles to its last ack); with several buckets in
    flight they overlap, so their sum may exceed the push's wall time.
    ``wait_budget`` is the time spent waiting for a free slot.
    """

    plan: float
    begin: float
    wait_budget: float
    pack: float
    load: float
    commit: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitReport:
    """The result of one successful push.

    ``bytes`` counts tensor payload (without padding) sent once; each worker received
    all of it. ``handle_bytes_per_worker`` counts the serialized bytes of the handles
    each worker was sent, each load's in full (a link that sends a handle it sent before
    by reference, as the local backend does, puts fewer on the wire): with filtered
    dispatch it does not grow with the number of workers or devices.
    ``bytes_per_transport`` counts payload delivered per transport kind (``"shm"``,
    ``"cuda_ipc"``, ...), summed over workers.
    """

    version: int
    buckets: int
    bytes: int
    seconds: float
    stages: StageTimes
    workers: tuple[str, ...]
    handle_bytes_per_worker: dict[str, int]
    bytes_per_transport: dict[str, int]
    slots: int
    slot_bytes: int
    peak_budget_bytes: int

    @property
    def gbps(self) -> float:
        """Payload rate in GB/s (10^9 bytes per second) of the whole push."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field, ``gbps`` included."""
        d = asdict(self)
        d["gbps"] = self.gbps
        return d

    def __str__(self) -> str:
        per_worker = sorted(set(self.handle_bytes_per_worker.values()))
        return (
            f"version {self.version}: {self.bytes / 2**20:.1f} MiB in {self.buckets} buckets "
            f"to {len(self.workers)} workers in {self.seconds * 1e3:.1f} ms "
            f"({self.gbps:.2f} GB/s); handle bytes per worker {per_worker}"
        )
