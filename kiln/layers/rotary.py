"""Rotary position embedding: the cos/sin table (with linear / llama3 / yarn scaling).

Each scaling reproduces transformers' ``modeling_rope_utils`` for the positions Kiln serves.
``dynamic`` NTK scaling leaves the frequencies unchanged up to ``max_position_embeddings`` (it
only rescales past it, which Kiln never computes), so its table is the default one.

The attention front-end applies it (kiln/layers/attention.py), fused with the KV-cache write.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kiln.models.arch import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], scaled as the checkpoint's rope type says."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                     / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between is interpolated smoothly (Meta's reference implementation).
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope)
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times are kept,
    with a linear ramp between (transformers' ``_compute_yarn_parameters``)."""
    base, orig = rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    # 0: keep the frequency, 1: divide it by factor
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim]: cos in the first half, sin in the second (kernel contract);
        # yarn's attention factor scales both (so q.k by its square, as in transformers)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if rope.attention_factor != 1.0:
            table = table * rope.attention_factor
        self.register_buffer("cos_sin_cache", table, persistent=False)
