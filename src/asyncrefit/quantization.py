"""FP8 on the trainer's side: quantize as the trainer packs, as vLLM's FP8 checkpoints are.

An engine started from an FP8 checkpoint with block-wise scales (DeepSeek-V3, Qwen3-FP8:
``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}``)
holds each quantized linear layer's ``weight`` in ``float8_e4m3fn`` and its
``weight_scale_inv`` in ``float32``, one scale per block of 128 x 128 elements, and
loads new weights in that form (vLLM's layerwise reload). A trainer of bf16 or fp32
weights pushes into it with ``LocalTrainer(model, quantization=Fp8Blocks())``: each
targeted weight is quantized as its bucket is packed (half the bytes of bf16), with
:func:`fp8_block_quantize`, which gives the bytes and scales vLLM's own quantizer
(``per_block_cast_to_fp8``) gives, so the engine ends with exactly the weights that
loading an FP8 checkpoint of the trainer's weights gives it.

Which weights are quantized: those of the trainer's ``torch.nn.Linear`` modules, less
the ones :class:`Fp8Blocks` ignores (``lm_head`` by default, as vLLM keeps its head
unquantized; a checkpoint's ``ignored_layers`` / ``modules_to_not_convert`` with
:meth:`Fp8Blocks.from_config`), or the names ``targets`` gives. The plan checks the
result against the engine's own parameters before any byte moves: a weight quantized
here that the engine holds unquantized, or the reverse, is a
:class:`~asyncrefit.ParameterMismatchError` naming it (a scale the engine does not have,
or one it has that the trainer does not send).

torch is imported lazily.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["FP8_MAX", "Fp8Blocks", "fp8_block_quantize", "fp8_block_scales", "save_fp8_checkpoint"]

#: The largest finite ``float8_e4m3fn`` value: a block's largest magnitude maps to it.
FP8_MAX = 448.0
#: A block's largest magnitude is taken as at least this (an all-zero block's scale).
_AMAX_FLOOR = 1e-4


def _blocks(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (2-D) viewed as ``[rows, bm, cols, bn]`` blocks: itself when its shape
    is whole blocks, else a zero-padded copy (zeros change no block's largest
    magnitude, and their quantized values are cut off)."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"block quantization takes a 2-D weight, got shape {list(weight.shape)}")
    m, n = weight.shape
    bm, bn = block
    if m % bm == 0 and n % bn == 0 and weight.is_contiguous():
        return weight.view(m // bm, bm, n // bn, bn)
    padded = torch.zeros(
        (math.ceil(m / bm) * bm, math.ceil(n / bn) * bn), dtype=weight.dtype, device=weight.device
    )
    padded[:m, :n] = weight
    return padded.view(-1, bm, padded.size(1) // bn, bn)


def _scales(view: torch.Tensor) -> torch.Tensor:
    """Per block of ``view`` (``[rows, bm, cols, bn]``): max(largest magnitude, 1e-4) / 448
    in float32, shaped ``[rows, 1, cols, 1]``. The largest magnitude is read in one pass
    (the infinity norm, accumulated in float32: exact, as ``abs`` and ``max`` are)."""
    import torch

    amax: torch.Tensor = torch.linalg.vector_norm(
        view, ord=math.inf, dim=(1, 3), keepdim=True, dtype=torch.float32
    ).clamp(_AMAX_FLOOR)
    return amax / FP8_MAX


def fp8_block_scales(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The ``float32`` scale of each block of ``weight``: its largest magnitude (at least
    1e-4) over :data:`FP8_MAX`, of shape ``(ceil(m / bm), ceil(n / bn))``: what a
    checkpoint stores as ``weight_scale_inv`` (a weight is ``fp8 * scale``)."""
    view = _blocks(weight, block)
    return _scales(view).view(view.size(0), view.size(2))


def fp8_block_quantize(
    weight: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D, any float dtype) in ``float8_e4m3fn`` and its block scales.

    The same arithmetic as vLLM's ``per_block_cast_to_fp8(weight, block, use_ue8m0=False)``
    (``vllm/utils/deep_gemm.py``), so the bytes are equal to its bytes on the same
    device (on CUDA, PyTorch divides by a scalar as a multiply by its reciprocal, so a
    GPU's scales, and then some values, may differ from a CPU's in the last bit; each
    pair of values and scales is consistent): zeros pad to whole blocks;
    per block ``scale = max(amax, 1e-4) / 448`` in float32; values
    ``(weight * (1.0 / scale)).to(float8_e4m3fn)``, multiplied in float32 by the
    reciprocal (a division rounds differently) and not clamped (a block's largest value
    maps to 448). It takes fewer passes over memory than vLLM's reference code: the
    largest magnitudes in one read, and the product cast as it is stored, never held in
    float32. ``out``: a contiguous ``float8_e4m3fn`` tensor of ``weight``'s shape to
    write the values into (returned as the first element); by default a new one.
    """
    import torch

    m, n = weight.shape
    view = _blocks(weight, block)
    scale = _scales(view)
    if out is not None and (
        out.dtype != torch.float8_e4m3fn or tuple(out.shape) != (m, n) or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous float8_e4m3fn tensor of shape {[m, n]}, got "
            f"{out.dtype} {list(out.shape)}"
        )
    if view.data_ptr() == weight.data_ptr():  # whole blocks: no padding to cut off
        weights = torch.empty_like(weight, dtype=torch.float8_e4m3fn) if out is None else out
        torch.mul(view, 1.0 / scale, out=weights.view(view.shape))
    else:
        quantized = torch.empty(view.shape, dtype=torch.float8_e4m3fn, device=view.device)
        torch.mul(view, 1.0 / scale, out=quantized)
        cut = quantized.view(view.size(0) * view.size(1), -1)[:m, :n]
        weights = cut.contiguous() if out is None else out.copy_(cut)
    return weights, scale.view(view.size(0), view.size(2))


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    """Push the targeted weights as FP8 with block-wise scales (see the module).

    ``block`` is the checkpoint's ``weight_block_size``. ``targets`` names the engine
    tensors (``"model.layers.0.mlp.down_proj.weight"``) to quantize, or is a predicate
    on such a name; by default (``None``) the weights of the trainer's
    ``torch.nn.Linear`` modules. ``ignore`` holds module-name patterns (``fnmatch``, or a
    name a module's dotted name ends with) left unquantized in any case. Each targeted
    weight ``X.weight`` is pushed as ``float8_e4m3fn`` and followed by
    ``X.weight_scale_inv`` (``float32``, one scale per block).
    """

    block: tuple[int, int] = (128, 128)
    ignore: tuple[str, ...] = ("lm_head",)
    targets: Collection[str] | Callable[[str], bool] | None = None

    def __post_init__(self) -> None:
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"block must be two positive ints, got {self.block!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | Path) -> Fp8Blocks:
        """The quantization of an FP8 checkpoint: its ``config.json`` (a path to it or
        to its directory) or the mapping read from it (``quantization_config`` is read).

        Raises ``ValueError`` unless it is FP8 with a 2-D ``weight_block_size``.
        """
        read: Mapping[str, Any]
        if isinstance(config, str | Path):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            read = json.loads(path.read_text())
        else:
            read = config
        quant = read.get("quantization_config", read)
        if not isinstance(quant, Mapping) or "fp8" not in str(quant.get("quant_method", "")):
            raise ValueError(f"not an FP8 quantization config: {quant!r}")
        block = quant.get("weight_block_size")
        if not isinstance(block, list | tuple) or len(block) != 2:
            raise ValueError(
                f"FP8 without a 2-D weight_block_size ({block!r}): per-tensor FP8 is not "
                "supported by Fp8Blocks"
            )
        ignored = [
            *(quant.get("ignored_layers") or ()),
            *(quant.get("modules_to_not_convert") or ()),
        ]
        return cls(block=(int(block[0]), int(block[1])), ignore=("lm_head", *map(str, ignored)))

    def ignored(self, module: str) -> bool:
        """Whether the module of dotted name ``module`` is left unquantized."""
        return any(
            fnmatch.fnmatchcase(module, pattern)
            or module == pattern
            or module.endswith("." + pattern)
            for pattern in self.ignore
        )

    def chooser(self, linear: Collection[str] | None) -> Callable[[str, tuple[int, ...]], bool]:
        """Whether an engine tensor (name, shape) is quantized, given the engine names
        of the trainer's linear layers' weights (``None``: the trainer is no module,
        and any 2-D ``*.weight`` is a candidate). Only 2-D ``*.weight`` tensors of
        modules not :meth:`ignored` are."""
        targets = self.targets
        chosen: Callable[[str], bool]
        if callable(targets):
            chosen = targets
        elif targets is not None:
            chosen = frozenset(targets).__contains__
        elif linear is not None:
            chosen = frozenset(linear).__contains__
        else:

            def chosen(name: str) -> bool:
                return True

        def quantized(name: str, shape: tuple[int, ...]) -> bool:
            return (
                len(shape) == 2
                and name.endswith(".weight")
                and not self.ignored(name.removesuffix(".weight"))
                and chosen(name)
            )

        return quantized


def save_fp8_checkpoint(
    model: torch.nn.Module, path: str | Path, quantization: Fp8Blocks | None = None
) -> Path:
    """Write a ``transformers`` ``model`` into directory ``path`` as an FP8 checkpoint
    that vLLM serves: the weights ``quantization`` (default :class:`Fp8Blocks`) picks,
    in ``float8_e4m3fn`` with their ``weight_scale_inv``, every other tensor in
    bfloat16, and ``config.json`` with the matching ``quantization_config`` (and
    ``torch_dtype`` bfloat16). The same weights a push with
    ``LocalTrainer(model, quantization=...)`` quantizes, in the same bytes: start an
    engine from it, then push. Needs ``safetensors``. Returns ``path``.
    """
    import torch
    from safetensors.torch import save_file

    quantization = quantization if quantization is not None else Fp8Blocks()
    linear = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    chosen = quantization.chooser(linear)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if chosen(name, tuple(tensor.shape)):
            tensors[name], tensors[f"{name}_scale_inv"] = fp8_block_quantize(
                tensor.detach(), quantization.block
            )
        else:
            tensors[name] = tensor.detach().to(torch.bfloat16).contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config: Any = getattr(model, "config", None)
    if config is None:
        raise ValueError("save_fp8_checkpoint takes a transformers model (one with a config)")
    config.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    written["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(quantization.block),
        "ignored_layers": [p for p in quantization.ignore if p != "lm_head"],
    }
    written["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(written, indent=2))
    save_file({n: t.cpu() for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out
