"""Ask the kernel for AMX in a vLLM CPU worker, before vLLM's kernels use it.

On x86 Linux a process must ask (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``) before
it may use AMX tiles. vLLM 0.32's CPU build picks AMX kernels for bfloat16 attention
and for FP8 block-scaled layers wherever the CPU advertises AMX, but its worker never
asks: oneDNN asks for its own kernels, and whether vLLM's run first decides whether the
worker dies of SIGILL at its first request (measured: 3 of 4 starts of a bfloat16 FP8
engine here). vLLM imports asyncrefit's worker extension into every worker before it
builds the model, so :mod:`asyncrefit.vllm.worker` asks at its import. Asking is
harmless: the permission is the one such kernels need anyway, and on a CPU without
AMX (or not x86 Linux) the request is refused or not made, and vLLM does not pick
AMX kernels there.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """Ask the kernel to let this process use AMX tiles; whether it agreed."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False
