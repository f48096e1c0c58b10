"""Prometheus metrics of a :class:`~asyncrefit.RefitCoordinator`'s pushes.

Needs the ``metrics`` extra (``pip install 'asyncrefit[metrics]'``: prometheus_client);
importing :mod:`asyncrefit` never imports this module nor prometheus_client, and a
coordinator without :class:`RefitMetrics` attached has no event listener at all::

    metrics = RefitMetrics()                 # on prometheus_client's default registry
    detach = metrics.attach(refit)           # or attach(refit, name="policy")
    server = serve_metrics(9400)             # http://127.0.0.1:9400/metrics
    ...
    server.close()

The metrics (``namespace`` ``asyncrefit`` by default; every one has the label
``coordinator``, the name given to :meth:`RefitMetrics.attach`):

- ``asyncrefit_pushes_total{outcome}``: pushes that ended, by ``outcome``: ``ok``, or
  the class name of the typed error that ended it (``WorkerDiedError``,
  ``WorkerTimeoutError``, ``VersionError``, ... any error class of asyncrefit),
  ``cancelled``, ``closed``; a cause that is none of those (an error class of another
  library, raised by a trainer source, say) is counted as ``other``, so the label's
  values are a bounded set. Version numbers are never labels;
- ``asyncrefit_push_duration_seconds``: histogram of the committed pushes' wall time,
  from the call of ``push`` to every worker holding the version (1 ms to 10 min);
- ``asyncrefit_pushed_bytes_total`` and ``asyncrefit_buckets_total``: payload bytes and
  buckets packed and sent by the trainer (once per bucket, whatever the number of
  workers; a failed push counts the buckets it got to);
- ``asyncrefit_worker_load_seconds{worker}``: histogram of the seconds each worker
  reported for copying a bucket (100 us to 60 s);
- read when scraped: ``asyncrefit_weight_version`` (the last version every worker
  holds; absent before the first), ``asyncrefit_worker_weight_version{worker}`` (the
  complete version each worker holds, ``-1`` for none), ``asyncrefit_budget_bytes``
  (the staging capacity), ``asyncrefit_budget_in_use_bytes``,
  ``asyncrefit_budget_peak_bytes`` and ``asyncrefit_quarantined_slots`` (slots held
  back because a worker may still read them).

Workers that leave: the scraped gauges follow the coordinator's membership at once; a
removed worker's ``worker_load_seconds`` series are dropped at the start of the next
push (every series with a ``worker`` label belongs to a worker of the last push), so
the series do not grow over many added and removed workers. :meth:`RefitMetrics.detach`
(or the callable :meth:`~RefitMetrics.attach` returns) drops every series of that
coordinator.

Resource handling: attaching subscribes one callback to the coordinator's events (it
runs inline on the push's loop: a few dict look-ups and a lock per event) and keeps a
reference to the coordinator until detached. :func:`serve_metrics` starts a daemon
thread serving HTTP; close what it returns to stop the thread and free the socket.

Error handling: importing this module without prometheus_client raises
:class:`ImportError` naming the extra; attaching a second coordinator under a name in
use raises :class:`ValueError`; a scrape that races a change of membership retries,
and skips that coordinator's scraped gauges for this scrape if it keeps racing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from wsgiref.simple_server import WSGIServer

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client import start_http_server as _start_http_server
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised in a subprocess
    raise ImportError(
        "asyncrefit.metrics needs prometheus_client: pip install 'asyncrefit[metrics]'"
    ) from exc

from ._exceptions import AsyncRefitError
from .events import BucketAcked, BucketPacked, PushAborted, PushBegun, PushCommitted, PushEvent

if TYPE_CHECKING:
    from ._core._coordinator import RefitCoordinator

__all__ = ("MetricsServer", "RefitMetrics", "serve_metrics")

#: Buckets of the push duration histogram, seconds: 1 ms to 10 min.
PUSH_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
#: Buckets of the per-worker load histogram, seconds: 100 us to 60 s.
LOAD_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: Outcomes that are not error class names.
OUTCOMES = ("ok", "cancelled", "closed", "other")
_SCRAPE_TRIES = 5

T = TypeVar("T")


def _error_names() -> frozenset[str]:
    """The class names of asyncrefit's errors (every subclass of AsyncRefitError)."""
    names: set[str] = set()
    todo: list[type[BaseException]] = [AsyncRefitError]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] == "asyncrefit":
            names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(names)


@dataclass(eq=False)
class _Attachment:
    """One attached coordinator: its name, its cached series, its unsubscriber."""

    name: str
    coordinator: RefitCoordinator
    duration: Histogram
    pushed_bytes: Counter
    buckets: Counter
    ok: Counter
    outcomes: set[str] = field(default_factory=set)
    loads: dict[str, Histogram] = field(default_factory=dict)
    unsubscribe: Callable[[], None] = lambda: None


class RefitMetrics:
    """Prometheus metrics of the coordinators attached to it (see the module's doc).

    ``registry``: where the metrics are registered (default prometheus_client's global
    ``REGISTRY``, the one :func:`serve_metrics` serves by default); one
    :class:`RefitMetrics` per registry and ``namespace``.

    Resource handling: registers its metrics and one collector (the gauges read when
    scraped) on ``registry``; :meth:`close` detaches every coordinator and unregisters
    them.

    Error handling: a second :class:`RefitMetrics` on the same registry and namespace
    raises prometheus_client's ``ValueError`` (duplicated time series).
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "asyncrefit"
    ) -> None:
        self._registry = registry if registry is not None else REGISTRY
        self._namespace = namespace
        self._lock = threading.Lock()  # attach/detach against the scraping thread
        self._attached: dict[str, _Attachment] = {}
        self._errors = _error_names()
        r, ns = self._registry, namespace
        self._pushes = Counter(
            "pushes",
            "Pushes that ended, by outcome: ok or the typed cause of the failure.",
            ("coordinator", "outcome"),
            namespace=ns,
            registry=r,
        )
        self._duration = Histogram(
            "push_duration_seconds",
            "Wall time of committed pushes, from the call to every worker holding it.",
            ("coordinator",),
            namespace=ns,
            registry=r,
            buckets=PUSH_BUCKETS,
        )
        self._bytes = Counter(
            "pushed_bytes",
            "Payload bytes of the buckets packed and sent (once per bucket).",
            ("coordinator",),
            namespace=ns,
            registry=r,
        )
        self._buckets = Counter(
            "buckets",
            "Buckets packed and sent.",
            ("coordinator",),
            namespace=ns,
            registry=r,
        )
        self._load = Histogram(
            "worker_load_seconds",
            "Seconds a worker reported for copying one bucket.",
            ("coordinator", "worker"),
            namespace=ns,
            registry=r,
            buckets=LOAD_BUCKETS,
        )
        self._collector = _StateCollector(self)
        r.register(self._collector)
        self._closed = False

    def __repr__(self) -> str:
        return f"<RefitMetrics namespace={self._namespace!r} attached={sorted(self._attached)}>"

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the metrics are registered on."""
        return self._registry

    def attach(self, coordinator: RefitCoordinator, name: str = "default") -> Callable[[], None]:
        """Record ``coordinator``'s pushes under ``coordinator=name``; returns the detacher.

        ``name`` must be a bounded, stable name (one per coordinator of the process).
        Raises :class:`ValueError` if a coordinator is attached under ``name``, or if
        this :class:`RefitMetrics` was closed.
        """
        with self._lock:
            if self._closed:
                raise ValueError("these RefitMetrics are closed")
            if name in self._attached:
                raise ValueError(f"a coordinator is already attached as {name!r}")
            att = _Attachment(
                name=name,
                coordinator=coordinator,
                duration=self._duration.labels(name),
                pushed_bytes=self._bytes.labels(name),
                buckets=self._buckets.labels(name),
                ok=self._pushes.labels(name, "ok"),  # present from the start: rate() works
                outcomes={"ok"},
            )
            self._attached[name] = att
        att.unsubscribe = coordinator.subscribe(self._listener(att))

        def detach() -> None:
            self.detach(name, _only=att)

        return detach

    def detach(self, name: str = "default", *, _only: _Attachment | None = None) -> None:
        """Stop recording the coordinator attached as ``name`` and drop its series.

        Idempotent: detaching a name that is not attached does nothing.
        """
        with self._lock:
            att = self._attached.get(name)
            if att is None or (_only is not None and att is not _only):
                return
            del self._attached[name]
        att.unsubscribe()
        self._duration.remove(name)
        self._bytes.remove(name)
        self._buckets.remove(name)
        for outcome in att.outcomes:
            self._pushes.remove(name, outcome)
        for worker in att.loads:
            self._load.remove(name, worker)

    def close(self) -> None:
        """Detach every coordinator and unregister the metrics from the registry."""
        for name in list(self._attached):
            self.detach(name)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for collector in (
            self._pushes,
            self._duration,
            self._bytes,
            self._buckets,
            self._load,
            self._collector,
        ):
            self._registry.unregister(collector)

    def outcome(self, cause: str) -> str:
        """The ``outcome`` label of a push that ended with ``cause`` (see the module's doc)."""
        if cause in self._errors or cause in OUTCOMES:
            return cause
        self._errors = _error_names()  # an error class defined since (a lazy import)
        return cause if cause in self._errors else "other"

    def _listener(self, att: _Attachment) -> Callable[[PushEvent], None]:
        load, loads, name, pushes = self._load, att.loads, att.name, self._pushes

        def acked(event: BucketAcked) -> None:
            child = loads.get(event.worker)
            if child is None:
                child = loads[event.worker] = load.labels(name, event.worker)
            child.observe(event.seconds)

        def packed(event: BucketPacked) -> None:
            att.pushed_bytes.inc(event.bytes)
            att.buckets.inc()

        def begun(event: PushBegun) -> None:
            for gone in set(loads) - set(event.workers):  # removed since the last push
                del loads[gone]
                load.remove(name, gone)

        def committed(event: PushCommitted) -> None:
            att.duration.observe(event.seconds)
            att.ok.inc()

        def aborted(event: PushAborted) -> None:
            outcome = self.outcome(event.cause)
            att.outcomes.add(outcome)
            pushes.labels(name, outcome).inc()

        handlers: dict[type[PushEvent], Callable[[Any], None]] = {
            BucketAcked: acked,
            BucketPacked: packed,
            PushBegun: begun,
            PushCommitted: committed,
            PushAborted: aborted,
        }
        get = handlers.get

        def on_event(event: PushEvent) -> None:
            handler = get(type(event))
            if handler is not None:
                handler(event)

        return on_event

    def _snapshot(self) -> tuple[_Attachment, ...]:
        with self._lock:
            return tuple(self._attached.values())


def _retrying(read: Callable[[], T]) -> T | None:
    """``read()``, retried if it raced the event loop changing what it iterates."""
    for _ in range(_SCRAPE_TRIES):
        try:
            return read()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return None


class _StateCollector(Collector):
    """The gauges read from the attached coordinators when scraped."""

    def __init__(self, metrics: RefitMetrics) -> None:
        self._metrics = metrics

    def _families(self) -> dict[str, GaugeMetricFamily]:
        ns = self._metrics._namespace
        one = ["coordinator"]
        per_worker = ["coordinator", "worker"]
        specs = (
            ("weight_version", "The last version every worker holds completely.", one),
            (
                "worker_weight_version",
                "The complete version each worker holds (-1: none).",
                per_worker,
            ),
            ("budget_bytes", "Staging budget the slots can use.", one),
            ("budget_in_use_bytes", "Staging budget bytes in use now.", one),
            ("budget_peak_bytes", "Most staging budget bytes ever in use at once.", one),
            ("quarantined_slots", "Slots held back: a worker may still read them.", one),
        )
        return {
            key: GaugeMetricFamily(f"{ns}_{key}", doc, labels=labels) for key, doc, labels in specs
        }

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return list(self._families().values())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        for att in self._metrics._snapshot():
            refit, name = att.coordinator, att.name
            stats = refit.statistics()
            families["budget_bytes"].add_metric([name], stats.capacity)
            families["budget_in_use_bytes"].add_metric([name], stats.in_use)
            families["budget_peak_bytes"].add_metric([name], stats.peak)
            quarantined = _retrying(refit.quarantined_slots)
            if quarantined is not None:
                families["quarantined_slots"].add_metric([name], len(quarantined))
            version = refit.version
            if version is not None:
                families["weight_version"].add_metric([name], version)
            versions = _retrying(refit.versions)
            for worker, held in (versions or {}).items():
                families["worker_weight_version"].add_metric(
                    [name, worker], -1 if held is None else held
                )
        yield from families.values()


class MetricsServer:
    """The HTTP server of :func:`serve_metrics`; close it (or use ``with``) to stop it.

    Resource handling: :meth:`close` shuts the server down, closes its socket and joins
    its thread (idempotent).
    """

    def __init__(self, server: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._server = server
        self._thread = thread
        self.host = host
        self.port: int = server.server_port

    def __repr__(self) -> str:
        state = "serving" if self._thread.is_alive() else "closed"
        return f"<MetricsServer {state} {self.url}>"

    @property
    def url(self) -> str:
        """Where the metrics are: ``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    @property
    def thread(self) -> threading.Thread:
        """The thread serving requests (a daemon)."""
        return self._thread

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, close the socket, wait at most ``timeout`` s for the thread."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def serve_metrics(
    port: int, host: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve ``registry`` (default prometheus_client's ``REGISTRY``) on ``host:port``.

    ``port=0`` picks a free port (``.port`` of the result says which). Serves from a
    daemon thread until the returned :class:`MetricsServer` is closed.

    Error handling: :class:`OSError` if the address cannot be bound.
    """
    server, thread = _start_http_server(
        port, addr=host, registry=registry if registry is not None else REGISTRY
    )
    return MetricsServer(server, thread, host)
