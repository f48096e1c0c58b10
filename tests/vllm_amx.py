"""A vLLM worker extension for bfloat16 CPU engines: asyncrefit's, AMX permission asked first.

On x86 Linux a process must ask the kernel (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) before
it may use AMX tiles. vLLM 0.32's CPU attention picks its AMX kernel for bfloat16
wherever the CPU advertises AMX, but its worker never asks: on our CPU machines the
worker dies of SIGILL at the first request (oneDNN asks on its own, vLLM's attention
kernel does not). vLLM imports the module of ``worker_extension_cls`` into every
worker before it builds the model, so asking at this module's import is in time.
Nothing changes on CPUs without AMX (the request is refused, and vLLM does not pick
the AMX kernel there).
"""

from __future__ import annotations

from asyncrefit.vllm._amx import request_amx
from asyncrefit.vllm.worker import RefitWorkerExtension

request_amx()  # asyncrefit's worker module asks too; this module predates it


class AmxRefitWorkerExtension(RefitWorkerExtension):
    """asyncrefit's worker extension, loaded from a module that asked for AMX."""

    def test_parameter_digests(self) -> dict[str, str]:
        """A digest of every parameter's bytes (the engine's own, as processed), by name."""
        import hashlib

        import torch

        model = self._asyncrefit_engine().model
        found = {}
        for name, param in model.named_parameters():
            raw = param.detach().contiguous().view(-1).view(torch.uint8).cpu()
            found[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        return found


#: ``worker_extension_cls`` for a bfloat16 CPU engine (on a GPU: the digests).
EXTENSION = f"{__name__}.{AmxRefitWorkerExtension.__name__}"
