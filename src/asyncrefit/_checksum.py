"""The integrity checksum of a bucket: CRC-32 over its tensors' bytes, in order."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, one after the other (alignment padding excluded).

    The trainer computes it over what it packed, a worker over what it copied into its
    own parameters; equal values mean the worker holds the trainer's bytes. CRC-32
    catches every burst error up to 32 bits and nearly all others; it is not a defence
    against a deliberate forgery. Runs at ~3.5 GB/s per core here (zlib releases the
    GIL); CUDA tensors are copied to the host first.
    """
    import torch

    crc = 0
    for tensor in tensors:
        flat = tensor.detach()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        flat = flat.contiguous().reshape(-1).view(torch.uint8)
        if flat.numel():
            crc = zlib.crc32(flat.numpy().data, crc)
    return crc
