"""Acceptance checks of the committed zoo models: format, Kiln/transformers parity, and the
accuracy figures their model cards state (measured on this machine's standard library)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from typer.testing import CliRunner

from kiln.eval import greedy_agreement, perplexity
from kiln.zoo import ZOO_MODELS, model_path, resolve_model
from kiln.zoo.cli import zoo_app

CI_MAX_TOKENS = 1024  # the figure the cards state as the CI check; see conftest.py
PARAM_RANGE = {"kiln-tiny": (10e6, 25e6), "kiln-tiny-draft": (1e6, 3e6)}
MB = 1_000_000


def card_eval(name: str) -> dict:
    return json.loads((model_path(name) / "eval.json").read_text())


def ci_entry(name: str) -> dict:
    (entry,) = [e for e in card_eval(name)["perplexity"] if e["max_tokens"] == CI_MAX_TOKENS]
    return entry


def logits_fn(loaded):
    return lambda ids: loaded.model.full_logits(ids)


def test_registry_resolves_names_and_passes_paths_through(tmp_path: Path):
    assert set(ZOO_MODELS) == {"kiln-tiny", "kiln-tiny-draft"}
    assert model_path("kiln-tiny").name == "kiln-tiny"
    assert resolve_model("kiln-tiny-draft") == str(model_path("kiln-tiny-draft"))
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("org/model") == "org/model"
    with pytest.raises(KeyError, match="valid: kiln-tiny, kiln-tiny-draft"):
        model_path("kiln-huge")
    listing = CliRunner().invoke(zoo_app, ["list"])
    assert listing.exit_code == 0 and str(model_path("kiln-tiny-draft")) in listing.output


@pytest.mark.parametrize("name", sorted(ZOO_MODELS))
def test_model_dir_is_a_small_bf16_hf_checkpoint(name: str):
    path = model_path(name)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / f).is_file(), f
    for f in ("README.md", "loss.png", "training_log.csv", "training.json", "eval.json"):
        assert (path / f).is_file(), f
    shards = sorted(path.glob("*.safetensors"))
    assert shards and all(s.stat().st_size < 16 * MB for s in shards)
    num_params = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(key)
                assert tensor.dtype == torch.bfloat16, key
                num_params += tensor.numel()
    low, high = PARAM_RANGE[name]
    assert low <= num_params <= high
    config = AutoConfig.from_pretrained(path)
    assert config.max_position_embeddings == 1024 and config.vocab_size == 8192
    assert config.dtype == torch.bfloat16
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|assistant|>" in tok_config["chat_template"]
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2


def test_committed_weights_fit_the_budget():
    total = sum(f.stat().st_size for n in ZOO_MODELS for f in model_path(n).glob("*.safetensors"))
    assert total <= 40 * MB


@pytest.mark.parametrize("fixture", ["kiln_tiny", "kiln_draft"])
def test_kiln_and_transformers_logits_match(fixture, request, heldout_ids):
    loaded = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    ids = heldout_ids[:200].unsqueeze(0)
    with torch.inference_mode():
        expected = hf(ids).logits
    actual = loaded.model.full_logits(ids)
    # Both compute in float32 from the same bf16 weights; the differences are summation order.
    assert (actual - expected).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def tiny_logits_fn(kiln_tiny, heldout_ids):
    # One full-context window covers the CI tokens: compute it once for ppl and agreement.
    full_logits = kiln_tiny.model.full_logits
    cached = full_logits(heldout_ids.unsqueeze(0))
    return lambda ids: cached if torch.equal(ids[0], heldout_ids) else full_logits(ids)


def test_heldout_perplexity_matches_the_card_and_beats_random_init(tiny_logits_fn, heldout_ids):
    result = perplexity(tiny_logits_fn, heldout_ids, window=1024)
    entry = ci_entry("kiln-tiny")
    assert result.num_tokens == entry["tokens_evaluated"] == CI_MAX_TOKENS - 1
    if platform.python_version() != card_eval("kiln-tiny")["python"]:
        pytest.skip("the card was measured on another Python's standard library")
    assert result.perplexity == pytest.approx(entry["perplexity"], rel=0.10)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_path("kiln-tiny"), dtype=torch.float32)
    random_model = LlamaForCausalLM(config).eval()
    with torch.inference_mode():
        random_ppl = perplexity(lambda ids: random_model(ids).logits, heldout_ids, 1024)
    assert random_ppl.perplexity >= 20 * result.perplexity


def test_draft_perplexity_and_agreement_with_tiny(kiln_draft, tiny_logits_fn, heldout_ids):
    result = perplexity(logits_fn(kiln_draft), heldout_ids, window=1024)
    if platform.python_version() == card_eval("kiln-tiny-draft")["python"]:
        assert result.perplexity == pytest.approx(ci_entry("kiln-tiny-draft")["perplexity"], 0.1)
    agreement = greedy_agreement(tiny_logits_fn, logits_fn(kiln_draft), heldout_ids, 1024)
    assert agreement.num_positions == CI_MAX_TOKENS - 1
    assert agreement.fraction >= 0.40
