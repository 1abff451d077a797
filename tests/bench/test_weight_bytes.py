"""The bytes a decode step reads (the numerator of ``kiln bench latency``'s achieved GB/s)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TRITON_GEOMETRY, build_model

from kiln.bench.offline import weight_bytes
from kiln.layers.embedding import LMHead
from kiln.models import load_model
from kiln.quant.methods import quantized_linears

# quantization -> bytes of one quantized [out, inp] Linear weight as stored from a bf16 model:
# codes plus scales (bf16 per row / per group of 128 for weight-only, float32 per row for FP8)
STORED = {
    "int8": lambda out, inp: out * inp + 2 * out,
    "int4": lambda out, inp: out * inp // 2 + 2 * out * (inp // 128),
    "fp8": lambda out, inp: out * inp + 4 * out,
}
# the LM head's format: weight-only formats store it as W8A16 (int8's), FP8 keeps it bf16
HEAD = {"int8": "int8", "int4": "int8", "fp8": None}


@pytest.fixture(scope="module", params=["llama3.1", "qwen2"])  # untied; tied with q/k/v bias
def model_dir(request, tmp_path_factory):
    # 256 / 384 wide: int4's groups of 128 divide every Linear's inputs
    return build_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer=False,
                       **TRITON_GEOMETRY)


def _load(path, quantization=None):
    return load_model(str(path), dtype="bfloat16", device="cpu", quantization=quantization).model


def test_dense_counts_every_weight_but_the_embedding_table(model_dir):
    model = _load(model_dir)
    params = {id(p): p for p in model.parameters()}  # a tied LM head is the embedding tensor
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.embed_tokens.weight
    gathered = 0 if model.cfg.tie_word_embeddings else embed.numel() * embed.element_size()
    # and no buffer: the rotary table is gathered by position
    assert weight_bytes(model) == total - gathered


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_counts_codes_and_scales(model_dir, quantization):
    """Weight-only formats store the LM head as int8 (tied or not, int4 layers too); FP8 keeps
    it bf16."""
    dense = _load(model_dir)
    head = HEAD[quantization]
    linears = [m for _, m in quantized_linears(dense, lm_head=head is not None)]
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    stored = sum(STORED[head if isinstance(m, LMHead) else quantization](m.out_features,
                                                                        m.in_features)
                 for m in linears)
    linear_bf16 = sum(2 * m.out_features * m.in_features for m in linears)
    rest = weight_bytes(dense) - linear_bf16  # norms, biases (FP8: the LM head): unchanged
    assert weight_bytes(_load(model_dir, quantization)) - rest == stored
