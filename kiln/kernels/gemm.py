"""Tensor-core GEMM for decode batch sizes, 16-bit or FP8 (W8A8) operands, Triton.

    y[m, n] = sum_k x[m, k] w[n, k] (+ b[n])                          x, w: bf16 / fp16
    y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k] (+ b[n])        xq, wq: float8 e4m3

At a few dozen rows a GEMM is bound by streaming the weights. cuBLAS reads a 16-bit [N, K]
weight at 2.3-2.8 TB/s at M = 64 on an H100 and torch._scaled_mm an e4m3 one at 1.1-2.4 TB/s
(benchmarks/results/h100/gemm_sweep.txt, fp8_swap_ab.txt). Every program here re-reads the
whole activation block [M, K] through L2, so a tile of BLOCK_N columns moves M / BLOCK_N bytes
of activations per weight byte: the tiles are as wide as the SM count allows (gemm_config).
Row tiles are the fastest grid axis, so the programs that share a weight tile run together and
read it from HBM once.

- gated: a merged [gate; up] projection gives silu(gate) * up straight from the epilogue; each
  tile interleaves gate and up rows, so one dot serves both.

Each program streams the whole K of its tile. Splitting K over programs (float32 partials summed
in a fixed order by the last to arrive) lost at every Llama-3.1-8B shape once the narrow layers
took deep pipelines (gemm_sweep.txt): FP8 down_proj at M = 16-64 runs 22.8-23.5 us unsplit
against 25.8-33 split two or four ways.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.kernels._triton import num_sms, pdl, prefetch_l2, tl, triton, use_triton, wait_for_inputs
from kiln.kernels.activation import silu_and_mul_ref, silu_mul

# 16-bit rows up to which gemm_triton replaces cuBLAS for dense weights: at M = 16-64 it matches
# or beats cuBLAS on every Llama-3.1-8B layer (gemm_sweep.txt) and keeps the step PDL-chained;
# at 128 its 64-row tiles lose (gate_up 110 against 89 us)
DENSE_MAX_M = 64

# K steps of each program's weight rows asked of L2 before the PDL wait (0: none), so the fill of
# the K loop's pipeline overlaps the kernels before it. With the RMSNorm releasing the GEMM after
# it early, 4 steps beat 2 and 8 (decode step at batch 16-64, ab_runs.txt 44)
PREFETCH_K_STEPS = 4


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _store_tile(acc, xs_ptr, ws_ptr, bias_ptr, y_ptr, offs_m, offs_n, rows, m_mask, n_mask,
                pid_n, N, stride_ym, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] float32 over weight ``rows`` -> y, with the row and column scales,
    the bias and, GATED, silu(gate) * up of the interleaved gate / up columns."""
    y = acc
    if SCALED:
        sx = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
        sw = tl.load(ws_ptr + rows, mask=n_mask, other=0.0)
        y = y * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dt = y_ptr.dtype.element_ty
    if GATED:  # gate and up rounded to the output dtype first, as the unfused path stores them
        gate, up = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
        y = silu_mul(gate, up, dt)
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_mask = offs_n < N // 2
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(dt), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])  # the batch size: no new variant per step shape
def _gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    PREFETCH_STEPS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """N: weight rows; K a multiple of BLOCK_K (checked by the launcher). Row tiles are the
    fastest grid axis, so the programs that share a weight tile run together and read it from
    HBM once.

    Nothing is loaded into registers before the wait: taking the first weight tile before it
    (peeled out of the loop, as the weight-only GEMV does) broke the K loop's pipeline and cost
    1-3% end to end on the H100 (ab_runs.txt 24). The first PREFETCH_STEPS K steps of the
    weight rows are only asked of L2 there (``prefetch_l2``: no registers, no pipeline change)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # tile columns
    # GATED: tile column 2 i is gate row pid_n BLOCK_N / 2 + i, column 2 i + 1 the up row N / 2
    # after it, so one dot serves both and the epilogue pairs them
    rows = offs_n // 2 + (offs_n % 2) * (N // 2) if GATED else offs_n
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if PREFETCH_STEPS > 0:
        line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # a 128-byte line
        lines = tl.arange(0, (PREFETCH_STEPS * BLOCK_K + line - 1) // line) * line
        prefetch_l2(w_ptr + tl.where(n_mask, rows, 0)[:, None].to(tl.int64) * stride_wn
                    + tl.minimum(lines, K - 1)[None, :], USE_PDL)
    wait_for_inputs(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        if EVEN:  # every tile full: no predicates in the loop (batch-64 step 7.235 -> 7.191 ms)
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store_tile(acc, xs_ptr, ws_ptr, bias_ptr, y_ptr, offs_m, offs_n, rows, m_mask, n_mask,
                pid_n, N, stride_ym, SCALED, HAS_BIAS, GATED, BLOCK_M, BLOCK_N)


def gemm_config(m: int, n: int, k: int, element_bytes: int, sms: int) -> GemmTiles:
    """Tiles from the H100 sweep (benchmarks/results/h100/gemm_sweep.txt, M = 16 ... 64).

    Rows: one 64-row tile (the wgmma shape). Columns:
    - 16-bit layers wide enough for one 128-column program per SM (gate_up, the LM head): 128,
      halving the activation re-reads of 64 (gate_up 82.8 against 86.1 us at M = 64);
    - layers whose 64-column tiles fill more than half the SMs (qkv; FP8 gate_up): 64, with
      256-deep K steps in FP8 (128 where K is not a multiple of 256), and a 4-deep pipeline
      where there are fewer than two tiles per SM (FP8 qkv 11.4 against 12.3 us with 3);
    - narrower ones (o_proj, down_proj: N = 4096): 32, 4 warps and a deep pipeline, so that one
      program per SM keeps enough weight bytes in flight: 256-deep K steps, 6 stages in FP8
      (down_proj 23.5 against 27.5 us for 128 x 6), 128-deep, 7 stages in 16 bits.
    Every config needs K % block_k == 0.
    """
    fp8 = element_bytes == 1
    if not fp8 and triton.cdiv(n, 128) >= sms:
        return GemmTiles(64, 128, 128, 4, 3)
    tiles_64 = triton.cdiv(n, 64)
    if tiles_64 > sms // 2:
        stages = 3 if tiles_64 >= 2 * sms else 4
        return GemmTiles(64, 64, 256 if fp8 and k % 256 == 0 else 128, 4, stages)
    if fp8 and k % 256 == 0:
        return GemmTiles(64, 32, 256, 4, 6)
    return GemmTiles(64, 32, 128, 4, 7)


def dense_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemm_triton`` runs x [..., K] @ weight^T for a dense layer: CUDA, 16-bit x and
    weight of one dtype, contiguous weight rows, K a multiple of 128 (every 16-bit config's K
    step) and at most DENSE_MAX_M rows."""
    k = weight.shape[-1]
    return (use_triton(x, weight) and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dim() == 2
            and weight.stride() == (k, 1) and k % 128 == 0 and x.numel() <= DENSE_MAX_M * k)


def gemm_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, x_scales: torch.Tensor | None = None,
                w_scales: torch.Tensor | None = None, *, gated: bool = False,
                config: GemmTiles | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias) -> y [M, N] in out_dtype (x.dtype by default).

    16-bit x and w, or e4m3 ones with x_scales [M, 1] and w_scales [N] float32 (both or none).
    gated: w is a merged [gate; up] projection and y [M, N / 2] = silu(gate) * up.
    """
    m, k = x.shape
    n = w.shape[0]
    scaled = x_scales is not None
    assert scaled == (w_scales is not None), "x_scales and w_scales come together"
    out_dtype = out_dtype or (torch.bfloat16 if scaled else x.dtype)
    cfg = config or gemm_config(m, n, k, x.element_size(), num_sms(x.device))
    assert w.shape[1] == k and k % cfg.block_k == 0, \
        f"K={k} must be a multiple of block_k = {cfg.block_k}"
    assert x.stride(1) == 1 and w.stride(1) == 1
    assert not gated or n % 2 == 0, f"a gated projection has an even number of rows, not {n}"
    y = torch.empty(m, n // 2 if gated else n, dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _gemm_kernel[grid](
        x, x_scales if scaled else y, w, w_scales if scaled else y,
        bias if bias is not None else y, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        SCALED=scaled, HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN=m % cfg.block_m == 0 and n % cfg.block_n == 0, PREFETCH_STEPS=PREFETCH_K_STEPS,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl(x.device),
    )  # fmt: skip
    return y


def gemm_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, x_scales: torch.Tensor | None = None,
             w_scales: torch.Tensor | None = None, *, gated: bool = False) -> torch.Tensor:
    """The same product in float32 PyTorch (the test oracle); gated as the unfused path runs
    it, y rounded to out_dtype before silu_and_mul."""
    y = x.float() @ w.float().t()
    if x_scales is not None:
        y = y * x_scales.float() * w_scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    y = y.to(out_dtype or (torch.bfloat16 if x_scales is not None else x.dtype))
    return silu_and_mul_ref(y) if gated else y
