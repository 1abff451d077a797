"""Rotary position embedding, NeoX / Hugging Face `rotate_half` layout, optionally fused with the
paged KV-cache write.

For a token at position p, with c = cache[p, :R/2] (cos) and s = cache[p, R/2:] (sin), R = rot_dim:

    out[i]       = x[i] * c[i] - x[i + R/2] * s[i]        i < R/2
    out[i + R/2] = x[i + R/2] * c[i] + x[i] * s[i]
    out[j]       = x[j]                                   R <= j < head_dim (partial rotary)

which is HF's `x * cos + rotate_half(x) * sin`, computed in float32 and rounded once to x.dtype.
One launch, one program per token, rotates q and k into new tensors (`apply_rotary`), or rotates
q and writes the rotated k and the unrotated v into the paged caches at `slot_mapping`
(`rotary_write_kv_cache`, see kv_cache.py for the layout; slot < 0 skipped), which saves the
attention layer the separate cache-write launch. An fp8 cache stores
fp8(clamp(x * fp8_inv_scale(scale), +-448)) of the rotated k rounded to the model dtype, exactly
what `quantize_kv` then `write_kv_cache_ref` store.
"""

from __future__ import annotations

import torch

from kiln.kernels._triton import next_power_of_2, pdl, tl, triton, use_triton, wait_for_inputs
from kiln.kernels.kv_cache import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_inv_scale,
    quantize_kv,
    write_kv_cache_ref,
)


@triton.jit
def _store(dst, x, mask, model_ty: tl.constexpr, inv_scale, FP8: tl.constexpr,
           FP8_MAX: tl.constexpr):  # fmt: skip
    # Round to the model dtype first even on the way to fp8: the unfused path quantized the
    # rotated k after it had been stored in the model dtype.
    x = x.to(model_ty)
    if FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(
    src, dst, stride_sh, stride_dh, num_heads, inv_scale,
    WIDTH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """dst[h, :WIDTH] = src[h, :WIDTH] (quantized for an fp8 destination)."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_w = tl.arange(0, BLOCK_W)[None, :]
    mask = (offs_h < num_heads) & (offs_w < WIDTH)
    x = tl.load(src + offs_h * stride_sh + offs_w, mask=mask)
    _store(dst + offs_h * stride_dh + offs_w, x, mask, src.dtype.element_ty, inv_scale, FP8,
           FP8_MAX)  # fmt: skip


@triton.jit
def _rope_heads(
    src, dst, stride_sh, stride_dh, num_heads, cos, sin, offs_d, d_mask, inv_scale,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """dst[h] = rotary(src[h]) over all head_dim dims (quantized for an fp8 destination)."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    s = src + offs_h[:, None] * stride_sh + offs_d[None, :]
    d = dst + offs_h[:, None] * stride_dh + offs_d[None, :]
    x1 = tl.load(s, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(s + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = src.dtype.element_ty
    _store(d, x1 * cos - x2 * sin, mask, ty, inv_scale, FP8, FP8_MAX)
    _store(d + HALF, x2 * cos + x1 * sin, mask, ty, inv_scale, FP8, FP8_MAX)
    if 2 * HALF < HEAD_DIM:
        _copy_heads(src + 2 * HALF, dst + 2 * HALF, stride_sh, stride_dh, num_heads, inv_scale,
                    HEAD_DIM - 2 * HALF, BLOCK_H, BLOCK_TAIL, FP8, FP8_MAX)  # fmt: skip


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
    pos_ptr, slot_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos_sin,
    num_heads, num_kv_heads, block_size, k_inv_scale, v_inv_scale,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BLOCK_HD: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    STORE_K: tl.constexpr, WRITE_CACHE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # positions, slots and the table are the engine's inputs, not the previous kernel's output:
    # loaded before the wait, their chain of dependent loads overlaps that kernel
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + offs_d, mask=d_mask,
                  other=0.0)[None, :]  # fmt: skip
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
    wait_for_inputs(USE_PDL)
    k_src = k_ptr + tok * stride_kt
    _rope_heads(q_ptr + tok * stride_qt, q_out_ptr + tok * stride_qot, stride_qh, stride_qoh,
                num_heads, cos, sin, offs_d, d_mask, 1.0, HALF, HEAD_DIM, BLOCK_QH, BLOCK_TAIL,
                False, FP8_MAX)  # fmt: skip
    if STORE_K:
        _rope_heads(k_src, k_out_ptr + tok * stride_kot, stride_kh, stride_koh, num_kv_heads,
                    cos, sin, offs_d, d_mask, 1.0, HALF, HEAD_DIM, BLOCK_KH, BLOCK_TAIL, False,
                    FP8_MAX)  # fmt: skip
    if WRITE_CACHE:  # noqa: SIM102 (a constexpr branch around a run-time one)
        if slot >= 0:  # < 0: batch padding, nothing to store
            block = slot // block_size
            offset = slot % block_size
            _rope_heads(k_src, k_cache_ptr + block * stride_kcb + offset * stride_kcs,
                        stride_kh, stride_kch, num_kv_heads, cos, sin, offs_d, d_mask,
                        k_inv_scale, HALF, HEAD_DIM, BLOCK_KH, BLOCK_TAIL, FP8,
                        FP8_MAX)  # fmt: skip
            _copy_heads(v_ptr + tok * stride_vt,
                        v_cache_ptr + block * stride_vcb + offset * stride_vcs, stride_vh,
                        stride_vch, num_kv_heads, v_inv_scale, HEAD_DIM, BLOCK_KH, BLOCK_HD, FP8,
                        FP8_MAX)  # fmt: skip


def _flatten(x: torch.Tensor) -> torch.Tensor:
    """[..., heads, head_dim] -> [T, heads, head_dim] with a unit stride on head_dim."""
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def _launch(
    q3: torch.Tensor,
    k3: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_out3: torch.Tensor,
    k_out3: torch.Tensor | None = None,
    v3: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """q3, k3 [T, heads, D] -> q_out3 and, if given, k_out3; with ``slot_mapping`` also the
    rotated k3 and v3 into k_cache / v_cache."""
    pos = positions.reshape(-1)
    num_tokens, num_heads, head_dim = q3.shape
    num_kv_heads = k3.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    assert k3.shape[0] == num_tokens == pos.shape[0] and k3.shape[2] == head_dim
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, f"rot_dim {rot_dim}, head_dim {head_dim}"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    assert not pos.dtype.is_floating_point
    store_k, write_cache = k_out3 is not None, slot_mapping is not None
    fp8 = write_cache and k_cache.dtype == FP8_DTYPE
    if write_cache:
        assert v3.shape == k3.shape and v3.dtype == k3.dtype and slot_mapping.shape == (num_tokens,)
        assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (k3.dtype, FP8_DTYPE)
        assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    # what a launch leaves out is never dereferenced (its flag is off): any tensor will do
    if not store_k:
        k_out3 = q_out3
    if not write_cache:
        v3, k_cache, v_cache, slot_mapping = k3, q3, q3, pos
    if num_tokens == 0:
        return
    half = rot_dim // 2
    block_qh, block_kh = next_power_of_2(num_heads), next_power_of_2(num_kv_heads)
    _rotary_kernel[(num_tokens,)](
        q3, k3, v3, q_out3, k_out3, k_cache, v_cache, pos, slot_mapping, cos_sin_cache,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        q_out3.stride(0), q_out3.stride(1), k_out3.stride(0), k_out3.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], cos_sin_cache.stride(0),
        num_heads, num_kv_heads, k_cache.shape[1],
        fp8_inv_scale(k_scale) if fp8 else 1.0, fp8_inv_scale(v_scale) if fp8 else 1.0,
        HALF=half, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(half),
        BLOCK_TAIL=next_power_of_2(head_dim - rot_dim), BLOCK_HD=next_power_of_2(head_dim),
        BLOCK_QH=block_qh, BLOCK_KH=block_kh, STORE_K=store_k, WRITE_CACHE=write_cache,
        FP8=fp8, FP8_MAX=FP8_MAX, num_warps=4 if block_qh * half <= 4096 else 8,
        **pdl(q3.device),
    )  # fmt: skip


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1): rotary only."""
    q3, k3 = _flatten(q), _flatten(k)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q3, k3, positions, cos_sin_cache, q_out.view(q3.shape), k_out.view(k3.shape))
    return q_out, k_out


def rotary_write_kv_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel: rotated q out, rotated k and v into the caches (and the rotated
    k into ``k_out`` if given), in one launch."""
    q3 = _flatten(q)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q3, _flatten(k), positions, cos_sin_cache, q_out.view(q3.shape),
            None if k_out is None else k_out.view(-1, *k_out.shape[-2:]), v3=_flatten(v),
            k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, k_scale=k_scale,
            v_scale=v_scale)  # fmt: skip
    return q_out


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


def rotary_write_kv_cache_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch, the separate steps the kernel fuses: rotary, quantize (fp8), write."""
    q, k = apply_rotary_ref(q, k, positions, cos_sin_cache)
    if k_out is not None:
        k_out.copy_(k)
    if slot_mapping is not None:
        if k_cache.dtype == FP8_DTYPE:
            k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [..., num_heads, head_dim] and k [..., num_kv_heads, head_dim]; out of place."""
    if use_triton(q, k, positions, cos_sin_cache):
        return apply_rotary_triton(q, k, positions, cos_sin_cache)
    return apply_rotary_ref(q, k, positions, cos_sin_cache)


def rotary_write_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, H_kv, D] and write k and v [T, H_kv, D] into the paged caches
    at ``slot_mapping`` (None: write nothing); returns the rotated q. ``k_out`` (optional,
    [T, H_kv, D] in k's dtype) also receives the rotated k, in the model dtype even for an fp8
    cache.

    ``k_scale`` / ``v_scale`` matter only for an fp8 cache (stored values are x / scale)."""
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            k_out)
    if use_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache):
        return rotary_write_kv_cache_triton(*args)
    return rotary_write_kv_cache_ref(*args)
