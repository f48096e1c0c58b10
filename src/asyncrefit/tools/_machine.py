"""The one description of the machine a tool ran on, and what it measures of processes.

:func:`machine_info` describes the machine (CPU, memory, load, torch and Python, and
with ``gpu=True`` the first CUDA device and its driver) for every benchmark's JSON;
:func:`machine_line` says it in one line. :func:`rss_bytes` and
:func:`reset_peak_rss` read and reset a process's resident memory (Linux),
:func:`free_port` finds a TCP port for a process group's store.

Resource handling: every file of ``/proc`` is closed before a function returns;
:func:`free_port` closes its socket (the port may be taken again by then).

Error handling: a fact that cannot be read is ``None`` or ``"unknown"`` in
:func:`machine_info`, never an exception; ``nvidia-smi`` missing or hanging (30 s)
leaves the driver ``"unknown"``. :func:`rss_bytes` raises :class:`OSError` for a
process that is gone.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
from typing import Any

GIB = 2**30


def _cpu_model() -> str:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return cpu


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def _gpu_info() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    driver = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / GIB, 1),
        "driver": driver,
        "cuda": torch.version.cuda,
    }


def machine_info(*, gpu: bool = False) -> dict[str, Any]:
    """CPU model, cores, memory, load, torch and Python versions of this machine.

    Keys: ``cpu``, ``cores``, ``usable_cores`` (this process's affinity),
    ``memory_gib``, ``loadavg``, ``torch``, ``torch_threads``, ``python``,
    ``platform``; with ``gpu`` also ``gpu``, ``gpu_memory_gib``, ``driver`` and
    ``cuda`` of CUDA device 0 (which must exist).
    """
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": _memory_gib(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if gpu:
        info.update(_gpu_info())
    return info


def machine_line(m: dict[str, Any]) -> str:
    """One line describing a :func:`machine_info` result (with the load when it ran)."""
    line = (
        f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
        f"{m['memory_gib']} GiB, load {m['loadavg']}; torch {m['torch']} "
        f"({m['torch_threads']} threads), Python {m['python']}"
    )
    if "gpu" in m:
        line += f"; {m['gpu']} ({m['gpu_memory_gib']} GiB), driver {m['driver']}, CUDA {m['cuda']}"
    return line


def rss_bytes(pid: int | str = "self") -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of a process in bytes: resident now, and its peak (Linux).

    Both are 0 where the kernel does not say (a zombie, a kernel thread).
    """
    values = {"VmRSS": 0, "VmHWM": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current resident size (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
