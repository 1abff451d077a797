"""Integer grids and packing, FP8/INT8 weight quantization, config validation."""

import pytest
import torch

from kiln.quant.config import QuantConfig, on_the_fly_config
from kiln.quant.rtn import int_qparams, pack_int4, quantize_codes, rtn_quantize, unpack_int4
from kiln.quant.w8a8 import check_fp8_supported, quantize_weight


@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (3, 136)])
def test_int4_pack_unpack_round_trip(shape):
    gen = torch.Generator().manual_seed(shape[1])
    codes = torch.randint(0, 16, shape, generator=gen).to(torch.uint8)
    codes[0, :8] = torch.tensor([15, 0, 15, 8, 7, 1, 0, 15])  # top nibble set: negative word
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] // 8)
    assert torch.equal(unpack_int4(packed), codes)
    # layout contract with the kernel: code k at bits 4 (k % 8) of word k // 8
    word = int(packed[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == codes[0, :8].tolist()


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((1, 8), 16, dtype=torch.uint8))


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (4, -1), (8, -1)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_is_at_most_half_a_step(bits, group_size, symmetric):
    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    w = torch.randn(12, 256, generator=gen) * torch.rand(12, 1, generator=gen)
    w += 0.3 * (not symmetric)  # shifted rows: where zero points pay off
    q = rtn_quantize(w, bits, group_size, symmetric)
    w_hat = q.dequantize()
    gs = 256 if group_size == -1 else group_size
    step = q.scales.repeat_interleave(gs, 1)
    assert ((w_hat - w).abs() <= step / 2 + 1e-6).all()
    assert q.codes.max() <= 2**bits - 1
    if bits == 4:
        assert q.qweight().shape == (12, 32) and q.qweight().dtype == torch.int32


def test_asymmetric_beats_symmetric_on_shifted_weights():
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(16, 128, generator=gen) + 0.5  # all positive: half a symmetric grid wasted
    err = {sym: (rtn_quantize(w, 4, 32, sym).dequantize() - w).pow(2).mean() for sym in (1, 0)}
    assert err[0] < 0.5 * err[1]


def test_codes_use_the_given_grid():
    w = torch.tensor([[0.0, 0.1, -0.71, 0.75, 0.36, -0.34, 0.2, 0.05]])
    scales, zeros = int_qparams(w, 4, -1, True)
    assert zeros is None and scales.item() == pytest.approx(0.1)  # 0.75 / 7.5: all 16 codes
    assert quantize_codes(w, scales, zeros, 4, -1).tolist() == [[8, 9, 1, 15, 12, 5, 10, 8]]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_w8_weight_quantization(kind, granularity):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=gen) * torch.logspace(-2, 1, 8)[:, None]
    wq, scales = quantize_weight(w, kind, granularity)
    assert wq.dtype == (torch.float8_e4m3fn if kind == "fp8" else torch.int8)
    assert scales.shape == (8,)
    if granularity == "tensor":
        assert torch.all(scales == scales[0])
    rel = ((wq.float() * scales[:, None] - w).norm(dim=1) / w.norm(dim=1))
    bound = 0.04 if kind == "fp8" else 0.01
    if granularity == "channel":  # per channel, small rows keep their precision
        assert (rel < bound).all(), rel
    else:  # per tensor, the smallest row falls below the grid (int8) or into subnormals (fp8)
        assert rel[-1] < bound and rel[0] > rel[-1]


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="magic"), "method='magic' is not supported"),
    (dict(bits=3), "bits=3"),
    (dict(group_size=48), "group_size=48"),
    (dict(bits=8, group_size=128), "per output channel"),
    (dict(method="fp8"), "scheme='w8a8'"),
    (dict(method="gptq", scheme="w8a8"), "scheme='wint'"),
    (dict(method="smoothquant", scheme="w8a8", alpha=1.5), "alpha"),
    (dict(method="awq", act_order=True), "act_order is a GPTQ option"),
    (dict(bits=8, group_size=-1, lm_head_bits=4), r"lm_head_bits=4: .*\(bits=8\)"),
    (dict(lm_head_bits=16), "lm_head_bits=16"),
    # options the format does not use are refused, not silently dropped or rounded
    (dict(method="fp8", scheme="w8a8", bits=2), "bits=2 is a weight-only setting"),
    (dict(method="fp8", scheme="w8a8", group_size=64), "group_size=64 is a weight-only"),
    (dict(method="rtn", alpha=0.8), "method='rtn' does not use it"),
    (dict(method="awq", observer="entropy"), "observer='entropy' picks static"),
    (dict(method="smoothquant", scheme="w8a8", observer="mse"), "observer='mse' picks static"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantConfig(**kwargs)


def test_group_must_divide_in_features():
    with pytest.raises(ValueError, match="group_size=128 does not divide in_features=96"):
        QuantConfig(method="rtn", group_size=128).check_layer(96, "mlp.down_proj")
    QuantConfig(method="rtn", group_size=32).check_layer(96)


def test_on_the_fly_names_and_json_round_trip():
    with pytest.raises(ValueError, match="quantization='int3'"):
        on_the_fly_config("int3")
    cfg = QuantConfig(method="gptq", group_size=64, symmetric=False, act_order=True,
                      kv_cache_scales=[[0.1, 0.2]])
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="not a Kiln quantization config"):
        QuantConfig.from_json({"quant_method": "awq"})


W8A16_HEAD = QuantConfig(method="rtn", bits=8, group_size=-1)


@pytest.mark.parametrize("kwargs", [
    dict(method="rtn", bits=8, group_size=-1, symmetric=False),
    dict(method="awq", bits=4, group_size=128),
    dict(method="gptq", bits=4, group_size=64, symmetric=False, act_order=True),
])
def test_lm_head_is_w8a16_whatever_the_layers(kwargs):
    """Weight-only formats store the LM head as W8A16 per channel RTN unless told otherwise."""
    cfg = QuantConfig(**kwargs)
    assert cfg.lm_head_bits == 8 and cfg.lm_head_config() == W8A16_HEAD
    assert "LM head" not in cfg.name
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    dense = QuantConfig(**kwargs, lm_head_bits=None)
    assert dense.lm_head_config() is None and dense.name.endswith(", dense LM head)")
    assert QuantConfig.from_json(dense.to_json()) == dense


def test_lm_head_per_scheme():
    assert on_the_fly_config("int8").lm_head_config() == W8A16_HEAD
    assert on_the_fly_config("int4").lm_head_config() == W8A16_HEAD
    # W8A8 keeps it in the model dtype: lm_head_bits is a weight-only setting, like bits
    assert on_the_fly_config("fp8").lm_head_bits is None
    assert on_the_fly_config("w8a8-int8").lm_head_bits is None
    assert QuantConfig(method="fp8", scheme="w8a8", lm_head_bits=8).lm_head_config() is None
    # asked for: a 4-bit head in the layers' own format and method
    same = QuantConfig(method="awq", lm_head_bits=4)
    assert same.lm_head_config() is same and same.name == "W4A16 g128 sym (awq, 4-bit LM head)"


@pytest.mark.parametrize("kwargs", [dict(method="awq"), dict(method="rtn", bits=8, group_size=-1),
                                    dict(method="fp8", scheme="w8a8")])
def test_configs_from_before_lm_head_bits_keep_a_dense_head(kwargs):
    data = QuantConfig(**kwargs).to_json()
    del data["lm_head_bits"]
    assert QuantConfig.from_json(data) == QuantConfig(**kwargs, lm_head_bits=None)


def test_unknown_and_conflicting_head_fields_are_refused():
    data = QuantConfig(method="awq").to_json()
    with pytest.raises(ValueError, match="unknown field.*quantize_lm_head"):
        QuantConfig.from_json({**data, "quantize_lm_head": True})
    with pytest.raises(ValueError, match="unknown field.*lm_head_group"):
        QuantConfig.from_json({**data, "lm_head_group": 128})


def test_fp8_refused_on_gpu_without_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability >= 8.9.*A100 is sm_80"):
        check_fp8_supported(torch.device("cuda"))
    # an FP8 checkpoint refuses --quantization: the fix names a checkpoint format too
    with pytest.raises(ValueError, match="--quantization int8 \\(W8A16\\) or w8a8-int8, or a "
                                         "checkpoint from `kiln quantize --method rtn --bits 8` "
                                         "or `--method smoothquant`"):
        check_fp8_supported(torch.device("cuda"))
    check_fp8_supported(torch.device("cpu"))  # the reference path


def test_4bit_packing_error_names_the_fix():
    with pytest.raises(ValueError, match="down_proj has 100: use 8 bits"):
        QuantConfig(method="rtn", group_size=-1).check_layer(100, "down_proj")


@pytest.mark.parametrize("field", ["bits", "group_size", "symmetric", "scheme"])
def test_config_missing_a_layout_field_is_refused(field):
    """A missing field is named, not replaced by its default (which then failed on the
    tensors' shapes, or loaded when the guess happened to be right)."""
    data = QuantConfig(method="gptq", group_size=64, symmetric=False).to_json()
    del data[field]
    with pytest.raises(ValueError, match=f"q.json: missing field\\(s\\) {field}; the file is "
                                         "incomplete"):
        QuantConfig.from_json(data, source="q.json")


def test_config_that_is_no_json_object_is_refused():
    with pytest.raises(ValueError, match="q.json: expected a JSON object, got list"):
        QuantConfig.from_json([1, 2], source="q.json")
