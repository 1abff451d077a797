"""Each quantized Linear against float64 math on its dequantized weight."""

import pytest
import torch

from kiln.kernels._triton import HAS_TRITON
from kiln.layers.linear import Linear
from kiln.quant import methods
from kiln.quant.config import QuantConfig
from kiln.quant.methods import install_methods
from kiln.quant.rtn import IntWeight, rtn_quantize


def make_linear(n, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias, shard_dim=None)
    layer.weight.data = torch.randn(n, k, generator=gen) / k**0.5
    if bias:
        layer.bias.data = torch.randn(n, generator=gen)
    return layer, torch.randn(3, 5, k, generator=gen)  # a [..., K] input with two batch dims


def quantize(layer, cfg):
    holder = torch.nn.Sequential(layer)
    install_methods(holder, cfg)
    layer.method.process_weights_after_loading(layer)
    return layer


def codes_to_weight(q: IntWeight) -> torch.Tensor:
    """float64 (codes - z) s, columns back in input order, smooth applied: no packing involved."""
    n, k = q.codes.shape
    gs = k if q.group_size == -1 else q.group_size
    z = 2 ** (q.bits - 1) if q.zeros is None else q.zeros.double().repeat_interleave(gs, 1)
    w = (q.codes.double() - z) * q.scales.double().repeat_interleave(gs, 1)
    if q.smooth is not None:
        w = w * q.smooth.double()
    if q.perm is not None:
        w = torch.zeros_like(w).index_copy_(1, q.perm.long(), w)
    return w


@pytest.mark.parametrize("bits,group_size,symmetric", [
    (8, -1, True), (4, 32, True), (4, 64, False), (4, 128, True), (4, -1, False)])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_linear(bits, group_size, symmetric, bias):
    layer, x = make_linear(48, 256, bias, seed=bits + group_size)
    dense = layer.weight.detach().clone()
    expected_q = rtn_quantize(dense, bits, group_size, symmetric)
    quantize(layer, QuantConfig(method="rtn", bits=bits, group_size=group_size,
                                symmetric=symmetric))
    assert "weight" not in dict(layer.named_parameters())  # the dense copy is gone
    expected = x.double() @ codes_to_weight(expected_q).t()
    if bias:
        expected += layer.bias.double()
    out = layer(x)
    assert out.shape == (3, 5, 48)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and the quantized layer is still close to the dense one (4 bits: ~10%, 8 bits: ~0.5%)
    dense_out = x @ dense.t() + (layer.bias if bias else 0)
    rel = ((out - dense_out).norm() / dense_out.norm()).item()
    assert rel < (0.15 if bits == 4 else 0.01), rel


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_weight_only_with_perm_or_smooth(method):
    """GPTQ act-order (perm) and AWQ (smooth) tensors flow through the Linear unchanged."""
    layer, x = make_linear(24, 128, False, seed=3)
    gen = torch.Generator().manual_seed(4)
    perm = torch.randperm(128, generator=gen).to(torch.int32)
    smooth = torch.rand(128, generator=gen) + 0.5
    w = layer.weight.detach()
    if method == "gptq":
        q = rtn_quantize(w[:, perm.long()], 4, 32, False)
        q.perm = perm
        cfg = QuantConfig(method="gptq", group_size=32, symmetric=False, act_order=True)
    else:
        q = rtn_quantize(w / smooth, 4, 32, False)
        q.smooth = smooth
        cfg = QuantConfig(method="awq", group_size=32, symmetric=False)
    install_methods(torch.nn.Sequential(layer), cfg)
    layer.method.set_weight(layer, q)
    expected = x.double() @ codes_to_weight(q).t()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    dense_out = x @ w.t()
    assert ((layer(x) - dense_out).norm() / dense_out.norm()) < 0.15


def test_tensors_must_match_the_config():
    layer, _ = make_linear(24, 128, False, seed=3)
    install_methods(torch.nn.Sequential(layer), QuantConfig(method="rtn", group_size=32))
    q = rtn_quantize(layer.weight.detach(), 4, 32, False)  # zeros: asymmetric, config is not
    with pytest.raises(ValueError, match="unexpected \\['zeros'\\]"):
        layer.method.set_weight(layer, q)
    q = rtn_quantize(layer.weight.detach(), 4, 64, True)
    with pytest.raises(ValueError, match="scales: got \\(24, 2\\)"):
        layer.method.set_weight(layer, q)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_w8a8_linear_dynamic(kind, granularity):
    layer, x = make_linear(40, 192, True, seed=5)
    method = "fp8" if kind == "fp8" else "smoothquant"
    cfg = QuantConfig(method=method, scheme="w8a8", w8a8_dtype=kind,
                      weight_granularity=granularity)
    if method == "smoothquant":
        cfg.method = "rtn"  # no calibration here: plain INT8 W8A8
    quantize(layer, cfg)
    w_deq = layer.qweight.double() * layer.w_scales.double()[:, None]
    expected = x.double() @ w_deq.t() + layer.bias.double()
    out = layer(x)
    # the only difference left is the per-token activation rounding: e4m3 keeps 3 mantissa
    # bits (2^-4 relative per element), int8 a 1/254 step of each token's absmax
    rel = ((out.double() - expected).norm() / expected.norm()).item()
    assert rel < (0.03 if kind == "fp8" else 0.01), rel
    assert rel > 0  # activations really are quantized


def test_w8a8_static_scale_and_smooth_semantics():
    layer, x = make_linear(16, 64, False, seed=6)
    gen = torch.Generator().manual_seed(7)
    smooth = torch.rand(64, generator=gen) + 0.5
    cfg = QuantConfig(method="smoothquant", scheme="w8a8", w8a8_dtype="int8",
                      activation_scheme="static")
    install_methods(torch.nn.Sequential(layer), cfg)
    w = layer.weight.detach().clone()
    act_scale = torch.tensor(0.02)
    layer.method.quantize_dense(layer, w / smooth, smooth, act_scale)
    x2 = x.reshape(-1, 64)
    codes = torch.floor((x2.double() * smooth.double() / 0.02).clamp(-127, 127) + 0.5)
    w_deq = layer.qweight.double() * layer.w_scales.double()[:, None]
    expected = (codes * 0.02) @ w_deq.t()
    torch.testing.assert_close(layer(x).reshape(-1, 16).double(), expected, rtol=1e-5,
                               atol=1e-5)


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def w8a8_layer(kind, granularity, seed, smooth=False):
    """A quantized 40 x 256 W8A8 Linear with bias (and a SmoothQuant vector if ``smooth``)."""
    layer, _ = make_linear(40, 256, True, seed)
    cfg = QuantConfig(method="smoothquant" if smooth else "fp8" if kind == "fp8" else "rtn",
                      scheme="w8a8", w8a8_dtype=kind, weight_granularity=granularity)
    install_methods(torch.nn.Sequential(layer), cfg)
    sm = torch.rand(256, generator=torch.Generator().manual_seed(seed)) + 0.5 if smooth else None
    w = layer.weight.detach()
    layer.method.quantize_dense(layer, w if sm is None else w / sm, sm)
    return layer


@needs_triton
@pytest.mark.parametrize("granularity,smooth", [("channel", False), ("tensor", False),
                                                ("channel", True)])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: wrong interpreted
def test_fp8_small_m_runs_weight_only(granularity, smooth, m, dtype):
    """The CUDA small-M path (the weight-only GEMV, interpreted here) is the dequantized weight
    times the unquantized x, per-channel or per-tensor scales alike."""
    layer = w8a8_layer("fp8", granularity, seed=10 * m + len(granularity), smooth=smooth)
    if granularity == "tensor":
        assert (layer.w_scales == layer.w_scales[0]).all()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
    w_deq = layer.method.dequantized_weight(layer, torch.float64)
    expected = x.double() @ w_deq.t() + layer.bias.double()
    out = layer.method.apply_weight_only(layer, x)
    assert out.dtype == dtype and out.shape == (m, 40)
    rel = ((out.double() - expected).norm() / expected.norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 3e-3), rel


@needs_triton
@pytest.mark.parametrize("kind,cuda,shape,gemv", [
    ("fp8", True, (1, 256), True),
    ("fp8", True, (2, 2, 256), True),  # M counts every leading dimension
    ("fp8", True, (5, 256), False),
    ("fp8", True, (16, 256), False),
    ("fp8", False, (1, 256), False),  # CPU: the float32 reference, whatever M
    ("int8", True, (1, 256), False),  # the GEMV has no signed int8 codes
])
def test_w8a8_dispatch_by_rows(monkeypatch, kind, cuda, shape, gemv):
    layer = w8a8_layer(kind, "channel", seed=1)
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    if cuda:  # what use_triton says for CUDA tensors; the paths below still run on the CPU
        monkeypatch.setattr(methods, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(methods, "w8a8_linear", spy("w8a8", methods.w8a8_linear))
    monkeypatch.setattr(methods, "wint_linear_triton", spy("gemv", methods.wint_linear_triton))
    out = layer(torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    assert out.shape == (*shape[:-1], 40)
    assert calls == ["gemv" if gemv else "w8a8"]


@pytest.mark.parametrize("fmt", ["dense", "int4", "w8a8-int8"])
def test_gated_linear_hands_the_next_layer_its_codes(fmt):
    """``out_quant``: silu(gate) * up comes as the next layer's input codes, equal to quantizing
    the activation on its own, whether the format fuses it (W8A8) or Linear quantizes after."""
    from kiln.kernels.activation import silu_and_mul
    from kiln.kernels.row_quant import quantize_rows_ref
    from kiln.quant import w8a8

    layer, x = make_linear(2 * 24, 64, False, seed=9)
    layer.shards = {"gate": (0, 24), "up": (24, 24)}
    if fmt == "int4":
        quantize(layer, QuantConfig(method="rtn", bits=4, group_size=32))
    elif fmt == "w8a8-int8":
        quantize(layer, QuantConfig(method="rtn", scheme="w8a8", w8a8_dtype="int8"))
    quant = w8a8.row_quant("int8", torch.rand(24) + 0.5)
    got = layer(x, gated=True, out_quant=quant)
    codes, scales = quantize_rows_ref(silu_and_mul(layer(x)).reshape(-1, 24), quant)
    assert got.codes.shape == (3, 5, 24) and got.scales.shape == (15, 1)
    assert torch.equal(got.codes.reshape(-1, 24), codes)
    assert torch.equal(got.scales, scales)


@pytest.mark.parametrize("quantization,standalone_per_layer", [("fp8", 1), ("w8a8-int8", 1),
                                                                ("int8", 0)])
def test_norms_quantize_for_the_w8a8_projections_after_them(tiny_llama, monkeypatch,
                                                             quantization, standalone_per_layer):
    """In a W8A8 model the RMSNorms write qkv's and gate_up's input codes and the MLP's
    activation writes down_proj's, so the standalone quantizer runs only for o_proj; the logits
    are those of quantizing every input on its own (the unfused path, forced by switching those
    quantizations off)."""
    from kiln.layers.attention import contiguous_kv_caches, contiguous_metadata
    from kiln.models.loader import load_model
    from kiln.quant import w8a8

    model = load_model(str(tiny_llama), device="cpu", dtype="float32",
                       quantization=quantization).model
    calls = []
    real = w8a8.quant_per_token_ref
    monkeypatch.setattr(w8a8, "quant_per_token_ref",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(3, 200, (7,), generator=torch.Generator().manual_seed(0))

    cfg = model.cfg

    def logits():
        caches = contiguous_kv_caches(len(model.layers), 1, 16, cfg.num_kv_heads, cfg.head_dim,
                                      torch.float32, torch.device("cpu"))
        meta = contiguous_metadata([0], [7], 16, caches, torch.device("cpu"))
        return model.compute_logits(model(ids, torch.arange(7), meta))

    fused = logits()
    assert len(calls) == standalone_per_layer * len(model.layers)
    for layer in model.layers:  # every projection quantizes its own input again
        for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            monkeypatch.setattr(linear, "input_quant", lambda num_rows: None)
    torch.testing.assert_close(logits(), fused, rtol=0, atol=0)
