"""GPTQ: Hessian-based error compensation (Frantar et al., 2022).

Columns are rounded one at a time; the rounding error of column j is spread over the columns
not yet rounded so as to minimize the layer's output error ||X W^T - X W_hat^T||^2, whose
Hessian is H = 2 X^T X:

    e = (w_j - q(w_j)) / [H^-1]_jj,      w_{j+1:} -= e [H^-1]_{j, j+1:}

using the upper Cholesky factor of H^-1 (columns processed in blocks, lazy updates of the rest).
Group scales are fixed when the first column of a group is reached, from the already-updated
weights. With ``act_order`` columns go by decreasing H_jj (most sensitive first); they are then
*stored* in that order, so groups stay contiguous, and the kernel gathers x through ``perm``.
"""

from __future__ import annotations

import torch

from kiln.quant.rtn import IntWeight, int_qparams

DAMP = 0.01  # fraction of mean(diag H) added to the diagonal (keeps H invertible)
BLOCK = 128


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
           bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    z = zero if zero is not None else 2.0 ** (bits - 1)
    u = (torch.round(w / scale) + z).clamp(0, 2**bits - 1)
    return u, (u - z) * scale


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  symmetric: bool, act_order: bool = False, damp: float = DAMP,
                  scale_dtype: torch.dtype = torch.float32) -> IntWeight:
    """w [N, K] dense, hessian [K, K] (2 X^T X / n) -> IntWeight (perm set with act_order)."""
    n, k = w.shape
    gs = k if group_size <= 0 else group_size
    if k % gs:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    if BLOCK % gs and gs != k:
        raise ValueError(f"group_size={group_size} must divide GPTQ's block of {BLOCK}")
    W = w.float().clone()
    H = hessian.float().clone().to(W.device)
    dead = torch.diag(H) == 0  # channels never active: any value works, zero them
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(k, device=W.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(n, k, device=W.device)
    scales = torch.zeros(n, k // gs, device=W.device)
    zeros = None if symmetric else torch.zeros(n, k // gs, device=W.device)
    scale = zero = None
    block = min(BLOCK, k) if gs == k else BLOCK
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:  # a new group: its grid comes from the updated weights
                g_end = col + gs - i1
                src = W1[:, i:g_end] if g_end <= W1.shape[1] else W[:, col : col + gs]
                s, z = int_qparams(src, bits, -1, symmetric, scale_dtype=scale_dtype)
                scale, zero = s[:, 0], (z[:, 0] if z is not None else None)
                scales[:, col // gs] = scale
                if zeros is not None:
                    zeros[:, col // gs] = zero
            u, q = _round(W1[:, i], scale, zero, bits)
            codes[:, col] = u
            err = (W1[:, i] - q) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return IntWeight(codes.to(torch.uint8), scales.to(scale_dtype),
                     zeros.to(torch.uint8) if zeros is not None else None, bits, group_size,
                     perm=perm.to(torch.int32) if perm is not None else None)
