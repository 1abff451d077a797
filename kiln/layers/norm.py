"""RMSNorm with an optional fused residual add (one pass over memory on the GPU)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.rms_norm import rms_norm
from kiln.kernels.row_quant import RowQuant


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor | None = None,
                quant: RowQuant | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual); a None x
        has been added into the residual already (by the GEMM before, Linear's ``residual``):
        (norm(residual), residual). With ``quant`` (what the linear layer after the norm asks
        for) norm(...) comes as codes."""
        if x is None:
            return rms_norm(residual, self.weight, self.eps, quant=quant), residual
        return rms_norm(x, self.weight, self.eps, residual, quant)
