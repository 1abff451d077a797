"""quantize -> save -> load gives identical outputs; on-the-fly quantization at load; errors."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kiln.layers.attention import Attention
from kiln.models.loader import load_model
from kiln.quant import QuantConfig, calibration_ids, quantize_model, save_quantized
from kiln.quant.cli import quantize_cmd
from kiln.quant.config import CONFIG_FILE


def logits(loaded, seed=0):
    ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(seed))
    return loaded.model.full_logits(ids)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


CONFIGS = [
    dict(method="awq", bits=4, group_size=32),
    dict(method="gptq", bits=4, group_size=32, symmetric=False, act_order=True),
    dict(method="rtn", bits=8, group_size=-1),
    dict(method="fp8", scheme="w8a8", weight_granularity="tensor"),
    dict(method="smoothquant", scheme="w8a8", w8a8_dtype="int8", activation_scheme="static",
         observer="entropy"),
]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=lambda k: k["method"])
def test_quantize_save_load_round_trip(tiny_llama, calib_file, tmp_path, kwargs):
    dense = load_model(str(tiny_llama), device="cpu")
    reference = logits(dense)
    cfg = QuantConfig(**kwargs)
    ids = calibration_ids(dense.tokenizer, str(calib_file), num_samples=4, seq_len=32)
    assert ids.shape == (4, 32)
    quantize_model(dense.model, cfg, ids)
    quantized = logits(dense)
    assert 0 < rel(quantized, reference) < 0.2  # really quantized, still the same model
    save_quantized(dense.model, cfg, tmp_path / "q", tiny_llama)
    loaded = load_model(str(tmp_path / "q"), device="cpu")
    assert torch.equal(logits(loaded), quantized)
    assert torch.equal(logits(loaded, seed=1), logits(dense, seed=1))
    saved = json.loads((tmp_path / "q" / CONFIG_FILE).read_text())
    assert saved["method"] == cfg.method and len(saved["kv_cache_scales"]) == 2
    attn = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    assert [a.k_scale for a in attn] == [s[0] for s in saved["kv_cache_scales"]]
    assert loaded.tokenizer is not None


@pytest.mark.parametrize("name,bound", [("int8", 0.02), ("fp8", 0.1), ("fp8-tensor", 0.1),
                                        ("w8a8-int8", 0.05)])
def test_on_the_fly_quantization(tiny_llama, name, bound):
    reference = logits(load_model(str(tiny_llama), device="cpu"))
    loaded = load_model(str(tiny_llama), device="cpu", quantization=name)
    layer = loaded.model.layers[0].mlp.down_proj
    assert "weight" not in dict(layer.named_parameters()) and layer.qweight.dtype != torch.float32
    assert 0 < rel(logits(loaded), reference) < bound


def test_load_errors(tiny_llama, tmp_path):
    # kiln-tiny's hidden size 64 is not a multiple of int4's default group of 128
    with pytest.raises(ValueError, match="group_size=128 does not divide in_features=64.*"
                                         "The on-the-fly formats are fixed: load with "
                                         "quantization='int8' or 'fp8'"):
        load_model(str(tiny_llama), device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="quantization='nf4' is not supported"):
        load_model(str(tiny_llama), device="cpu", quantization="nf4")
    dense = load_model(str(tiny_llama), device="cpu")
    cfg = quantize_model(dense.model, QuantConfig(method="rtn", group_size=32))
    out = save_quantized(dense.model, cfg, tmp_path / "q", tiny_llama)
    with pytest.raises(ValueError, match="already quantized .*drop quantization='fp8'"):
        load_model(str(out), device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="load_format='dummy' does not apply"):
        load_model(str(out), device="cpu", load_format="dummy")
    # a checkpoint quantized by another tool is refused, not misread
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="quantized by another tool \\(quant_method='awq'\\)"):
        load_model(str(hf), device="cpu")


def test_calibration_errors(tiny_llama, tmp_path):
    dense = load_model(str(tiny_llama), device="cpu")
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize_model(dense.model, QuantConfig(method="gptq", group_size=32))
    with pytest.raises(ValueError, match="neither a text file nor one of zoo-train"):
        calibration_ids(dense.tokenizer, str(tmp_path / "missing.txt"), 2, 16)
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    with pytest.raises(ValueError, match="seq_len 64 needs more"):
        calibration_ids(dense.tokenizer, str(short), 2, 64)


def test_cli_quantize_then_load(tiny_llama, calib_file, tmp_path):
    out = tmp_path / "cli-q"
    result = CliRunner().invoke(quantize_cmd, [
        "--model", str(tiny_llama), "--method", "gptq", "--group-size", "32",
        "--calibration", str(calib_file), "--num-samples", "2", "--seq-len", "32",
        "--out", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "W4A16 g32 sym (gptq)" in result.output and (out / "model.safetensors").is_file()
    loaded = load_model(str(out), device="cpu")
    assert loaded.model.layers[1].self_attn.qkv_proj.qweight.dtype == torch.int32
    assert loaded.model.lm_head.qweight.dtype == torch.uint8  # W8A16, whatever the layers
    assert json.loads((out / CONFIG_FILE).read_text())["lm_head_bits"] == 8
    dense_head = CliRunner().invoke(quantize_cmd, [
        "--model", str(tiny_llama), "--method", "rtn", "--bits", "8", "--dense-lm-head",
        "--out", str(tmp_path / "w8"), "--device", "cpu"])
    assert dense_head.exit_code == 0, dense_head.output
    assert "W8A16 channel sym (rtn, dense LM head)" in dense_head.output
    assert json.loads((tmp_path / "w8" / CONFIG_FILE).read_text())["lm_head_bits"] is None
    bad = CliRunner().invoke(quantize_cmd, ["--model", str(tiny_llama), "--method", "rtn",
                                            "--bits", "8", "--group-size", "32", "--out",
                                            str(tmp_path / "x"), "--device", "cpu"])
    assert bad.exit_code != 0 and "per output channel" in bad.output


def test_quantizing_a_quantized_model_is_refused(tiny_llama):
    dense = load_model(str(tiny_llama), device="cpu")
    quantize_model(dense.model, QuantConfig(method="rtn", group_size=32))
    with pytest.raises(ValueError, match="the model is already quantized .*load the dense "
                                         "checkpoint"):
        quantize_model(dense.model, QuantConfig(method="rtn", bits=8, group_size=-1))
    on_the_fly = load_model(str(tiny_llama), device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(on_the_fly.model, QuantConfig(method="rtn", group_size=32))


def test_save_refuses_what_would_not_load(tiny_llama, tmp_path):
    dense = load_model(str(tiny_llama), device="cpu")
    w8 = QuantConfig(method="rtn", bits=8, group_size=-1)
    with pytest.raises(ValueError, match="not quantized as cfg says .*run quantize_model"):
        save_quantized(dense.model, w8, tmp_path / "q", tiny_llama)  # quantize_model never ran
    quantize_model(dense.model, QuantConfig(method="rtn", group_size=32))
    with pytest.raises(ValueError, match="not quantized as cfg says"):
        save_quantized(dense.model, w8, tmp_path / "q", tiny_llama)  # another config
    assert not (tmp_path / "q").exists()
    # into the dense checkpoint itself: its weights would be overwritten
    before = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match="holds a dense checkpoint; .*new or empty directory"):
        save_quantized(dense.model, QuantConfig(method="rtn", group_size=32), tiny_llama,
                       tiny_llama)
    assert {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()} == before


def test_damaged_checkpoint_errors_name_the_problem(tiny_llama, tmp_path):
    dense = load_model(str(tiny_llama), device="cpu")
    cfg = quantize_model(dense.model, QuantConfig(method="rtn", group_size=32))
    out = save_quantized(dense.model, cfg, tmp_path / "q", tiny_llama)
    config = json.loads((out / CONFIG_FILE).read_text())
    (out / CONFIG_FILE).write_text(json.dumps({**config, "bits": 8, "group_size": -1}))
    with pytest.raises(ValueError, match=rf"weights do not match {CONFIG_FILE} \(W8A16 .*"
                                         "quantize the dense model again"):
        load_model(str(out), device="cpu")
    (out / CONFIG_FILE).write_text(json.dumps({**config, "group_size": 64}))  # 64 / 96
    with pytest.raises(ValueError, match=rf"{CONFIG_FILE} \(W4A16 g64 sym \(rtn\)\) does not "
                                         "fit this model: group_size=64 does not divide .*"
                                         "quantize the dense model again"):
        load_model(str(out), device="cpu")
    (out / CONFIG_FILE).write_text(json.dumps(config))
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_model(str(out), device="cpu")


@pytest.fixture(scope="module")
def gptq_dir(tiny_llama, calib_file, tmp_path_factory):
    """A W4A16 checkpoint with every weight-only tensor: scales, zeros, perm."""
    dense = load_model(str(tiny_llama), device="cpu")
    ids = calibration_ids(dense.tokenizer, str(calib_file), num_samples=2, seq_len=32)
    cfg = quantize_model(dense.model, QuantConfig(method="gptq", group_size=32, symmetric=False,
                                                  act_order=True), ids)
    return save_quantized(dense.model, cfg, tmp_path_factory.mktemp("gptq") / "q", tiny_llama)


@pytest.fixture
def gptq_copy(gptq_dir, tmp_path):
    return shutil.copytree(gptq_dir, tmp_path / "q")


@pytest.mark.parametrize(("fields", "message"), [
    (dict(method="nf4"), "method='nf4' is not supported"),  # the message named no file
    # "false" is true: the error blamed the tensors ("unexpected ['zeros']")
    (dict(symmetric="false"), "symmetric='false' is not true or false"),
    (dict(act_order=1), "act_order=1 is not true or false"),
    # a string of the right length passed; negative scales loaded
    (dict(kv_cache_scales="xy"), "kv_cache_scales='xy' is not a list of"),
    (dict(kv_cache_scales=[[-1.0, 1.0], [1.0, 1.0]]), r"kv_cache_scales=\[\[-1.0, 1.0\], .* "
                                                       "positive numbers"),
    # right shape, wrong count: the message named neither file nor fix
    (dict(kv_cache_scales=[[1.0, 1.0]]), "1 KV-cache scale pairs for 2 attention layers; .*"
                                         "quantize the dense model again"),
])
def test_edited_quant_config_is_named_with_its_field(gptq_copy, fields, message):
    config = json.loads((gptq_copy / CONFIG_FILE).read_text())
    (gptq_copy / CONFIG_FILE).write_text(json.dumps({**config, **fields}))
    with pytest.raises(ValueError, match=f"{CONFIG_FILE}: {message}"):
        load_model(str(gptq_copy), device="cpu")


LAYER = "layers.0.mlp.down_proj"


@pytest.mark.parametrize(("name", "edit", "message"), [
    # integer scales were converted silently
    (f"{LAYER}.scales", lambda t: t.to(torch.int32), r"scales: got \(64, 3\) torch.int32, "
                                                     "expected .* float"),
    # IndexError at the first forward, or channels silently repeated
    (f"{LAYER}.perm", lambda t: t + 1000, "perm is not a permutation of 0..95"),
    (f"{LAYER}.perm", torch.zeros_like, "perm is not a permutation of 0..95"),
    # dequantized to weights far out of range
    (f"{LAYER}.zeros", lambda t: torch.full_like(t, 200), "zeros: 200 is past the 4-bit grid"),
    # a dense tensor beside the codes: converted silently too
    ("norm.weight", lambda t: t > 1, "tensor 'norm.weight' is torch.bool, but this weight is "
                                     "floating-point"),
])
def test_tensor_values_no_quantizer_writes_are_refused(gptq_copy, name, edit, message):
    path = gptq_copy / "model.safetensors"
    tensors = load_file(str(path))
    tensors[name] = edit(tensors[name])
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=message):
        load_model(str(gptq_copy), device="cpu")


def test_quantized_weights_without_their_config_name_the_file(gptq_copy):
    """The dense loader said only that qweight does not belong to the model."""
    (gptq_copy / CONFIG_FILE).unlink()
    with pytest.raises(ValueError, match=f"looks quantized by `kiln quantize`, but {CONFIG_FILE} "
                                         "is missing beside it"):
        load_model(str(gptq_copy), device="cpu")


def test_other_tools_quantization_config_of_any_type_is_refused(tiny_llama, tmp_path):
    hf = shutil.copytree(tiny_llama, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": "fp8"}))
    with pytest.raises(ValueError, match=r"quantized by another tool \(quant_method='fp8'\)"):
        load_model(str(hf), device="cpu")  # was AttributeError: 'str' has no 'get'
