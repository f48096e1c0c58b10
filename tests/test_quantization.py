"""FP8 on the trainer's side: the quantizer against vLLM's, and the trainer's FP8 tensors.

The block quantizer must give vLLM's bytes exactly (an engine loading the pushed
weights then holds what loading an FP8 checkpoint of them gives): compared with vLLM's
own ``per_block_cast_to_fp8`` (its Python body, as vLLM's CPU build and the tests
without a compiler run it) on shapes that are and are not whole blocks, in bf16 and
fp32, and on values that reach the fp8 range's end.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrefit import LocalTrainer, ParameterMismatchError
from asyncrefit.quantization import Fp8Blocks, fp8_block_quantize, fp8_block_scales
from asyncrefit.trainer._quantized import Fp8Scales, Fp8Weight

from .models import make_mlp

pytestmark = pytest.mark.timeout(120)

SHAPES = [(128, 128), (300, 200), (256, 512), (1024, 4096), (1, 7)]


def _reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``per_block_cast_to_fp8(weight, [128, 128], use_ue8m0=False)`` arithmetic,
    step by step, on ``weight``'s device (checked against vLLM's own on the CPU below):
    zero padding to whole blocks, each block's largest magnitude (at least 1e-4) over
    448 as its scale, the values times the scale's reciprocal cast to fp8."""
    m, n = weight.shape
    padded = torch.zeros(
        (-(-m // 128) * 128, -(-n // 128) * 128), dtype=weight.dtype, device=weight.device
    )
    padded[:m, :n] = weight
    view = padded.view(-1, 128, padded.size(1) // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scale = amax / 448.0
    values = (view * (1.0 / scale)).to(torch.float8_e4m3fn).view_as(padded)
    return values[:m, :n].contiguous(), scale.view(view.size(0), view.size(2))


def _vllm_quantizer() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm")
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    # The function under torch.compile; its own Python body is vLLM's arithmetic.
    return getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_block_quantization_is_vllms_bitwise(shape: tuple[int, int], dtype: torch.dtype) -> None:
    theirs = _vllm_quantizer()
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    weight[0, 0] = 3.0  # one block's amax far above the rest
    if shape[0] > 1:
        weight[-1, :] = 0.0  # a row of zeros (a block that may be all zero: the 1e-4 floor)
    q, s = fp8_block_quantize(weight, (128, 128))
    want_q, want_s = theirs(weight, [128, 128], use_ue8m0=False)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == weight.shape and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)
    assert torch.equal(fp8_block_scales(weight), s)
    ref_q, ref_s = _reference(weight)  # the GPU test's reference is vLLM's arithmetic
    assert torch.equal(ref_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(ref_s, want_s)


@pytest.mark.parametrize("shape", [(256, 512), (300, 200)], ids=["whole", "padded"])
def test_quantizing_into_out_or_from_a_strided_weight_gives_the_same_bytes(
    shape: tuple[int, int],
) -> None:
    """The one-pass store into ``out`` (how a push writes a weight straight into its
    destination) and a weight that is not contiguous (a transposed view) give the
    reference's bytes; an ``out`` of the wrong kind is refused."""
    theirs = _vllm_quantizer()
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
    want_q, want_s = theirs(weight, [128, 128], use_ue8m0=False)
    out = torch.full(shape, 1.0).to(torch.float8_e4m3fn)
    q, s = fp8_block_quantize(weight, out=out)
    assert q is out
    assert torch.equal(out.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)
    strided = weight.t().contiguous().t()  # the same values, column-major
    q2, s2 = fp8_block_quantize(strided)
    assert torch.equal(q2.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s2, want_s)
    with pytest.raises(ValueError, match="contiguous float8_e4m3fn"):
        fp8_block_quantize(weight, out=torch.empty(shape, dtype=torch.bfloat16))


def test_division_would_not_be_bitwise() -> None:
    """Why the reciprocal: dividing by the scale rounds differently on bf16 weights."""
    weight = (torch.randn(1024, 4096, generator=torch.Generator().manual_seed(1)) * 0.02).to(
        torch.bfloat16
    )
    q, s = fp8_block_quantize(weight)
    view = weight.float().view(8, 128, 32, 128)
    divided = (view / s.view(8, 1, 32, 1)).to(torch.float8_e4m3fn).view(1024, 4096)
    assert not torch.equal(q.view(torch.uint8), divided.view(torch.uint8))


def test_the_trainer_pushes_linear_weights_as_fp8_and_their_scales() -> None:
    model = make_mlp()  # Linear(64, 256), ReLU, Linear(256, 64)
    source = LocalTrainer(model, quantization=Fp8Blocks(block=(128, 128), ignore=("2",)))
    specs = {s.name: (s.shape, s.dtype) for s in source.specs()}
    assert specs == {
        "0.weight": ((256, 64), "float8_e4m3fn"),
        "0.weight_scale_inv": ((2, 1), "float32"),
        "0.bias": ((256,), "float32"),
        "2.weight": ((64, 256), "float32"),  # ignored
        "2.bias": ((64,), "float32"),
    }
    tensors = source._read()
    weight, scales = tensors["0.weight"], tensors["0.weight_scale_inv"]
    assert isinstance(weight, Fp8Weight) and isinstance(scales, Fp8Scales)
    q, s = fp8_block_quantize(model.get_parameter("0.weight").detach())
    got_q = torch.empty(256, 64, dtype=torch.float8_e4m3fn)
    got_s = torch.empty(2, 1)
    weight.copy_into(got_q, lambda *a: None)
    scales.copy_into(got_s, lambda *a: None)
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, s)
    with pytest.raises(ValueError, match="packed whole"):
        weight.rows(0, 128)


def test_from_config_reads_an_fp8_checkpoint(tmp_path: Path) -> None:
    config = {
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "ignored_layers": ["model.layers.0.mlp.down_proj"],
        }
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = Fp8Blocks.from_config(tmp_path)
    assert found.block == (128, 128)
    assert found.ignored("model.layers.0.mlp.down_proj") and found.ignored("lm_head")
    assert not found.ignored("model.layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match="per-tensor"):
        Fp8Blocks.from_config({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="not an FP8"):
        Fp8Blocks.from_config({"quantization_config": {"quant_method": "awq"}})


async def test_fp8_weights_and_their_scales_reach_a_worker_that_holds_them() -> None:
    """A worker holding FP8 weights and their block scales (as an engine of an FP8
    checkpoint does) gets the trainer's weights quantized, bitwise; one that holds them
    unquantized is refused before any byte moves, naming the scales."""
    from asyncrefit import RefitCoordinator, cpu_device

    from .fakes import FakeWorker

    model = make_mlp()
    quantization = Fp8Blocks(ignore=("2",))
    held = {
        "0.weight": torch.zeros(256, 64, dtype=torch.float8_e4m3fn),
        "0.weight_scale_inv": torch.zeros(2, 1),
        "0.bias": torch.zeros(256),
        "2.weight": torch.zeros(64, 256),
        "2.bias": torch.zeros(64),
    }
    worker = FakeWorker("engine", cpu_device(0), held)
    async with RefitCoordinator(
        trainer=LocalTrainer(model, quantization=quantization),
        workers=[worker],
        budget_bytes=1 << 20,
    ) as refit:
        for version in (1, 2):
            with torch.no_grad():
                model.get_parameter("0.weight").mul_(1.5)
            await refit.push(version)
            q, s = fp8_block_quantize(model.get_parameter("0.weight").detach())
            assert torch.equal(held["0.weight"].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(held["0.weight_scale_inv"], s)
            assert torch.equal(held["2.weight"], model.get_parameter("2.weight").detach())

    plain = FakeWorker.like("plain", cpu_device(0), make_mlp())
    before = {n: t.clone() for n, t in plain.parameters.items()}
    with pytest.raises(ParameterMismatchError, match="weight_scale_inv"):
        async with RefitCoordinator(
            trainer=LocalTrainer(model, quantization=quantization),
            workers=[plain],
            budget_bytes=1 << 20,
        ) as refit:
            await refit.push(1)
    assert all(torch.equal(t, before[n]) for n, t in plain.parameters.items())


async def test_an_unquantized_push_into_fp8_weights_with_scales_is_refused() -> None:
    """A cast of bf16 or fp32 into FP8 would ignore the engine's scales (vLLM itself
    loads such a push with wrong weights and no error): refused, nothing moves."""
    from asyncrefit import RefitCoordinator, cpu_device

    from .fakes import FakeWorker

    held = {
        "0.weight": torch.zeros(256, 64, dtype=torch.float8_e4m3fn),
        "0.weight_scale_inv": torch.ones(2, 1),
        "0.bias": torch.zeros(256),
        "2.weight": torch.zeros(64, 256),
        "2.bias": torch.zeros(64),
    }
    worker = FakeWorker("engine", cpu_device(0), held)
    with pytest.raises(ParameterMismatchError, match="a cast would leave the scales out"):
        async with RefitCoordinator(
            trainer=LocalTrainer(make_mlp()), workers=[worker], budget_bytes=1 << 20
        ) as refit:
            await refit.push(1)
    assert not held["0.weight"].view(torch.uint8).any() and not held["0.bias"].any()


@pytest.mark.parametrize("shared", [True, False], ids=["direct", "staged"])
async def test_fp8_push_into_worker_processes_written_directly_or_staged(shared: bool) -> None:
    """Local worker processes holding FP8 weights and scales get the quantized bytes,
    written directly into their exported memory or staged through slots."""
    from asyncrefit import RefitCoordinator
    from asyncrefit._worker._receiver import tensor_digest
    from asyncrefit.local import spawn_local_workers

    from .models import make_mlp_fp8

    model = make_mlp()
    async with (
        spawn_local_workers(make_mlp_fp8, 2, shared_parameters=shared) as workers,
        RefitCoordinator(
            trainer=LocalTrainer(model, quantization=Fp8Blocks(ignore=("2",))),
            workers=workers,
            budget_bytes=1 << 20,
        ) as refit,
    ):
        for version in (1, 2):
            with torch.no_grad():
                model.get_parameter("0.weight").mul_(-2.0)
            report = await refit.push(version)
            assert ("direct" in report.bytes_per_transport) == shared
            q, s = fp8_block_quantize(model.get_parameter("0.weight").detach())
            want = {n: tensor_digest(p.detach()) for n, p in model.named_parameters()}
            want |= {"0.weight": tensor_digest(q), "0.weight_scale_inv": tensor_digest(s)}
            for worker in workers:
                assert await worker.parameter_digests() == want


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on a GPU machine)"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_block_quantization_on_a_gpu_gives_the_reference_arithmetics_bytes_there(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """On a GPU (the kernels a trainer runs there: its multiply stores into the fp8
    output), the bytes and scales of vLLM's arithmetic run on that GPU.

    Not the CPU's bytes: on CUDA, PyTorch divides a tensor by a scalar as a multiply
    by its reciprocal, so ``amax / 448`` may differ from the CPU's in the last bit
    (measured on an H100, 2026-12-07: 1344 / 448 gave a scale printed 3.0000, not 3,
    and some values one fp8 step apart). vLLM's own quantizer, run there, does the
    same division."""
    gen = torch.Generator().manual_seed(shape[0] * 5 + shape[1])
    weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    weight[0, 0] = 448.0 * 3  # one block's amax far above the rest
    if shape[0] > 1:
        weight[-1, :] = 0.0
    on_gpu = weight.cuda()
    want_q, want_s = _reference(on_gpu)
    q, s = fp8_block_quantize(on_gpu)
    assert q.device.type == "cuda" and q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
    q2, s2 = fp8_block_quantize(on_gpu, out=out)
    assert q2.data_ptr() == out.data_ptr()
    assert torch.equal(q2.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s2, want_s)
    # Against the CPU: the scales agree to a float32 rounding step.
    cpu_s = fp8_block_scales(weight)
    assert torch.allclose(s.cpu(), cpu_s, rtol=2.0**-22, atol=0.0)
