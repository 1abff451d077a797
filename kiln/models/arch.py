"""The architecture description Kiln needs, read from a Hugging Face ``config.json``.

Parsed from the raw JSON rather than through transformers' config classes so that checkpoints
written by transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``)
load the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# architecture name in config.json -> the variant flags of the one Llama-family implementation
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qk_norm": False},
    "MistralForCausalLM": {"qk_norm": False},
    "Qwen2ForCausalLM": {"qk_norm": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
}

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_from_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); 4.x writes rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def arch_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
    """Validate a config.json dict and return the architecture Kiln will build."""
    archs = cfg.get("architectures") or []
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(
            f"{source}: architecture {archs or '(none given)'} is not supported; Kiln supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = supported[0]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in cfg:
            raise ValueError(f"{source}: missing required field {key!r}")
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
    return ArchConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=_rope_from_config(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and no o bias; Llama's attention_bias covers all four
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
    )
