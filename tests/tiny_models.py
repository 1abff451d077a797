"""Small random Hugging Face checkpoints built locally with transformers (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 320
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# variant -> (config class, model class, extra config fields)
VARIANTS = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM",
               dict(num_key_value_heads=4, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0})),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM",
                 dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=False)),
}

CORPUS = ("def fibonacci(n):\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
          "Unicode: café, naïve, 中文, emoji 🙂. "
          "The quick brown fox jumps over the lazy dog.\n") * 4


def build_tokenizer(path: Path) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(str(path))
    return fast


# head_dim 64: the smallest geometry the Triton attention kernels take (GQA ratio 4)
TRITON_GEOMETRY = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4,
                       num_key_value_heads=1)


def build_model(variant: str, path: Path, seed: int = 0, tokenizer: bool = True,
                **overrides) -> Path:
    """Save a random ``variant`` checkpoint (float32) with a tokenizer into ``path``."""
    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF inits norms to 1; random norms exercise the weight mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer:
        build_tokenizer(path)
    return path
