"""W8A8: 8-bit weights and activations (FP8 e4m3 or INT8) through cuBLAS.

    xq[m, k] = q(x[m, k] * smooth[k] / sx[m]),  sx[m] = max_k |x[m, k] * smooth[k]| / QMAX
    y[m, n]  = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k] + b[n]

Activation scales are dynamic per token (one absmax per row) or static per tensor (a calibrated
scalar). ``smooth`` is SmoothQuant's 1 / s, applied where x is read, so no other layer changes.
FP8 runs ``torch._scaled_mm`` (row-wise scales, sm_89+), INT8 ``torch._int_mm``; the references
simulate both in float32 (the CPU path and the test oracle). q() rounds half away from zero for
INT8 (``floor(v + 0.5)`` in both paths) and to nearest-even for FP8 (the hardware cast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels._triton import use_triton
from kiln.kernels.activation import silu_and_mul
from kiln.kernels.gemm import gemm_triton
from kiln.kernels.row_quant import (
    QuantizedRows,
    RowQuant,
    quantize_rows,
    quantize_rows_ref,
    quantize_rows_triton,
)

FP8_DTYPE = torch.float8_e4m3fn
QMAX = {"fp8": 448.0, "int8": 127.0}
STORAGE = {"fp8": FP8_DTYPE, "int8": torch.int8}
MIN_AMAX = 1e-6  # an all-zero row still gets a finite scale
FP8_GEMM_MAX_M = 64  # FP8 rows up to which the Triton GEMM beats _scaled_mm (gpu_quant.py)


def row_quant(kind: str, smooth: torch.Tensor | None = None,
              static_scale: torch.Tensor | None = None) -> RowQuant:
    """The per-token activation quantization of a W8A8 ``kind`` ("fp8" or "int8")."""
    return RowQuant(STORAGE[kind], QMAX[kind], MIN_AMAX, smooth, static_scale)


def quant_per_token_triton(x: torch.Tensor, kind: str, smooth: torch.Tensor | None = None,
                           static_scale: torch.Tensor | None = None) -> QuantizedRows:
    """x [M, K] -> (xq [M, K] fp8/int8, scales [M, 1] float32); one program per row."""
    return quantize_rows_triton(x, row_quant(kind, smooth, static_scale))


def quant_per_token_ref(x: torch.Tensor, kind: str, smooth: torch.Tensor | None = None,
                        static_scale: torch.Tensor | None = None) -> QuantizedRows:
    return quantize_rows_ref(x, row_quant(kind, smooth, static_scale))


def quant_per_token(x: torch.Tensor, kind: str, smooth: torch.Tensor | None = None,
                    static_scale: torch.Tensor | None = None) -> QuantizedRows:
    if use_triton(x):
        return quant_per_token_triton(x, kind, smooth, static_scale)
    return quant_per_token_ref(x, kind, smooth, static_scale)


def quantize_weight(w: torch.Tensor, kind: str, granularity: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> (wq [N, K] fp8/int8, scales [N] float32; equal when per tensor)."""
    wf = w.float()
    amax = wf.abs().amax() if granularity == "tensor" else wf.abs().amax(-1)
    scales = (amax.clamp_min(MIN_AMAX) / QMAX[kind]).expand(w.shape[0]).contiguous()
    v = (wf / scales[:, None]).clamp(-QMAX[kind], QMAX[kind])
    wq = v.to(FP8_DTYPE) if kind == "fp8" else torch.round(v).to(torch.int8)
    return wq, scales


def w8a8_linear_ref(x: torch.Tensor | QuantizedRows, wq: torch.Tensor, w_scales: torch.Tensor,
                    kind: str, smooth: torch.Tensor | None = None,
                    static_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    xq, xs = _rows(x, kind, smooth, static_scale, quant_per_token_ref)
    y = (xq.float() @ wq.float().t()) * xs * w_scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(_out_dtype(x, dtype)).reshape(*x.shape[:-1], -1)


def _out_dtype(x: torch.Tensor | QuantizedRows, dtype: torch.dtype | None) -> torch.dtype:
    """x's dtype, or ``dtype`` where x comes quantized (its codes do not say)."""
    if isinstance(x, QuantizedRows):
        assert dtype is not None, "quantized rows need the output dtype"
        return dtype
    return x.dtype


def _rows(x: torch.Tensor | QuantizedRows, kind: str, smooth: torch.Tensor | None,
          static_scale: torch.Tensor | None, quantize) -> QuantizedRows:
    """x as quantized rows [M, K]: as given (an RMSNorm wrote them), or by ``quantize``."""
    if isinstance(x, QuantizedRows):
        return x._replace(codes=x.codes.reshape(-1, x.codes.shape[-1]))
    x2 = x.reshape(-1, x.shape[-1])
    return quantize(x2 if x2.stride(-1) == 1 else x2.contiguous(), kind, smooth, static_scale)


def _int_mm_padded(xq: torch.Tensor, wq_t: torch.Tensor) -> torch.Tensor:
    m = xq.shape[0]
    if m > 16:  # cuBLAS int8 GEMM needs more than 16 rows
        return torch._int_mm(xq, wq_t)
    padded = F.pad(xq, (0, 0, 0, 17 - m))
    return torch._int_mm(padded, wq_t)[:m]


def w8a8_linear(x: torch.Tensor | QuantizedRows, wq: torch.Tensor, w_scales: torch.Tensor,
                kind: str, smooth: torch.Tensor | None = None,
                static_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                triton_gemm: bool | None = None, gated: bool = False,
                dtype: torch.dtype | None = None, out_quant: RowQuant | None = None
                ) -> torch.Tensor | QuantizedRows:
    """y = x W^T + b with W8A8; x [..., K] -> [..., N] in x.dtype. wq is [N, K] row-major.
    x may come quantized already (``QuantizedRows``, from an RMSNorm with a ``RowQuant``; y is
    then in ``dtype``).
    gated: W is a merged [gate; up] projection and y [..., N / 2] = silu(gate) * up (in the
    Triton GEMM's epilogue where it runs).
    out_quant: y comes as the next layer's input codes (``QuantizedRows``); after cuBLAS one
    pass applies silu(gate) * up and quantizes.

    FP8 GEMMs of at most FP8_GEMM_MAX_M rows run kiln/kernels/gemm.py instead of
    torch._scaled_mm (``triton_gemm`` forces either, for the benchmarks).
    """
    lead = x.shape[:-1]
    if not use_triton(x.codes if isinstance(x, QuantizedRows) else x, wq):
        y = w8a8_linear_ref(x, wq, w_scales, kind, smooth, static_scale, bias, dtype)
    else:
        xq, xs = _rows(x, kind, smooth, static_scale, quant_per_token_triton)
        dtype = _out_dtype(x, dtype)
        if triton_gemm is None:  # every FP8 gemm_config needs K % 128 == 0
            triton_gemm = xq.shape[0] <= FP8_GEMM_MAX_M and xq.shape[1] % 128 == 0
        if kind == "fp8" and triton_gemm:  # silu(gate) * up in the GEMM's epilogue
            y = gemm_triton(xq, wq, bias, dtype, xs, w_scales, gated=gated)
            return _output(y, lead, out_quant, gated=False)
        y = _cublas_w8a8(xq, xs, wq, w_scales, kind, bias, dtype)
    return _output(y, lead, out_quant, gated)


def _output(y: torch.Tensor, lead: torch.Size, out_quant: RowQuant | None,
            gated: bool) -> torch.Tensor | QuantizedRows:
    """y [M, N] -> [*lead, N] (gated: silu(gate) * up, [*lead, N / 2]), as codes if out_quant."""
    if out_quant is not None:
        codes, scales = quantize_rows(y, out_quant, gated)
        return QuantizedRows(codes.reshape(*lead, -1), scales)
    y = silu_and_mul(y) if gated else y
    return y.reshape(*lead, -1)


def _cublas_w8a8(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                 kind: str, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] codes, xs [M, 1] -> [M, N] in dtype through torch._scaled_mm or _int_mm."""
    if kind == "fp8":
        # row-wise scaling takes bf16 output only; [K, N] column-major is wq.t()
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scales.float()[None, :],
                                out_dtype=torch.bfloat16, bias=None if bias is None
                                else bias.to(torch.bfloat16)).to(dtype)
    y = (_int_mm_padded(xq, wq.t()).float() * xs * w_scales.float()[None, :]).to(dtype)
    if bias is not None:
        y += bias  # in place: y keeps dtype
    return y


def check_fp8_supported(device: torch.device) -> None:
    """FP8 GEMMs need sm_89+ (Ada, Hopper); the CPU runs the float32 reference instead."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        # the same check guards loading an FP8 checkpoint, quantizing to FP8 and on-the-fly
        # FP8: the fix names the 8-bit formats this GPU runs, for each of those routes
        raise ValueError(f"FP8 W8A8 needs a GPU with compute capability >= 8.9 (Ada or Hopper); "
                         f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}. Use an "
                         "8-bit format it runs: on the dense model --quantization int8 (W8A16) "
                         "or w8a8-int8, or a checkpoint from `kiln quantize --method rtn --bits "
                         "8` or `--method smoothquant` (INT8 W8A8); or run on the CPU")
