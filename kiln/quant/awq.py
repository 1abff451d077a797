"""AWQ: activation-aware weight quantization (Lin et al., 2023).

Channels that see large activations matter most, so they are scaled up before rounding:

    y = (x / s) Q(W diag(s))^T,   s_k = mean|x_k|^a / sqrt(max_j s_j min_j s_j),

with a in [0, 1) chosen by grid search to minimize || x W^T - (x / s) Q(W s)^T ||^2 on
calibration rows. Then, as AutoAWQ does, each group's range is clipped by the ratio in
[0.5, 1] that minimizes that group's contribution to the output error. 1 / s becomes the
format's ``smooth`` vector, applied where the kernel reads x (no other layer changes).
"""

from __future__ import annotations

import torch

from kiln.quant.rtn import IntWeight, fake_quantize, rtn_quantize

GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 ... 0.5


def _output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((x @ (w - w_hat).t()).pow(2).mean())


def search_scales(w: torch.Tensor, x: torch.Tensor, x_mean_abs: torch.Tensor, bits: int,
                  group_size: int, symmetric: bool, grid: int = GRID) -> torch.Tensor:
    """The per-input-channel scale s [K] (s = 1 is plain RTN, always a candidate)."""
    best_err, best_s = float("inf"), torch.ones_like(x_mean_abs)
    for i in range(grid):
        s = x_mean_abs.clamp_min(1e-4).pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()
        w_hat = fake_quantize(w * s, bits, group_size, symmetric) / s
        err = _output_error(x, w, w_hat)
        if err < best_err:
            best_err, best_s = err, s
    return best_s


def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int,
                symmetric: bool, chunk: int = 1024) -> torch.Tensor:
    """Per (row, group) clip ratio [N, G] minimizing E_t (x_g . (w_g - w_hat_g))^2."""
    n, k = w.shape
    gs = k if group_size <= 0 else group_size
    xg = x.reshape(x.shape[0], k // gs, gs)  # [T, G, gs]
    best = torch.ones(n, k // gs, device=w.device)
    for r0 in range(0, n, chunk):  # rows in chunks bound the [T, rows, G] error tensor
        wc = w[r0 : r0 + chunk]
        best_err = torch.full((wc.shape[0], k // gs), float("inf"), device=w.device)
        for ratio in CLIP_RATIOS:
            dw = (wc - fake_quantize(wc, bits, group_size, symmetric, ratio)).reshape(
                wc.shape[0], k // gs, gs)
            err = torch.einsum("tgk,ngk->tng", xg, dw).pow(2).mean(0)  # [rows, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best[r0 : r0 + chunk] = torch.where(better, ratio, best[r0 : r0 + chunk])
    return best


def awq_quantize(w: torch.Tensor, x: torch.Tensor, x_mean_abs: torch.Tensor, bits: int,
                 group_size: int, symmetric: bool, scale_dtype: torch.dtype = torch.float32,
                 clip: bool = True) -> IntWeight:
    """w [N, K] dense, x [T, K] calibration inputs, x_mean_abs [K] -> IntWeight with smooth."""
    w, x, x_mean_abs = w.float(), x.float(), x_mean_abs.float().to(w.device)
    s = search_scales(w, x, x_mean_abs, bits, group_size, symmetric)
    ws, xs = w * s, x / s
    ratio = search_clip(ws, xs, bits, group_size, symmetric) if clip else 1.0
    q = rtn_quantize(ws, bits, group_size, symmetric, scale_dtype, clip=ratio)
    q.smooth = 1.0 / s
    return q
