"""Prometheus metrics: scraped over real HTTP while real pushes run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest
import torch

from asyncrefit import (
    PushError,
    RefitCoordinator,
    RefitReport,
    VersionError,
    WorkerDiedError,
    WorkerTimeoutError,
    cpu_device,
)
from asyncrefit.local._client import spawn_with_faults
from asyncrefit.local._faults import WorkerFaults
from asyncrefit.tools.demo import run_demo

from .fakes import FakeWorker, Faults
from .helpers import step
from .models import make_mlp

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from asyncrefit.metrics import MetricsServer, RefitMetrics, serve_metrics  # noqa: E402

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.timeout(60)

KIB = 1024
LABELS = {"coordinator", "outcome", "worker", "le"}
PORT_0 = ("--metrics-port", "0")
FEW = ("--dispatches", "20")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample the server at ``url`` serves, by name and labels."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for n, labels in samples if n == name]


async def ascrape(url: str) -> Samples:
    return await anyio.to_thread.run_sync(scrape, url)


@pytest.fixture
def served() -> Iterator[tuple[RefitMetrics, MetricsServer]]:
    """Metrics on their own registry, served on a free port of 127.0.0.1."""
    registry: CollectorRegistry = prometheus_client.CollectorRegistry()
    metrics = RefitMetrics(registry)
    server = serve_metrics(0, registry=registry)
    try:
        yield metrics, server
    finally:
        server.close()
        metrics.close()
    assert not server.thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        scrape(server.url)  # the socket is closed


def no_version_labels(samples: Samples) -> None:
    for name, labels in samples:
        assert {k for k, _ in labels} <= LABELS, name
        assert not any(v.isdigit() for k, v in labels if k != "le"), (name, labels)


# --- zero cost when unused ----------------------------------------------------------------


def test_importing_asyncrefit_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, asyncrefit, asyncrefit.events, asyncrefit.cli, asyncrefit.tools.demo\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
        "assert 'asyncrefit.metrics' not in sys.modules, 'imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr


def test_without_prometheus_client_the_import_error_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None  # as if not installed\n"
        "try:\n"
        "    import asyncrefit.metrics\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'asyncrefit[metrics]'" in proc.stdout


def fakes(model: torch.nn.Module, n: int = 2) -> list[FakeWorker]:
    return [FakeWorker.like(f"w{i}", cpu_device(i), model) for i in range(n)]


async def test_no_listener_unless_metrics_are_attached() -> None:
    model = make_mlp()
    metrics = RefitMetrics(prometheus_client.CollectorRegistry())
    async with RefitCoordinator(
        trainer=model, workers=fakes(model), budget_bytes=64 * KIB
    ) as refit:
        assert not bool(refit._events)
        await refit.push(1)
        detach = metrics.attach(refit)
        assert bool(refit._events)
        detach()
        detach()  # idempotent
        assert not bool(refit._events)
        await refit.push(2)
    metrics.close()


# --- real pushes into local worker processes ----------------------------------------------


async def test_counters_histograms_and_gauges_follow_real_pushes(
    served: tuple[RefitMetrics, MetricsServer],
) -> None:
    metrics, server = served
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(load_delay=0.2)}  # a window to scrape mid-push
    async with (
        spawn_with_faults(make_mlp, 2, faults=faults) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit,
    ):
        metrics.attach(refit, "policy")
        c = {"coordinator": "policy"}
        before = await ascrape(server.url)
        assert value(before, "asyncrefit_pushes_total", **c, outcome="ok") == 0
        assert value(before, "asyncrefit_buckets_total", **c) == 0
        assert value(before, "asyncrefit_budget_in_use_bytes", **c) == 0
        capacity = value(before, "asyncrefit_budget_bytes", **c)
        assert capacity == refit.statistics().capacity > 0
        for w in workers:
            assert value(before, "asyncrefit_worker_weight_version", **c, worker=w.name) == -1
        assert value(before, "asyncrefit_weight_version", **c) is None

        reports: list[RefitReport] = []
        for version in (1, 2):
            step(model, version)
            async with anyio.create_task_group() as tg:
                pushed: list[RefitReport] = []

                async def push(v: int = version, out: list[RefitReport] = pushed) -> None:
                    out.append(await refit.push(v))

                tg.start_soon(push)
                # Mid-push: buckets move, the budget is in use, the push is not counted.
                with anyio.fail_after(20):
                    while True:
                        mid = await ascrape(server.url)
                        moved = value(mid, "asyncrefit_buckets_total", **c)
                        assert moved is not None
                        in_use = value(mid, "asyncrefit_budget_in_use_bytes", **c)
                        assert in_use is not None and in_use <= capacity
                        if not pushed and moved > sum(r.buckets for r in reports) and in_use:
                            break
                        assert not pushed, "the push ended before a scrape saw it in flight"
                        await anyio.sleep(0.02)
                assert value(mid, "asyncrefit_pushes_total", **c, outcome="ok") == version - 1
            (report,) = pushed
            reports.append(report)

            after = await ascrape(server.url)
            no_version_labels(after)
            buckets = sum(r.buckets for r in reports)
            assert value(after, "asyncrefit_pushes_total", **c, outcome="ok") == version
            assert value(after, "asyncrefit_buckets_total", **c) == buckets
            assert value(after, "asyncrefit_pushed_bytes_total", **c) == sum(
                r.bytes for r in reports
            )
            assert value(after, "asyncrefit_push_duration_seconds_count", **c) == version
            total = value(after, "asyncrefit_push_duration_seconds_sum", **c)
            assert total is not None
            assert 0 < total <= sum(r.seconds for r in reports) + 1e-6
            assert value(after, "asyncrefit_push_duration_seconds_bucket", **c, le="+Inf") == (
                version
            )
            for w in workers:
                n = value(after, "asyncrefit_worker_load_seconds_count", **c, worker=w.name)
                assert n == buckets
                assert value(after, "asyncrefit_worker_weight_version", **c, worker=w.name) == (
                    version
                )
                copied = value(after, "asyncrefit_worker_load_seconds_sum", **c, worker=w.name)
                assert copied is not None and copied > 0  # its copies (not its load_delay)
            assert value(after, "asyncrefit_weight_version", **c) == version
            assert value(after, "asyncrefit_budget_in_use_bytes", **c) == 0
            assert value(after, "asyncrefit_budget_peak_bytes", **c) == report.peak_budget_bytes
            assert value(after, "asyncrefit_quarantined_slots", **c) == 0
    assert series(await ascrape(server.url), "asyncrefit_pushes_total") == [
        {"coordinator": "policy", "outcome": "ok"}  # still attached: a closed coordinator
    ]


async def test_a_killed_worker_counts_as_worker_died_and_its_series_go(
    served: tuple[RefitMetrics, MetricsServer],
) -> None:
    metrics, server = served
    model = make_mlp()
    faults = {"worker-1": WorkerFaults(kill_at_bucket=1)}
    async with (
        spawn_with_faults(make_mlp, 2, faults=faults) as workers,
        RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit,
    ):
        metrics.attach(refit)
        c = {"coordinator": "default"}
        with pytest.raises(PushError) as info:
            await refit.push(1)
        assert isinstance(info.value.cause, WorkerDiedError)

        failed = await ascrape(server.url)
        no_version_labels(failed)
        assert value(failed, "asyncrefit_pushes_total", **c, outcome="WorkerDiedError") == 1
        assert value(failed, "asyncrefit_pushes_total", **c, outcome="ok") == 0
        assert value(failed, "asyncrefit_push_duration_seconds_count", **c) == 0
        for w in workers:  # neither holds a complete version
            assert value(failed, "asyncrefit_worker_weight_version", **c, worker=w.name) == -1
        assert value(failed, "asyncrefit_budget_in_use_bytes", **c) == 0
        assert value(failed, "asyncrefit_quarantined_slots", **c) == 0
        assert {"coordinator": "default", "worker": "worker-1"} in series(
            failed, "asyncrefit_worker_load_seconds_count"
        )  # it acked bucket 0 before it died

        await refit.remove_worker("worker-1")
        removed = await ascrape(server.url)
        assert series(removed, "asyncrefit_worker_weight_version") == [
            {"coordinator": "default", "worker": "worker-0"}
        ]
        await refit.push(2)
        pushed = await ascrape(server.url)
        assert series(pushed, "asyncrefit_worker_load_seconds_count") == [
            {"coordinator": "default", "worker": "worker-0"}  # dropped at the next push
        ]
        assert value(pushed, "asyncrefit_pushes_total", **c, outcome="ok") == 1
        assert value(pushed, "asyncrefit_pushes_total", **c, outcome="WorkerDiedError") == 1
        assert value(pushed, "asyncrefit_worker_weight_version", **c, worker="worker-0") == 2


# --- in-process workers: quarantine, outcomes, membership, several coordinators -----------


async def test_a_timed_out_reader_shows_as_a_quarantined_slot(
    served: tuple[RefitMetrics, MetricsServer],
) -> None:
    metrics, server = served
    model = make_mlp()
    workers = fakes(model)
    async with RefitCoordinator(
        trainer=model, workers=workers, budget_bytes=64 * KIB, timeout=0.3, cleanup_timeout=0.3
    ) as refit:
        metrics.attach(refit)
        workers[1].faults = Faults(read_late_at=0, read_late=1.5)
        with pytest.raises(PushError) as info:
            await refit.push(1)
        assert isinstance(info.value.cause, WorkerTimeoutError)
        got = await ascrape(server.url)
        c = {"coordinator": "default"}
        assert value(got, "asyncrefit_pushes_total", **c, outcome="WorkerTimeoutError") == 1
        assert value(got, "asyncrefit_quarantined_slots", **c) == len(refit.quarantined_slots())
        assert value(got, "asyncrefit_quarantined_slots", **c) == 1
        await anyio.sleep(1.5)  # the late reader finishes; it confirms at the next try
        await refit.remove_worker("w1")
        got = await ascrape(server.url)
        assert value(got, "asyncrefit_quarantined_slots", **c) == 0


def test_outcomes_are_a_bounded_set() -> None:
    metrics = RefitMetrics(prometheus_client.CollectorRegistry())
    try:
        for known in ("WorkerDiedError", "VersionError", "SourceTimeoutError", "cancelled"):
            assert metrics.outcome(known) == known
        assert metrics.outcome("closed") == "closed"
        for unknown in ("ValueError", "KeyboardInterrupt", "12", "MyLibraryError"):
            assert metrics.outcome(unknown) == "other"
    finally:
        metrics.close()


async def test_version_error_and_cancellation_are_outcomes(
    served: tuple[RefitMetrics, MetricsServer],
) -> None:
    metrics, server = served
    model = make_mlp()
    workers = fakes(model)
    async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=64 * KIB) as refit:
        metrics.attach(refit)
        await refit.push(3)
        with pytest.raises(VersionError):
            await refit.push(3)  # not newer
        workers[0].faults = Faults(delay=5.0)
        with anyio.move_on_after(0.3):
            await refit.push(4)
        got = await ascrape(server.url)
    c = {"coordinator": "default"}
    assert value(got, "asyncrefit_pushes_total", **c, outcome="ok") == 1
    assert value(got, "asyncrefit_pushes_total", **c, outcome="VersionError") == 1
    assert value(got, "asyncrefit_pushes_total", **c, outcome="cancelled") == 1
    no_version_labels(got)


async def test_many_added_and_removed_workers_do_not_grow_the_series(
    served: tuple[RefitMetrics, MetricsServer],
) -> None:
    metrics, server = served
    model = make_mlp()
    async with RefitCoordinator(
        trainer=model, workers=fakes(model, 1), budget_bytes=64 * KIB
    ) as refit:
        metrics.attach(refit)
        for i in range(1, 21):
            await refit.add_worker(FakeWorker.like(f"guest-{i}", cpu_device(1), model))
            await refit.push(i)
            await refit.remove_worker(f"guest-{i}")
        got = await ascrape(server.url)
    workers = {s["worker"] for s in series(got, "asyncrefit_worker_load_seconds_count")}
    assert workers <= {"w0", "guest-20"}  # the last push's workers only
    assert {s["worker"] for s in series(got, "asyncrefit_worker_weight_version")} == {"w0"}
    assert value(got, "asyncrefit_pushes_total", coordinator="default", outcome="ok") == 20


async def test_several_coordinators_by_name(served: tuple[RefitMetrics, MetricsServer]) -> None:
    metrics, server = served
    model = make_mlp()
    async with (
        RefitCoordinator(trainer=model, workers=fakes(model), budget_bytes=64 * KIB) as a,
        RefitCoordinator(trainer=model, workers=fakes(model), budget_bytes=128 * KIB) as b,
    ):
        detach_a = metrics.attach(a, "actor")
        metrics.attach(b, "reference")
        with pytest.raises(ValueError, match="already attached"):
            metrics.attach(b, "actor")
        await a.push(1)
        await b.push(1)
        await b.push(2)
        got = await ascrape(server.url)
        ok = "asyncrefit_pushes_total"
        assert value(got, ok, coordinator="actor", outcome="ok") == 1
        assert value(got, ok, coordinator="reference", outcome="ok") == 2
        assert value(got, "asyncrefit_budget_bytes", coordinator="reference") == (
            b.statistics().capacity
        )
        detach_a()
        got = await ascrape(server.url)
        assert {s["coordinator"] for s in series(got, ok)} == {"reference"}
        assert {s["coordinator"] for s in series(got, "asyncrefit_budget_bytes")} == {"reference"}
        assert not bool(a._events) and bool(b._events)


# --- the demo -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_demo_metrics_between_its_pushes(served: tuple[RefitMetrics, MetricsServer]) -> None:
    metrics, server = served
    seen: list[int] = []

    async def after_push(version: int) -> None:
        got = await ascrape(server.url)  # over HTTP, while the demo's coordinator is open
        c = {"coordinator": "demo"}
        assert value(got, "asyncrefit_pushes_total", **c, outcome="ok") == version
        assert value(got, "asyncrefit_weight_version", **c) == version
        for w in ("worker-0", "worker-1"):
            assert value(got, "asyncrefit_worker_weight_version", **c, worker=w) == version
        buckets = value(got, "asyncrefit_buckets_total", **c)
        assert buckets is not None and buckets >= 2 * version
        seen.append(version)

    result = await run_demo(workers=2, steps=2, metrics=metrics, after_push=after_push)
    assert result["verified"] is True
    assert seen == [1, 2]
    got = await ascrape(server.url)
    assert series(got, "asyncrefit_pushes_total") == []  # detached when the demo ended


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_cli_serves_metrics_while_it_runs() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrefit.cli", "demo", "--json", "--steps", "3", *PORT_0],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        prefix = "asyncrefit demo: metrics on "
        assert line.startswith(prefix), line
        url = line[len(prefix) :].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        pushes = 0.0
        deadline = time.monotonic() + 100
        while pushes < 1 and proc.poll() is None and time.monotonic() < deadline:
            try:
                got = scrape(url)
            except urllib.error.URLError:
                break  # the demo ended
            pushes = value(got, "asyncrefit_pushes_total", coordinator="demo", outcome="ok") or 0
            time.sleep(0.02)
        assert pushes >= 1, "no scrape saw a push while the demo ran"
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert json.loads(out)["verified"] is True
    with pytest.raises(urllib.error.URLError):
        scrape(url)  # the server stopped with the demo


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_observe_bench_runs_every_listener_and_verifies() -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "observe_bench.py"
    done = subprocess.run(
        [sys.executable, str(script), "--size-mib", "4", "--repeats", "2", "--json", *FEW],
        capture_output=True,
        text=True,
        timeout=160,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["verified"] is True
    assert [r["setup"] for r in result["rows"]] == ["none", "callback", "metrics", "stream"]
    # one push's events: begun, a packed per bucket, an ack per bucket and worker, committed
    assert result["events_per_push"] == 2 + result["buckets"] * (1 + result["workers"])
    for row in result["rows"]:
        assert len(row["seconds_all"]) == 2 and row["median_seconds"] > 0
        assert (row["listener_cpu_us_per_push"] > 0) == (row["setup"] != "none")
