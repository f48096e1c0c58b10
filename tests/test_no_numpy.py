"""The core install works without numpy: checksums, digests and a verified push.

numpy is not a dependency of asyncrefit, and torch's wheel does not bring it; the test
environment has it only because Ray and vLLM pull it in. These tests run the library in
a subprocess, and in that subprocess's worker processes, with ``import numpy`` failing
as it does where numpy is not installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from asyncrefit import checksum
from asyncrefit._checksum import tensor_bytes
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.transport.shm import list_segments

# A sitecustomize on PYTHONPATH runs at the start of every Python process that inherits
# the environment: the subprocess and the worker processes it spawns.
SITECUSTOMIZE = """\
import sys


class NoNumpy:
    \"\"\"Finds no numpy: `import numpy` fails as where numpy is not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoNumpy())
"""

JOB = '''\
"""Checksums, digests and a verified push into 2 worker processes, without numpy."""
import json
import sys

import anyio
import torch

from asyncrefit import RefitCoordinator, checksum
from asyncrefit._worker._receiver import tensor_digest
from asyncrefit.local import spawn_local_workers


def numpy_blocked() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return True
    return False


def samples() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    return {
        "float32": base,
        "transposed": base.t(),
        "slice": base[1:4, ::2],
        "bfloat16": base.to(torch.bfloat16),
        "float8": base.to(torch.float8_e4m3fn),
        "int64": torch.arange(7),
        "bool": base > 0,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


def make_model() -> torch.nn.Module:  # called in the worker processes too
    if not numpy_blocked():
        raise RuntimeError("numpy is importable in a worker process")
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(33, 7))
    m.b = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
    m.empty = torch.nn.Parameter(torch.empty(0, 4))
    m.c = torch.nn.Parameter(torch.randn(5, 5).to(torch.float16))
    return m


async def push() -> bool:
    model = make_model()
    async with spawn_local_workers(make_model, 2) as workers:
        async with RefitCoordinator(
            trainer=model, workers=workers, budget_bytes=8 * 1024, verify=True
        ) as refit:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            await refit.push(1)
            want = {n: tensor_digest(p) for n, p in model.named_parameters()}
            got = [await w.parameter_digests() for w in workers]
            versions = [await w.weight_version() for w in workers]
    return all(g == want for g in got) and versions == [1, 1]


if __name__ == "__main__":  # worker processes are spawned
    tensors = samples()
    result = {
        "numpy_blocked": numpy_blocked(),
        "checksums": {k: checksum([t]) for k, t in tensors.items()},
        "checksum_all": checksum(tensors.values()),
        "digests": {k: tensor_digest(t) for k, t in tensors.items()},
        "verified_push": anyio.run(push),
    }
    json.dump(result, sys.stdout)
'''


def _samples() -> dict[str, torch.Tensor]:
    """The job's ``samples()``, here: the values the subprocess must reproduce."""
    namespace: dict[str, object] = {"__name__": "job"}
    exec(compile(JOB, "job.py", "exec"), namespace)
    samples = namespace["samples"]
    assert callable(samples)
    result: dict[str, torch.Tensor] = samples()
    return result


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_checksum_digest_and_verified_push_without_numpy(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [sys.executable, str(job)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=130)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    leftover = [s for s in list_segments() if s.startswith(f"asyncrefit-{proc.pid}-")]
    assert not leftover, f"the job left shared memory behind: {leftover}"
    assert proc.returncode == 0, err[-4000:]
    result = json.loads(out)

    assert result["numpy_blocked"] is True
    samples = _samples()
    assert result["checksums"] == {k: checksum([t]) for k, t in samples.items()}
    assert result["checksum_all"] == checksum(samples.values())
    assert result["digests"] == {k: tensor_digest(t) for k, t in samples.items()}
    assert result["verified_push"] is True


# Today's values, computed through numpy as asyncrefit 0.1.0 did: the torch-only code
# must give the same CRCs and digests, so checksums and digests stay comparable.


def _numpy_checksum(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if flat.numel():
            crc = zlib.crc32(flat.numpy().data, crc)
    return crc


def _numpy_digest(t: torch.Tensor) -> str:
    from asyncrefit.transport._base import dtype_name

    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype_name(t.dtype)}{tuple(t.shape)}".encode())
    h.update(flat.numpy().data)
    return h.hexdigest()


def test_same_checksums_and_digests_as_through_numpy() -> None:
    pytest.importorskip("numpy")
    samples = _samples()
    samples["grad"] = torch.nn.Parameter(torch.randn(4, 4))
    for name, t in samples.items():
        assert checksum([t]) == _numpy_checksum([t]), name
        assert tensor_digest(t) == _numpy_digest(t), name
    everything = list(samples.values())
    assert checksum(everything) == _numpy_checksum(everything)


def test_tensor_bytes_is_the_tensors_bytes_and_released_after() -> None:
    t = torch.arange(12, dtype=torch.int32).view(3, 4)
    with tensor_bytes(t) as data:
        assert data.readonly and data.format == "B" and data.nbytes == 48
        assert bytes(data) == struct.pack("=12i", *range(12))
    with pytest.raises(ValueError):
        bytes(data)  # released: no access to memory the tensor may no longer own
    with tensor_bytes(t.t()) as data:  # non-contiguous: its elements in row-major order
        assert bytes(data) == struct.pack("=12i", *t.t().reshape(-1).tolist())
    with tensor_bytes(torch.empty(0)) as data:
        assert data.nbytes == 0
    conj = torch.tensor([1 + 2j], dtype=torch.complex64).conj()  # the values, not the memory
    with tensor_bytes(conj) as data:
        assert bytes(data) == struct.pack("=2f", 1.0, -2.0)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_suite_collects_and_runs_without_numpy(tmp_path: Path) -> None:
    """With ``.[dev]`` alone there is no numpy, and torch warns at import: under
    ``filterwarnings = error`` that warning must not stop the suite from collecting."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_plan.py",
            "tests/test_ledger.py",
        ],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=130,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
