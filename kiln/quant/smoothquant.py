"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8.

    s_k = max|x_k|^alpha / max_n |W_nk|^(1 - alpha),    y = (x / s) (W diag(s))^T

alpha = 0 leaves activations alone, alpha = 1 moves all of their range into the weights; 0.5
balances both (the paper's default for most models). 1 / s is the format's ``smooth`` vector,
applied in the activation quantization kernel, so the preceding layers are not modified.
"""

from __future__ import annotations

import torch


def smooth_scales(act_abs_max: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-input-channel s [K] from calibrated max|x_k| [K] and the weight [N, K]."""
    a = act_abs_max.float().to(w.device).clamp_min(1e-5)
    wmax = w.float().abs().amax(0).clamp_min(1e-5)
    return (a.pow(alpha) / wmax.pow(1 - alpha)).clamp_min(1e-5)
