"""The architecture description Kiln needs, read from a Hugging Face ``config.json``.

Parsed from the raw JSON rather than through transformers' config classes so that checkpoints
written by transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``)
load the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# architecture name in config.json -> the variant flags of the one Llama-family implementation
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qk_norm": False},
    "MistralForCausalLM": {"qk_norm": False},
    "Qwen2ForCausalLM": {"qk_norm": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# rope types transformers implements that Kiln refuses, and why
UNSUPPORTED_ROPE = {
    "longrope": "transformers switches every position between short_factor and long_factor by "
                "the length of the whole sequence, which a cached, per-position table cannot "
                "reproduce",
}
# Activations transformers' ACT2FN computes as SiLU (the only MLP activation Kiln has)
SILU_NAMES = ("silu", "swish")
# config.json fields read as sizes (positive integers; null: the default, for sliding_window no
# window) and as flags (JSON booleans): a string or a 0 there failed deep inside the model build,
# and bool("false") is True
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
               "sliding_window")
FLAG_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only (transformers' defaults); attention_factor scales cos and sin
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # per layer: its sliding window (a query sees itself and window - 1 keys before it), or
    # None where it attends to every earlier key
    layer_windows: tuple[int | None, ...]
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_config(cfg: dict[str, Any], source: str = "config.json") -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); 4.x writes rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise ValueError(f"{source}: rope parameters given per layer type ({', '.join(nested)}) "
                         "are not supported: Kiln's Llama family has one rotary embedding for all "
                         "layers; give a single rope_parameters dict")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        why = UNSUPPORTED_ROPE.get(rope_type, "Kiln does not implement it")
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported ({why}); Kiln "
                         f"supports {', '.join(ROPE_TYPES)}. Run this checkpoint with "
                         "transformers, or drop its rope scaling from config.json only if the "
                         "model is meant to run without it")
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
    if partial != 1.0 and rope_type != "default":
        # transformers' default Llama rotary ignores it; every scaled type would rotate a part
        raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported: Kiln's "
                         "Llama family rotates the whole head")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # transformers: a top-level original_max_position_embeddings wins, then the rope dict's, then
    # max_position_embeddings
    original = int(cfg.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_pos / original
    factor = float(1.0 if factor is None else factor)
    attention_factor = 1.0
    if rope_type == "yarn":
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else _yarn_mscale(factor))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _layer_windows(arch: str, cfg: dict[str, Any], num_layers: int,
                   source: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers decides it (None: the layer does not slide)."""
    full = (None,) * num_layers
    if arch == "MistralForCausalLM":  # every layer; MistralConfig's default is 4096
        window = cfg.get("sliding_window", 4096)
        return (int(window),) * num_layers if window else full
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # only with use_sliding_window, and only the layers layer_types (by default: those from
        # max_window_layers on) marks as sliding
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        if not window:
            return full
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else
            "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"{source}: layer_types names {len(layer_types)} layers but "
                             f"num_hidden_layers={num_layers}; fix it from the model's original "
                             "config.json")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return full


def _as_id_tuple(value: Any, key: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else value
    # a string would be read digit by digit: "12" as the ids 1 and 2
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):
        raise ValueError(f"{source}: {key}={value!r} is not a token id or a list of them; fix "
                         "it from the model's original config.json")
    return tuple(ids)


def _check_field_types(cfg: dict[str, Any], source: str) -> None:
    for key in SIZE_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            raise ValueError(f"{source}: {key}={value!r} is not a positive integer; fix it from "
                             "the model's original config.json")
    for key in FLAG_FIELDS:
        if key in cfg and not isinstance(cfg[key], bool):
            raise ValueError(f"{source}: {key}={cfg[key]!r} is not true or false; fix it from "
                             "the model's original config.json")


def arch_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
    """Validate a config.json dict and return the architecture Kiln will build."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(cfg).__name__}; a Hugging "
                         "Face config.json is one")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):  # a bare string would be searched letter by letter
        raise ValueError(f"{source}: architectures={archs!r} is not a list; write it as "
                         f"[{archs!r}]".replace("'", '"'))
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(
            f"{source}: architecture {archs or '(none given)'} is not supported; Kiln supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = supported[0]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if cfg.get(key) is None:
            raise ValueError(f"{source}: missing required field {key!r}")
    _check_field_types(cfg, source)
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    # Qwen3Config's head_dim defaults to 128, the others' to hidden_size / num_attention_heads
    default_head_dim = 128 if arch == "Qwen3ForCausalLM" else int(cfg["hidden_size"]) // num_heads
    head_dim = int(cfg.get("head_dim") or default_head_dim)
    act = cfg.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"{source}: hidden_act={act!r} is not supported: Kiln's MLP computes "
                         f"silu(gate) * up ({arch} checkpoints use hidden_act='silu')")
    attention_bias = bool(cfg.get("attention_bias", False))
    # biases as each family's transformers module builds them (it ignores the other keys)
    if arch == "Qwen2ForCausalLM":  # always q/k/v bias, never o or MLP bias
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif arch == "MistralForCausalLM":  # no bias anywhere
        qkv_bias, o_bias, mlp_bias = False, False, False
    elif arch == "Qwen3ForCausalLM":  # attention_bias covers all four, no MLP bias
        qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, False
    else:  # Llama: attention_bias covers all four, mlp_bias all three
        qkv_bias = o_bias = attention_bias
        mlp_bias = bool(cfg.get("mlp_bias", False))
    num_layers = int(cfg["num_hidden_layers"])
    return ArchConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=_rope_from_config(cfg, source),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        layer_windows=_layer_windows(arch, cfg, num_layers, source),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id"), "eos_token_id", source),
    )
