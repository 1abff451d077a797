"""Rotary position embedding, NeoX / Hugging Face `rotate_half` layout.

For a token at position p, with c = cache[p, :R/2] (cos) and s = cache[p, R/2:] (sin), R = rot_dim:

    out[i]       = x[i] * c[i] - x[i + R/2] * s[i]        i < R/2
    out[i + R/2] = x[i + R/2] * c[i] + x[i] * s[i]
    out[j]       = x[j]                                   R <= j < head_dim (partial rotary)

which is HF's `x * cos + rotate_half(x) * sin`, computed in float32 and rounded once to x.dtype.
q and k are rotated in one launch (one program per token); results are new tensors.
"""

from __future__ import annotations

import torch

from kiln.kernels._triton import next_power_of_2, tl, triton, use_triton


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_sh, stride_dh, num_heads, cos, sin, offs_d, d_mask,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    src = src_ptr + offs_h[:, None] * stride_sh + offs_d[None, :]
    dst = dst_ptr + offs_h[:, None] * stride_dh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    _rotate_heads(
        q_ptr + tok * stride_qt, q_out_ptr + tok * stride_qot, stride_qh, stride_qoh,
        num_heads, cos, sin, offs_d, d_mask, HALF, BLOCK_QH,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + tok * stride_kt, k_out_ptr + tok * stride_kot, stride_kh, stride_koh,
        num_kv_heads, cos, sin, offs_d, d_mask, HALF, BLOCK_KH,
    )  # fmt: skip


def _flatten(x: torch.Tensor) -> torch.Tensor:
    """[..., heads, head_dim] -> [T, heads, head_dim] with a unit stride on head_dim."""
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    q3, k3 = _flatten(q), _flatten(k)
    pos = positions.reshape(-1)
    num_tokens, num_heads, head_dim = q3.shape
    num_kv_heads = k3.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert k3.shape[0] == num_tokens == pos.shape[0] and k3.shape[2] == head_dim
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, f"rot_dim {rot_dim}, head_dim {head_dim}"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    assert not pos.dtype.is_floating_point
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_out3, k_out3 = q_out.view(q3.shape), k_out.view(k3.shape)
    if rot_dim < head_dim:  # the kernel writes the rotated dims only
        q_out3[..., rot_dim:] = q3[..., rot_dim:]
        k_out3[..., rot_dim:] = k3[..., rot_dim:]
    if num_tokens == 0:
        return q_out, k_out
    half = rot_dim // 2
    block_qh, block_kh = next_power_of_2(num_heads), next_power_of_2(num_kv_heads)
    _rotary_kernel[(num_tokens,)](
        q3, k3, q_out3, k_out3, pos, cos_sin_cache,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
        q_out3.stride(0), q_out3.stride(1), k_out3.stride(0), k_out3.stride(1),
        cos_sin_cache.stride(0), num_heads, num_kv_heads,
        HALF=half, BLOCK_D=next_power_of_2(half), BLOCK_QH=block_qh, BLOCK_KH=block_kh,
        num_warps=4 if block_qh * half <= 4096 else 8,
    )  # fmt: skip
    return q_out, k_out


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch rotary (the CPU path and the test oracle)."""
    cos, sin = cos_sin_cache[positions.reshape(-1).long()].chunk(2, dim=-1)  # [T, R/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
        half = cos.shape[-1]
        x1 = x3[..., :half].float()
        x2 = x3[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, x3[..., 2 * half :]), dim=-1).view(x.shape)

    return rotate(q), rotate(k)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [..., num_heads, head_dim] and k [..., num_kv_heads, head_dim]; out of place."""
    if use_triton(q, k, positions, cos_sin_cache):
        return apply_rotary_triton(q, k, positions, cos_sin_cache)
    return apply_rotary_ref(q, k, positions, cos_sin_cache)
