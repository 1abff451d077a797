"""The LM head as a quantizable Linear: tied and untied, on the fly, saved and loaded, sharded.

Weight-only formats store it as W8A16 (int8 per output channel, RTN) whatever the layers' bits,
group and method; ``lm_head_bits=4`` puts it in the 4-bit layers' own format instead.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tiny_models import TRITON_GEOMETRY, VOCAB_SIZE, build_model

from kiln.layers.embedding import LMHead
from kiln.layers.linear import DenseLinearMethod, Linear
from kiln.models.loader import load_model
from kiln.parallel import SINGLE, TPContext
from kiln.quant import QuantConfig, install_methods, quantize_model, save_quantized
from kiln.quant import quantize as quantize_module
from kiln.quant.config import CONFIG_FILE, on_the_fly_config
from kiln.quant.rtn import rtn_quantize


@pytest.fixture(scope="module", params=["llama3.1", "qwen2"])  # untied; tied embeddings
def model_dir(request, tmp_path_factory):
    # 256 wide: int4's groups of 128 divide the head's inputs
    return build_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer=False,
                       **TRITON_GEOMETRY)


def token_ids(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(seed))


def checkpoint_keys(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_dense_head_is_unchanged(model_dir):
    """Dense: one parameter (the embedding's own tensor when tied), plain x W^T, no buffers."""
    model = load_model(str(model_dir), device="cpu").model
    head, embed = model.lm_head, model.embed_tokens
    tied = model.cfg.tie_word_embeddings
    assert isinstance(head.method, DenseLinearMethod)
    assert list(dict(head.named_parameters())) == ["weight"] and not list(head.buffers())
    assert (head.weight is embed.weight) == tied
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight" if tied else "lm_head.weight")
    assert torch.equal(head.weight, table)
    x = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head(x), F.linear(x, table))


@pytest.mark.parametrize("quantization,layer_codes", [("int8", torch.uint8),
                                                      ("int4", torch.int32)])
def test_quantized_head_is_the_rounded_dense_head(model_dir, quantization, layer_codes):
    """int8 and int4 alike: 8-bit codes per output channel, round to nearest, symmetric."""
    dense = load_model(str(model_dir), device="cpu").model
    table = dense.lm_head.weight.detach()  # the embedding's tensor when tied
    model = load_model(str(model_dir), device="cpu", quantization=quantization).model
    head = model.lm_head
    assert model.layers[0].mlp.down_proj.qweight.dtype == layer_codes
    expected = rtn_quantize(table, 8, -1, True)
    assert "weight" not in dict(head.named_parameters())
    assert head.qweight.dtype == torch.uint8 and head.scales.shape == (head.out_features, 1)
    assert head.zeros is None
    assert torch.equal(head.qweight, expected.qweight())
    assert torch.equal(head.scales, expected.scales)
    # the embedding keeps the dense table: a lookup reads exact rows
    assert torch.equal(model.embed_tokens.weight, dense.embed_tokens.weight)
    hidden: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _mod, args: hidden.append(args[0]))
    logits = model.full_logits(token_ids(0)).reshape(-1, VOCAB_SIZE)
    handle.remove()
    reference = hidden[0].double() @ expected.dequantize(torch.float64).t()
    torch.testing.assert_close(logits.double(), reference, rtol=1e-5, atol=1e-5)
    # really quantized, still the same head: int8 rounds to 1/255 of a row's range
    dense_logits = hidden[0] @ table.t()
    err = ((logits - dense_logits).norm() / dense_logits.norm()).item()
    assert 0 < err < 0.01, err


W8A16_KEYS = {"lm_head.qweight", "lm_head.scales"}
CONFIGS = [  # (config, the head's tensors)
    (dict(method="rtn", bits=8, group_size=-1), W8A16_KEYS),
    (dict(method="awq", bits=4, group_size=128), W8A16_KEYS),
    (dict(method="gptq", bits=4, group_size=128, symmetric=False, act_order=True), W8A16_KEYS),
    # asked for: the layers' format and method (AWQ's smooth, GPTQ's zeros and act-order perm)
    (dict(method="awq", bits=4, group_size=128, lm_head_bits=4), W8A16_KEYS | {"lm_head.smooth"}),
    (dict(method="gptq", bits=4, group_size=128, symmetric=False, act_order=True,
          lm_head_bits=4), W8A16_KEYS | {"lm_head.zeros", "lm_head.perm"}),
    (dict(method="awq", bits=4, group_size=128, lm_head_bits=None), None),  # --dense-lm-head
    (dict(method="fp8", scheme="w8a8"), None),  # the head stays dense
]


@pytest.mark.parametrize("kwargs,keys", CONFIGS, ids=[
    f"{k['method']}-head{QuantConfig(**k).lm_head_bits}" for k, _ in CONFIGS])
def test_quantize_save_load_round_trip(model_dir, tmp_path, kwargs, keys):
    dense = load_model(str(model_dir), device="cpu")
    embed = dense.model.embed_tokens.weight.detach().clone()
    tied = dense.arch.tie_word_embeddings
    cfg = quantize_model(dense.model, QuantConfig(**kwargs), token_ids(1), kv_scales=False)
    expected = dense.model.full_logits(token_ids(2))
    out = save_quantized(dense.model, cfg, tmp_path / "q", model_dir)
    head_keys = {k for k in checkpoint_keys(out) if k.startswith("lm_head.")}
    if keys is not None:
        assert head_keys == keys
    else:  # tied: the embedding's one copy
        assert head_keys == (set() if tied else {"lm_head.weight"})
    loaded = load_model(str(out), device="cpu").model
    assert torch.equal(loaded.full_logits(token_ids(2)), expected)
    assert torch.equal(loaded.embed_tokens.weight, embed)
    shared = getattr(loaded.lm_head, "weight", None) is loaded.embed_tokens.weight
    assert shared == (tied and keys is None)


@pytest.mark.parametrize("lm_head_bits", [8, 4])
def test_rtn_head_needs_no_statistics(model_dir, monkeypatch, lm_head_bits):
    """GPTQ layers collect their Hessians; a W8A16 head is rounded without any."""
    hooked: list[str] = []
    collect = quantize_module.collect_linear_stats

    def spy(model, layers, *args, **kwargs):
        hooked.extend(name for name, _ in layers)
        return collect(model, layers, *args, **kwargs)

    monkeypatch.setattr(quantize_module, "collect_linear_stats", spy)
    model = load_model(str(model_dir), device="cpu").model
    quantize_model(model, QuantConfig(method="gptq", bits=4, group_size=128,
                                      lm_head_bits=lm_head_bits), token_ids(1), kv_scales=False)
    assert "layers.0.mlp.down_proj" in hooked
    assert ("lm_head" in hooked) == (lm_head_bits == 4)


def rewrite_config(out, edit) -> None:
    data = json.loads((out / CONFIG_FILE).read_text())
    edit(data)
    (out / CONFIG_FILE).write_text(json.dumps(data))


def test_config_without_the_field_keeps_the_head_dense(model_dir, tmp_path):
    """A checkpoint written before 1718ff3 had no head field and a dense head; it still loads."""
    dense = load_model(str(model_dir), device="cpu")
    cfg = quantize_model(dense.model, QuantConfig(method="rtn", bits=8, group_size=-1,
                                                  lm_head_bits=None))
    expected = dense.model.full_logits(token_ids(3))
    out = save_quantized(dense.model, cfg, tmp_path / "q", model_dir)
    rewrite_config(out, lambda data: data.pop("lm_head_bits"))
    loaded = load_model(str(out), device="cpu").model
    assert isinstance(loaded.lm_head.method, DenseLinearMethod)
    assert torch.equal(loaded.full_logits(token_ids(3)), expected)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_sharded_head_pads_and_quantizes_per_rank(quantization):
    """Each rank rounds its own rows (8-bit, whatever the layers); padding rows past the
    vocabulary give logits of exactly 0."""
    vocab, hidden, tp_size = 10, 128, 3  # 4 rows per rank: the last holds 2 padding rows
    gen = torch.Generator().manual_seed(4)
    table, x = torch.randn(vocab, hidden, generator=gen), torch.randn(5, hidden, generator=gen)

    def build(tp: TPContext) -> LMHead:
        head = LMHead(vocab, hidden, tp)
        head.load("weight", table)
        install_methods(torch.nn.Sequential(head), on_the_fly_config(quantization))
        head.method.process_weights_after_loading(head)
        return head

    whole = build(SINGLE)
    assert torch.equal(whole.qweight, rtn_quantize(table, 8, -1, True).qweight())
    ranks = [build(TPContext(rank=r, size=tp_size)) for r in range(tp_size)]
    assert torch.equal(torch.cat([h.qweight for h in ranks])[:vocab], whole.qweight)
    # what each rank's forward computes before the all-gather
    parts = [Linear.forward(h, x) for h in ranks]
    assert parts[-1].shape == (5, 4) and torch.equal(parts[-1][:, 2:], torch.zeros(5, 2))
    torch.testing.assert_close(torch.cat(parts, -1)[:, :vocab], whole(x), rtol=1e-6, atol=1e-6)
