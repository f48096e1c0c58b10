"""Trainer sources for layouts that are not the engine's.

:class:`ConvertingSource` packs full, engine-named tensors that a conversion function
makes (from Megatron TP/PP/EP shards, fused ``qkv`` and ``gate_up``), bucket by bucket.
"""

from ._convert import ConvertingSource as ConvertingSource

__all__ = ("ConvertingSource",)
