from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kiln.zoo import corpus
from kiln.zoo.tokenizer import (
    BOS_TOKEN,
    SPECIAL_TOKENS,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)
from kiln.zoo.train import DEFAULT_TOKENIZER_DIR

MODELS_DIR = Path(DEFAULT_TOKENIZER_DIR).parent
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x):\n        self.x = x  # café\n",
] * 20


@pytest.fixture(scope="module")
def small_tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300)


def test_special_tokens_have_fixed_ids(small_tokenizer):
    assert [small_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(6))
    assert special_ids(small_tokenizer) == {"pad": 0, "bos": 1, "eos": 2}


def test_byte_level_round_trip_and_bos(small_tokenizer):
    text = "    if x:\n\treturn 'naïve 中文 🙂'\r\n"  # bytes never seen in training
    enc = small_tokenizer.encode(text)
    assert enc.ids[0] == small_tokenizer.token_to_id(BOS_TOKEN)
    assert small_tokenizer.decode(enc.ids, skip_special_tokens=True) == text
    assert small_tokenizer.encode(text, add_special_tokens=False).ids == enc.ids[1:]


def test_saved_tokenizer_loads_in_transformers_with_chat_template(small_tokenizer, tmp_path):
    save_tokenizer(small_tokenizer, tmp_path, model_max_length=64)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] and config["model_max_length"] == 64
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf("x = 1").input_ids[0] == 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nhi<|eos|>\n<|assistant|>\n"
    with pytest.raises(Exception, match="roles are system, user and assistant"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_zoo_tokenizer_is_shared_and_fits_held_out_code():
    tiny = (MODELS_DIR / "kiln-tiny" / "tokenizer.json").read_bytes()
    assert (MODELS_DIR / "kiln-tiny-draft" / "tokenizer.json").read_bytes() == tiny
    tokenizer = load_tokenizer(MODELS_DIR / "kiln-tiny")
    assert tokenizer.get_vocab_size() == 8192
    text = corpus.read_files("heldout", max_files=1)[0].text
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    # A code-trained BPE packs Python at well over 3 bytes per token.
    assert len(text.encode()) / len(ids) > 3.0
