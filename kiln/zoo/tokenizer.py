"""Byte-level BPE tokenizer shared by every zoo model.

Trained once, on the training split only, and saved in Hugging Face format (tokenizer.json plus
a tokenizer_config.json that carries the chat template) so transformers and Kiln load it alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Order fixes the ids: pad=0, bos=1, eos=2 (LlamaConfig's default bos/eos ids), then roles.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)
DEFAULT_VOCAB_SIZE = 8192
# The trainer starts from every byte symbol plus the special tokens and only then learns merges:
# a smaller vocab_size is silently raised to that base, which holds no merge at all.
NUM_BYTE_SYMBOLS = len(pre_tokenizers.ByteLevel.alphabet())  # 256
MIN_VOCAB_SIZE = NUM_BYTE_SYMBOLS + len(SPECIAL_TOKENS) + 1
DEFAULT_MODEL_MAX_LEN = 1024

# Each turn is "<|role|>\n{content}<|eos|>\n"; generation stops at <|eos|>, the model's EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant; got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab size {vocab_size} leaves no room for a BPE merge: the base vocabulary is "
            f"{NUM_BYTE_SYMBOLS} byte symbols + {len(SPECIAL_TOKENS)} special tokens; "
            f"use at least {MIN_VOCAB_SIZE}"
        )


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-split, no normalizer: bytes round-trip)."""
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # encode(text) prepends <bos>, as the model saw at the start of every training document.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def tokenizer_config(model_max_length: int = DEFAULT_MODEL_MAX_LEN) -> dict:
    # Written by hand rather than by transformers' save_pretrained, whose v5 output names a
    # class v4 lacks and moves the chat template into a separate file.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(
    tokenizer: Tokenizer, out_dir: str | Path, model_max_length: int = DEFAULT_MODEL_MAX_LEN
) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """{'pad': id, 'bos': id, 'eos': id}; raises if the tokenizer lacks one."""
    ids = {}
    for name, token in (("pad", PAD_TOKEN), ("bos", BOS_TOKEN), ("eos", EOS_TOKEN)):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token} token")
        ids[name] = token_id
    return ids
