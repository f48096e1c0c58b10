"""The demo: train a small transformer, push after every step, verify bitwise."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

import asyncrefit.tools.demo
from asyncrefit.cli import main as cli_main
from asyncrefit.local import LocalWorker
from asyncrefit.tools.demo import run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def test_demo_pushes_verify() -> None:
    result = await run_demo(workers=2, steps=2, progress=False)

    assert result["verified"] is True
    assert result["workers"] == 2
    assert result["parameters"] > 1_000_000
    pushes = result["pushes"]
    assert [p["version"] for p in pushes] == [1, 2]
    for push in pushes:
        assert push["verified"] is True
        assert push["logits_changed"] is True
        assert push["buckets"] > 1
        per_worker = push["handle_bytes_per_worker"]
        assert len(per_worker) == 2
        assert len(set(per_worker.values())) == 1  # filtered: the same for every worker
        assert all(all(c.values()) for c in push["checks"].values())


def test_demo_cli_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrefit.cli", "demo", "--json", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout holds exactly one JSON object
    assert result["verified"] is True
    assert result["steps"] == 1
    assert [p["version"] for p in result["pushes"]] == [1]


def _one_json_object(stdout: str) -> dict[str, object]:
    """The one JSON object that is all of ``stdout`` (one line), or fail."""
    lines = stdout.splitlines()
    assert len(lines) == 1, f"stdout is not one JSON line: {stdout!r}"
    result = json.loads(lines[0])
    assert isinstance(result, dict)
    return result


@asynccontextmanager
async def _no_workers(*args: object, **kwargs: object) -> AsyncIterator[list[LocalWorker]]:
    raise OSError("cannot start worker processes")
    yield []  # pragma: no cover - never reached


@pytest.mark.parametrize("where", ["run", "group", "start"])
def test_demo_json_reports_any_failure_as_json(
    where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if where in ("run", "group"):

        async def broken(*args: object, **kwargs: object) -> dict[str, object]:
            if where == "group":  # as a task group raises it: told as its one exception
                raise ExceptionGroup("unhandled errors in a TaskGroup", [RuntimeError("boom")])
            raise RuntimeError("boom")

        monkeypatch.setattr(asyncrefit.tools.demo, "run_demo", broken)
        want = "RuntimeError: boom"
    else:  # a real run_demo whose workers cannot start
        monkeypatch.setattr(asyncrefit.tools.demo, "spawn_local_workers", _no_workers)
        want = "OSError: cannot start worker processes"

    assert cli_main(["demo", "--json", "--steps", "1"]) == 1
    out, err = capsys.readouterr()
    assert _one_json_object(out) == {"verified": False, "error": want}
    assert "Traceback" in err and want in err  # the details go to stderr


def test_demo_json_bad_arguments_is_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["demo", "--json", "--workers", "0"]) == 2
    out, _ = capsys.readouterr()
    result = _one_json_object(out)
    assert result["verified"] is False and "--workers" in str(result["error"])


# Run as a separate process: the demo's own modules fail to import (as with a broken
# install), and `asyncrefit demo --json` must still print its JSON object.
BROKEN_IMPORT = """\
import sys
sys.modules["asyncrefit.tools.demo_model"] = None  # importing it raises ModuleNotFoundError
from asyncrefit.cli import main
sys.exit(main(["demo", "--json"]))
"""


def test_demo_cli_json_when_the_demo_cannot_import() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BROKEN_IMPORT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    result = _one_json_object(proc.stdout)
    assert result["verified"] is False
    assert str(result["error"]).startswith("ModuleNotFoundError: "), result
    assert "asyncrefit.tools.demo_model" in str(result["error"])
    assert "Traceback" not in proc.stdout and "Traceback" in proc.stderr
