"""o_proj and down_proj add their output into the residual stream in cuBLAS' epilogue where they
run on cuBLAS (dense weights past the decode GEMV's and the tile GEMM's rows; the weight-only
formats' dequantize + cuBLAS rows, tests/kernels/test_quant_gemm.py), on CUDA; the RMSNorm after
them then has no residual to add. Everywhere else the output comes back for the norm's fused
add, as before."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_model, random_prompts

from kiln.kernels import quant_gemm
from kiln.kernels.gemm import DENSE_MAX_M
from kiln.layers.linear import row_parallel
from kiln.layers.norm import RMSNorm
from kiln.models import load_model

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layer(in_features: int, out_features: int, device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(in_features)
    layer = row_parallel(in_features, out_features, bias=False)
    layer.load("weight", torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
    return layer.to(device, dtype)


def _inputs(rows: int, k: int, n: int, device: str, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(rows)
    return (torch.randn(rows, k, generator=gen, device=device, dtype=dtype),
            torch.randn(rows, n, generator=gen, device=device, dtype=dtype))


def test_none_x_norms_the_residual_alone():
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    residual = torch.randn(5, 64)
    normed, out = norm(None, residual)
    assert out is residual
    torch.testing.assert_close(normed, norm(residual))


def test_off_cuda_the_output_comes_back_and_the_residual_is_left_alone():
    layer = _layer(128, 64, "cpu", torch.float32)
    x, residual = _inputs(DENSE_MAX_M + 40, 128, 64, "cpu", torch.float32)
    before = residual.clone()
    out = layer(x, residual=residual)
    torch.testing.assert_close(out, x @ layer.weight.t())
    assert torch.equal(residual, before)


def check_residual_sum(out: torch.Tensor | None, residual: torch.Tensor, before: torch.Tensor,
                       product: torch.Tensor, fused: bool) -> None:
    """``fused``: the result was added into ``residual`` (and None returned), else returned and
    ``residual`` left alone; either way the sum is ``before + product`` at bf16 rounding."""
    assert (out is None) == fused
    if not fused:
        assert torch.equal(residual, before)
        residual = before + out
    torch.testing.assert_close(residual.float(), before.float() + product, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, DENSE_MAX_M, DENSE_MAX_M + 1, 512, 4099])
def test_gpu_dense_adds_the_residual_in_the_epilogue_past_the_triton_rows(rows):
    layer = _layer(1024, 512, "cuda", torch.bfloat16)
    x, residual = _inputs(rows, 1024, 512, "cuda", torch.bfloat16)
    before = residual.clone()
    out = layer(x, residual=residual)
    check_residual_sum(out, residual, before, x.float() @ layer.weight.float().t(),
                       rows > DENSE_MAX_M)


@pytest.mark.gpu
@gpu
def test_gpu_llama_logits_with_the_epilogue_add_match_transformers(tiny_model_dirs, monkeypatch):
    """A bf16 forward of 300 rows (every o_proj / down_proj on the epilogue path) against
    transformers in float32, as close as the same forward with the add left to the norms."""
    path = tiny_model_dirs["llama3.1"]
    loaded = load_model(str(path), dtype="bfloat16", device="cuda")
    prompt = random_prompts([300], loaded.arch.vocab_size, seed=3)[0]
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([prompt])).logits[0]

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return loaded.model.full_logits(torch.tensor([prompt], device="cuda"))[0].cpu()

    fused = logits()
    unfused_linear = quant_gemm.linear
    monkeypatch.setattr("kiln.layers.linear.linear",
                        lambda x, w, b=None, o=None, g=False, r=None: unfused_linear(x, w, b, o, g))
    unfused = logits()
    fused_err = (fused - expected).abs().max().item()
    unfused_err = (unfused - expected).abs().max().item()
    assert fused_err <= max(1.25 * unfused_err, 1e-2), (fused_err, unfused_err)
    assert (fused.argmax(-1) == unfused.argmax(-1)).float().mean() >= 0.98
