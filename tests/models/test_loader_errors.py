"""Bad checkpoints and bad options fail with errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kiln
from kiln.models import load_model


@pytest.fixture
def model_copy(tiny_llama, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def test_unknown_architecture_lists_supported(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(model_copy), device="cpu")


def _shard(model_copy) -> tuple[str, str]:
    """Split model.safetensors into two shards with an index; return the shard names."""
    tensors = load_file(str(model_copy / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(model_copy / file))
    (model_copy / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    return tuple(halves)


def test_sharded_checkpoint_loads_and_matches(model_copy, tiny_llama):
    _shard(model_copy)
    ids = torch.tensor([[5, 9, 17, 40]])
    sharded = load_model(str(model_copy), dtype="float32", device="cpu").model.full_logits(ids)
    single = load_model(str(tiny_llama), dtype="float32", device="cpu").model.full_logits(ids)
    assert torch.equal(sharded, single)


def test_missing_shard_names_the_file(model_copy):
    _, second = _shard(model_copy)
    (model_copy / second).unlink()
    with pytest.raises(FileNotFoundError, match=second):
        load_model(str(model_copy), device="cpu")


def test_wrong_shape_names_file_and_tensor(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.randn(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"model\.safetensors.*down_proj\.weight.*shape"):
        load_model(str(model_copy), device="cpu")


def test_missing_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="missing 1 tensor.*layers.0.self_attn.k_proj.weight"):
        load_model(str(model_copy), device="cpu")


def test_truncated_file_is_reported(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        load_model(str(model_copy), device="cpu")


def test_pickled_weights_are_refused(model_copy):
    (model_copy / "model.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickled weights are never loaded"):
        load_model(str(model_copy), device="cpu")


def test_dtype_as_a_torch_dtype(tiny_llama):
    llm = kiln.LLM(str(tiny_llama), dtype=torch.float32, device="cpu", num_kv_blocks=64)
    assert llm.engine.loaded.dtype == torch.float32


def test_unknown_dtype_string(tiny_llama):
    with pytest.raises(ValueError, match="dtype='float8'.*bfloat16"):
        kiln.LLM(str(tiny_llama), dtype="float8", device="cpu")


def test_unknown_engine_option(tiny_llama):
    with pytest.raises(TypeError, match="unknown engine option 'blocksize'.*block_size"):
        kiln.LLM(str(tiny_llama), device="cpu", blocksize=16)


@pytest.mark.parametrize("value", ["512", True])
def test_engine_option_of_the_wrong_type_names_itself(tiny_llama, value):
    """A size read from a file as text (or a flag as a bool) is named, not a bare comparison
    error from deep inside the engine."""
    with pytest.raises(TypeError, match=f"max_model_len must be a number > 0, got {value!r}"):
        kiln.LLM(str(tiny_llama), device="cpu", max_model_len=value)


def test_empty_prompt(tiny_llama):
    llm = kiln.LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])


def test_offline_hub_id_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="could not download 'kiln-org/absent'.*HF_HUB_OFFLINE"):
        load_model("kiln-org/absent", device="cpu")


def test_dummy_load_needs_only_config(model_copy):
    (model_copy / "model.safetensors").unlink()
    loaded = load_model(str(model_copy), device="cpu", load_format="dummy")
    logits = loaded.model.full_logits(torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_missing_tokenizer_json_says_which_file(model_copy):
    """tokenizer_config.json without tokenizer.json: transformers' message is about converting
    slow tokenizers; Kiln's names the file to copy."""
    assert (model_copy / "tokenizer_config.json").is_file()
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer does not load .*tokenizer\.json"):
        load_model(str(model_copy), device="cpu")


@pytest.mark.parametrize("where", ["../outside.safetensors", "absolute"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(model_copy, where):
    """Path traversal: the index made Kiln read weights from anywhere on the machine."""
    _, second = _shard(model_copy)
    outside = model_copy.parent / "outside.safetensors"
    (model_copy / second).rename(outside)
    name = str(outside) if where == "absolute" else where
    index_path = model_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: name if f == second else f for k, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"lists shard '{name}', which is not a file inside"):
        load_model(str(model_copy), device="cpu")


@pytest.mark.parametrize("text", ["[]", "{}", '{"weight_map": ["a"]}', '{"weight_map": {"x": 3}}'])
def test_damaged_index_is_named(model_copy, text):
    """Used to crash with AttributeError / TypeError, or ({}) report every tensor missing."""
    _shard(model_copy)
    (model_copy / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match="index.json has no weight_map object .*download it "
                                         "again"):
        load_model(str(model_copy), device="cpu")


def test_tensor_in_two_shards_is_refused(model_copy):
    """The copy in the later file won silently, whatever it held."""
    first, second = _shard(model_copy)
    moved = load_file(str(model_copy / second))
    name = sorted(moved)[0]
    stale = {**load_file(str(model_copy / first)), name: torch.zeros_like(moved[name])}
    save_file(stale, str(model_copy / first))
    with pytest.raises(ValueError, match=f"tensor '{name}' is in both {first} and {second}"):
        load_model(str(model_copy), device="cpu")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_integer_tensor_where_a_float_weight_belongs_is_refused(model_copy, dtype):
    """Used to be converted to float and loaded (codes of another tool's format as weights)."""
    path = model_copy / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = (tensors[name] * 100).to(dtype)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=f"tensor '{name}' is {dtype}, but this weight is "
                                         "floating-point"):
        load_model(str(model_copy), device="cpu")
