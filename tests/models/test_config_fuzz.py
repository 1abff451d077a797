"""Config options of the Llama family against transformers, float32 on CPU.

A seeded fuzz of small random configs per family (GQA/MQA, explicit head_dim, biases, tied
embeddings, every rope type Kiln implements, 16-bit and sharded checkpoints), then regression
tests for options that were computed wrong or crashed: sliding windows (Qwen2/Qwen3's
use_sliding_window was ignored; each layer gets its own window or none), yarn and
dynamic rope, llama3's default original context, per-family bias keys, hidden_act, and
checkpoint tensors that fit no parameter.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import kiln
from kiln.models import load_model
from kiln.models.arch import arch_from_hf_config

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def save_hf(family: str, path, seed: int = 0, dtype: torch.dtype = torch.float32,
            max_shard_size: str | None = None, **fields):
    """A random checkpoint of ``family``; norms and biases random too (HF zeroes biases)."""
    config_cls, model_cls = FAMILIES[family]
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3":
        base["head_dim"] = 8  # Qwen3Config's default is 128
    config = getattr(transformers, config_cls)(**{**base, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0, 0.1)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(str(path), **kw)
    return path


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return ref.eval()(ids).logits


def max_rel_err(path, ids: torch.Tensor) -> float:
    got = load_model(str(path), dtype="float32", device="cpu").model.full_logits(ids)
    expected = hf_logits(path, ids)
    # float32 noise grows with the logits: judge the error against their size
    return (got - expected).abs().max().item() / max(1.0, expected.abs().max().item() / 10)


def assert_greedy_matches_transformers(llm: kiln.LLM, path, prompt: list[int],
                                       max_tokens: int) -> None:
    """The engine's greedy continuation (cached decode) equals transformers' generate."""
    out = llm.generate([prompt], kiln.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    expected = ref.eval().generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                   do_sample=False, min_new_tokens=max_tokens, pad_token_id=0,
                                   eos_token_id=None)
    assert out[0].outputs[0].token_ids == expected[0, len(prompt):].tolist()


def edit_config(path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def random_rope(rng: random.Random, head_dim: int) -> dict:
    rope_type = rng.choice(["default", "linear", "llama3", "yarn", "dynamic"])
    rope = {"rope_type": rope_type, "rope_theta": rng.choice([100.0, 10000.0, 1e6])}
    if rope_type in ("linear", "dynamic"):
        rope["factor"] = rng.choice([2.0, 4.0])
    elif rope_type == "llama3":
        rope.update(factor=8.0, low_freq_factor=rng.choice([1.0, 2.0]),
                    high_freq_factor=rng.choice([4.0, 8.0]),
                    original_max_position_embeddings=16)
    elif rope_type == "yarn":
        rope.update(factor=rng.choice([2.0, 4.0]), original_max_position_embeddings=16)
        if rng.random() < 0.5:
            rope.update(beta_fast=16.0, beta_slow=2.0)
    return rope


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("seed", range(4))
def test_random_configs_match_transformers(family, seed, tmp_path):
    rng = random.Random(f"{family}-{seed}")
    heads = rng.choice([1, 2, 4, 8])
    kv = heads // rng.choice([r for r in (1, 2, 4, heads) if heads % r == 0])
    fields = dict(num_attention_heads=heads, num_key_value_heads=kv,
                  hidden_size=heads * rng.choice([8, 16]),
                  vocab_size=rng.choice([61, 97, 130]), num_hidden_layers=rng.choice([1, 2]),
                  rms_norm_eps=rng.choice([1e-6, 1e-2]),
                  tie_word_embeddings=rng.random() < 0.5)
    if rng.random() < 0.5 or family == "qwen3":  # head_dim other than hidden / heads
        fields["head_dim"] = rng.choice([8, 12, 24])
    head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
    fields["rope_parameters"] = random_rope(rng, head_dim)
    if family == "llama":
        fields.update(attention_bias=rng.random() < 0.5, mlp_bias=rng.random() < 0.5)
    if family == "qwen3":
        fields["attention_bias"] = rng.random() < 0.5
    if family == "mistral":
        fields["sliding_window"] = None
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    path = save_hf(family, tmp_path / "m", seed, dtype,
                   "8KB" if rng.random() < 0.5 else None, **fields)
    # 40 tokens: past the scaled types' original context of 16
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, fields["vocab_size"], (2, 40), generator=gen)
    assert max_rel_err(path, ids) <= 1e-4, fields


@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_dim_defaults_like_transformers_when_config_omits_it(family):
    """Qwen3Config's default is 128, not hidden_size / num_attention_heads."""
    config_cls, model_cls = FAMILIES[family]
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
               vocab_size=10, intermediate_size=8, architectures=[model_cls])
    expected = getattr(getattr(transformers, config_cls)(**cfg), "head_dim", None) or 64 // 4
    assert arch_from_hf_config(cfg).head_dim == expected


# --- sliding windows ---------------------------------------------------------------------------

SLIDING_CASES = [  # (family, config fields)
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),  # none slide
    ("qwen2", dict(use_sliding_window=False, sliding_window=8, max_window_layers=0)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    ("mistral", dict(sliding_window=8)),
    ("mistral", dict(sliding_window=None)),
]


@pytest.mark.parametrize(("family", "fields"), SLIDING_CASES)
def test_sliding_window_is_read_as_transformers_applies_it(family, fields):
    config_cls, model_cls = FAMILIES[family]
    config = getattr(transformers, config_cls)(num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, hidden_size=32,
                                               architectures=[model_cls],
                                               **fields)
    # Mistral has no layer_types: every layer slides
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * 2
    expected = tuple(config.sliding_window if t == "sliding_attention" else None
                     for t in layer_types)
    assert arch_from_hf_config(config.to_dict()).layer_windows == expected


def test_mistral_without_sliding_window_key_gets_transformers_default():
    cfg = transformers.MistralConfig(num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2,
                                     architectures=["MistralForCausalLM"]).to_dict()
    cfg.pop("sliding_window")
    assert arch_from_hf_config(cfg).layer_windows == (transformers.MistralConfig().sliding_window,)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral"])
def test_sliding_model_is_exact_past_its_window(family, tmp_path):
    """Full logits and the engine's greedy decode over 4 windows (tests/models/
    test_sliding_window.py covers chunks, prefix caching and logprobs)."""
    fields = (dict(sliding_window=8) if family == "mistral" else
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))
    path = save_hf(family, tmp_path / "m", **fields)
    ids = torch.randint(3, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    assert max_rel_err(path, ids) <= 1e-4
    # the engine serves the model's positions (it used to stop at the window)
    llm = kiln.LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    assert llm.max_model_len == 64
    assert_greedy_matches_transformers(llm, path, [5, 9, 17, 40, 8, 3, 60, 11, 12, 13], 20)


def test_full_logits_past_the_rotary_table_is_a_clear_error(tmp_path):
    path = save_hf("llama", tmp_path / "m", max_position_embeddings=16)
    model = load_model(str(path), dtype="float32", device="cpu").model
    with pytest.raises(ValueError, match="17 tokens is longer than the model's 16 positions"):
        model.full_logits(torch.randint(3, 97, (1, 17)))


# --- rope ----------------------------------------------------------------------------------------

YARN = [
    dict(factor=4.0, original_max_position_embeddings=16),
    dict(factor=2.0, original_max_position_embeddings=16, beta_fast=8.0, beta_slow=2.0),
    dict(factor=4.0, original_max_position_embeddings=16, attention_factor=1.3),
    dict(factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.5),
    dict(factor=4.0, original_max_position_embeddings=16, truncate=False),
]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("params", YARN, ids=lambda p: "-".join(sorted(p)))
def test_yarn_matches_transformers_past_the_original_context(family, params, tmp_path):
    path = save_hf(family, tmp_path / "m",
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **params})
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    assert max_rel_err(path, ids) <= 1e-4


def test_yarn_greedy_decode_matches_transformers(tmp_path):
    """The cached decode path reads the same scaled table (attention factor included)."""
    path = save_hf("qwen3", tmp_path / "m", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16})
    prompt = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = kiln.LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    assert_greedy_matches_transformers(llm, path, prompt, 8)


def test_dynamic_rope_matches_transformers_up_to_max_positions(tmp_path):
    path = save_hf("llama", tmp_path / "m", max_position_embeddings=32,
                   rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    assert max_rel_err(path, torch.randint(0, 97, (2, 32))) <= 1e-4
    # past max_position_embeddings transformers rescales: Kiln's table stops there, whatever
    # max_model_len asks for
    model = load_model(str(path), dtype="float32", device="cpu", max_model_len=64).model
    with pytest.raises(ValueError, match="longer than the model's 32 positions"):
        model.full_logits(torch.randint(0, 97, (1, 33)))


def test_llama3_original_context_defaults_like_transformers(tmp_path):
    """A config without original_max_position_embeddings: transformers uses
    max_position_embeddings (Kiln used 8192); a top-level one wins over the rope dict's."""
    path = save_hf("llama", tmp_path / "m", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_parameters"]["original_max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(3))
    assert max_rel_err(path, ids) <= 1e-4
    edit_config(path, original_max_position_embeddings=16)
    assert load_model(str(path), device="cpu").arch.rope.original_max_position_embeddings == 16
    assert max_rel_err(path, ids) <= 1e-4


def test_transformers_4_config_format_loads_the_same(tmp_path):
    """rope_theta beside rope_scaling with the old "type" key, as transformers 4.x wrote it."""
    path = save_hf("llama", tmp_path / "m", rope_parameters={
        "rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0,
        "original_max_position_embeddings": 16})
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(cfg))
    assert max_rel_err(path, torch.randint(0, 97, (2, 40))) <= 1e-4


# --- options Kiln refuses --------------------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path):
    return save_hf("llama", tmp_path / "m")


@pytest.mark.parametrize(("fields", "message"), [
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                           "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}),
     r"rope type 'longrope' is not supported \(transformers switches"),
    (dict(rope_parameters={"rope_type": "made-up", "rope_theta": 1e4}),
     "rope type 'made-up' is not supported .*supports default, linear, llama3, yarn"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope parameters given per layer type"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                           "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5 is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
])
def test_unsupported_option_is_refused_by_name(llama_dir, fields, message):
    edit_config(llama_dir, **fields)
    with pytest.raises(ValueError, match=message):
        load_model(str(llama_dir), device="cpu")


@pytest.mark.parametrize(("family", "fields"), [
    ("mistral", dict(attention_bias=True, mlp_bias=True)),  # MistralForCausalLM has no bias
    ("qwen2", dict(attention_bias=True, mlp_bias=True)),  # q/k/v bias only, always
    ("qwen3", dict(mlp_bias=True)),  # attention_bias only
])
def test_bias_keys_a_family_ignores_are_ignored(family, fields, tmp_path):
    """Used to demand bias tensors transformers never creates: 'checkpoint is missing'."""
    path = save_hf(family, tmp_path / "m", **fields)
    assert max_rel_err(path, torch.randint(0, 97, (1, 12))) <= 1e-4


@pytest.mark.parametrize(("name", "shape"), [
    ("model.layers.0.self_attn.q_proj.bias", (32,)),  # a bias this config has not
    ("model.layers.0.self_attn.o_proj.bias", (32,)),
    ("lm_head.bias", (97,)),
    ("model.layers.0.self_attn.qkv_proj.weight", (64, 32)),  # Kiln's merged name
    ("model.layers.1.mlp.gate_up_proj.weight", (96, 32)),
    ("model.norm.eps", ()),  # an attribute, not a parameter
])
def test_tensor_that_fits_no_parameter_is_named(llama_dir, name, shape):
    """Used to crash (AttributeError / IndexError) or, for a merged name of the right shape,
    load it over q/k (or gate/up) silently."""
    tensors = load_file(str(llama_dir / "model.safetensors"))
    tensors[name] = torch.zeros(shape)
    save_file(tensors, str(llama_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' does not belong"):
        load_model(str(llama_dir), device="cpu")


def test_embedding_of_the_wrong_rank_is_named(llama_dir):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = torch.zeros(97)
    save_file(tensors, str(llama_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"embed_tokens\.weight.*shape \(97,\) does not fit"):
        load_model(str(llama_dir), device="cpu")


def test_sharded_16bit_checkpoint_with_index(tmp_path):
    path = save_hf("qwen3", tmp_path / "m", dtype=torch.bfloat16, max_shard_size="4KB",
                   tie_word_embeddings=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert max_rel_err(path, torch.randint(0, 97, (2, 20))) <= 1e-4


@pytest.mark.parametrize(("fields", "message"), [
    # a string was searched letter by letter: "LlamaForCausalLM is not supported; Kiln supports
    # LlamaForCausalLM"
    (dict(architectures="LlamaForCausalLM"),
     r"architectures=\"LlamaForCausalLM\" is not a list; write it as \[\"LlamaForCausalLM\"\]"),
    # TypeError / ZeroDivisionError from int(), or a shape error far from the cause
    (dict(hidden_size=None), "missing required field 'hidden_size'"),
    (dict(num_attention_heads=0), "num_attention_heads=0 is not a positive integer"),
    (dict(num_hidden_layers=-1), "num_hidden_layers=-1 is not a positive integer"),
    (dict(intermediate_size="96"), "intermediate_size='96' is not a positive integer"),
    (dict(max_position_embeddings=0), "max_position_embeddings=0 is not a positive integer"),
    # a window of no keys leaves a query nothing to attend to
    (dict(sliding_window=0), "sliding_window=0 is not a positive integer"),
    # bool("false") is True: the LM head was silently replaced by the embedding
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false' is not true or false"),
    # "12" was read as the token ids 1 and 2
    (dict(eos_token_id="12"), "eos_token_id='12' is not a token id or a list of them"),
])
def test_config_field_of_the_wrong_type_is_named(llama_dir, fields, message):
    cfg = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**cfg, **fields}))  # None: JSON null
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        load_model(str(llama_dir), device="cpu")


def test_layer_types_for_another_layer_count_is_named():
    cfg = dict(architectures=["Qwen2ForCausalLM"], vocab_size=10, hidden_size=32,
               intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
               use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 3)
    with pytest.raises(ValueError, match="layer_types names 3 layers but num_hidden_layers=2"):
        arch_from_hf_config(cfg)


def test_config_that_is_not_an_object_is_named(llama_dir):
    (llama_dir / "config.json").write_text("[]")  # was AttributeError: 'list' has no 'get'
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        load_model(str(llama_dir), device="cpu")
