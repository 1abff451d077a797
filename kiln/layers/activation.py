"""Gated MLP activation."""

from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * I] -> [..., I]
        return silu_and_mul(x)
