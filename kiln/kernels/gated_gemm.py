"""The gate/up GEMM of a prefill with silu(gate) * up in its epilogue (Hopper, Triton, TMA).

    y[m, j] = silu(sum_k x[m, k] w[j, k]) * sum_k x[m, k] w[I + j, k]     x [M, K], w [2I, K]

At prefill sizes the merged [gate; up] projection is compute-bound, and cuBLAS then writes its
[M, 2I] output for ``silu_and_mul`` to read back and halve: at 8192 rows of Llama-3.1-8B that
pass costs 220-300 us a layer beside cuBLAS' 2.5-2.7 ms. Here each program of a persistent grid
walks output tiles [BLOCK_M, BLOCK_N] of y; for each it streams the x tile and both weight tiles
(rows j and I + j) through TMA into two accumulators, and writes silu(gate) * up once. The
rounding is the unfused path's (``silu_mul``): gate and up rounded to the output dtype, silu
rounded before the multiply.

Measured on the H100 (benchmarks/results/h100/gated_gemm.txt): against cuBLAS + silu_and_mul
1.04-1.13x at 1000-16384 rows but 0.99x at 3000 (0.96x at 512, where the decode path keeps
cuBLAS), a GEMM at 680-750 TFLOP/s. The grid walks tiles in groups of GROUP_M row tiles so that
the weight tiles of a group stay in L2. Warp specialization (``tl.range(warp_specialize=True)``)
measured even with this plain software pipeline, so the kernel does without it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.kernels._triton import TensorDescriptor, num_sms, tl, triton, use_triton
from kiln.kernels.activation import silu_and_mul_ref, silu_mul

# rows from which the gated GEMM replaces cuBLAS + silu_and_mul: it wins from 1000 rows up
# (1.13x at 1000-1024, 1.04-1.07x at 2048-16384; 0.99x at 3000) and loses at 512 (0.96x)
GATED_GEMM_MIN_M = 1024


class GatedTiles(NamedTuple):
    block_m: int
    block_n: int  # columns of y, so 2 x block_n weight rows a tile
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# the H100 sweep's best (gated_gemm.txt): two 128 x 128 accumulators are a 128 x 256 tile; 4
# stages and 256-row tiles lose, 32-deep K steps lose and 128-deep ones do not fit in shared memory
H100_TILES = GatedTiles(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8,
                        num_stages=3)


@triton.jit
def _tile_coords(tile, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """Row and column tile of linear tile index ``tile``: GROUP_M row tiles share each column
    tile before the next, so the weight tiles a group reads stay in L2."""
    per_group = GROUP_M * num_tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = min(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % group_rows)
    tile_n = (tile % per_group) // group_rows
    return tile_m, tile_n


@triton.jit(do_not_specialize=["M"])  # the step's rows: no new variant per step shape
def _gated_gemm_kernel(x_desc, w_desc, y_desc, M, INTER, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    num_tiles_m = tl.cdiv(M, BLOCK_M)
    num_tiles_n = tl.cdiv(INTER, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    dt = y_desc.dtype
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=False):
        tile_m, tile_n = _tile_coords(tile, num_tiles_m, num_tiles_n, GROUP_M)
        row = tile_m * BLOCK_M
        col = tile_n * BLOCK_N
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # TMA zero-fills past K and past 2 INTER; gate columns past INTER read up rows, but their
        # outputs lie past INTER too and the store clips them
        for step in range(k_steps):
            k = step * BLOCK_K
            x = x_desc.load([row, k])
            gate = tl.dot(x, w_desc.load([col, k]).T, gate)
            up = tl.dot(x, w_desc.load([INTER + col, k]).T, up)
        y_desc.store([row, col], silu_mul(gate, up, dt).to(dt))


def gated_gemm_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``gated_gemm`` runs silu_and_mul(x @ weight^T) for these tensors: a Hopper GPU,
    16-bit x and weight of one dtype, no bias, at least GATED_GEMM_MIN_M rows, and what TMA
    takes: contiguous rows whose strides (K and I elements) are multiples of 16 bytes, starting
    16-byte aligned."""
    if not use_triton(x, weight) or bias is not None:
        return False
    k = weight.shape[-1]
    # the row count first: it turns every decode batch away before the other checks
    return (x.numel() >= GATED_GEMM_MIN_M * k
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dim() == 2 and weight.stride() == (k, 1) and k % 8 == 0
            and weight.shape[0] % 16 == 0 and x.is_contiguous() and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device) == (9, 0))


def gated_gemm_triton(x: torch.Tensor, w: torch.Tensor,
                      tiles: GatedTiles = H100_TILES) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ w [2I, K]^T -> silu(gate) * up [M, I] in x.dtype (CUDA, or CPU
    under TRITON_INTERPRET=1)."""
    m, k = x.shape
    assert w.shape[1] == k and w.shape[0] % 2 == 0, f"w {tuple(w.shape)} is not [2I, {k}]"
    inter = w.shape[0] // 2
    y = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # one program an SM whatever the tile count, those without a tile exiting at once: a grid
    # sized by the tiles would follow M on a small model, and NUM_PROGRAMS (a constexpr, so the
    # persistent loop's stride is known to the compiler) would compile a variant per row count
    programs = num_sms(x.device)
    _gated_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [tiles.block_m, tiles.block_k]),
        TensorDescriptor.from_tensor(w, [tiles.block_n, tiles.block_k]),
        TensorDescriptor.from_tensor(y, [tiles.block_m, tiles.block_n]),
        m, inter, k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, NUM_PROGRAMS=programs, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return y


def gated_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch silu_and_mul(x @ w^T) (the test oracle)."""
    return silu_and_mul_ref(x @ w.t())
