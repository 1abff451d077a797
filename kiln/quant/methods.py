"""The quantized ``LinearMethod``s: one for weight-only integers, one for W8A8.

Both follow the Linear contract: the layer arrives with a dense ``weight`` [out, in] (on-the-fly
quantization at load, RTN), or a calibrated method (AWQ, GPTQ, SmoothQuant) or a pre-quantized
checkpoint hands the quantized tensors over with ``set_tensors``. Either way the dense weight is
dropped and the layer holds buffers instead (so ``state_dict`` is the quantized checkpoint):

- ``WeightOnlyMethod``: qweight (int32 [N, K/8] for 4 bits, uint8 [N, K] for 8), scales [N, G],
  zeros uint8 [N, G] (asymmetric), perm int32 [K] (GPTQ act-order), smooth float32 [K] (AWQ).
- ``W8A8Method``: qweight (fp8 / int8 [N, K]), w_scales float32 [N] (per-tensor scales are
  stored expanded to [N]), smooth float32 [K] (SmoothQuant), act_scale float32 [] (static
  activation scale).

The LM head is a Linear too and takes a method of its own, for ``cfg.lm_head_config()`` (W8A16
per channel whatever the layers' format, unless the config says dense); with tied embeddings,
dropping its dense weight only drops its reference to the embedding's table, which keeps serving
the embedding lookups.
"""

from __future__ import annotations

import torch

from kiln.kernels._triton import use_triton
from kiln.kernels.activation import silu_and_mul
from kiln.kernels.quant_gemm import (
    FP8_DTYPE,
    GEMV_FMA_MAX_M,
    wint_dequant_ref,
    wint_linear,
    wint_linear_triton,
)
from kiln.kernels.row_quant import QuantizedRows, RowQuant
from kiln.layers.embedding import LMHead
from kiln.layers.linear import Linear
from kiln.quant.config import QuantConfig
from kiln.quant.rtn import IntWeight, rtn_quantize
from kiln.quant.w8a8 import (
    STORAGE,
    check_fp8_supported,
    quantize_weight,
    row_quant,
    w8a8_linear,
)

# every tensor name a quantized Linear stores in place of its dense weight (the specs below)
QUANTIZED_TENSORS = frozenset({"qweight", "scales", "zeros", "perm", "smooth", "w_scales",
                               "act_scale"})


def _dense(layer: Linear) -> torch.Tensor | None:
    return layer._parameters.get("weight")


def _set(layer: Linear, tensors: dict[str, torch.Tensor | None]) -> None:
    if "weight" in layer._parameters:
        del layer._parameters["weight"]
    for name, tensor in tensors.items():
        if tensor is not None:
            tensor = tensor.to(layer.params_device).contiguous()
        layer.register_buffer(name, tensor)


def check_tensors(what: str, tensors: dict[str, torch.Tensor],
                  spec: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]) -> None:
    """Raise unless ``tensors`` are exactly ``spec``'s names, shapes and dtypes (no dtypes:
    any floating-point one: integer scales would be converted silently)."""
    missing = sorted(set(spec) - set(tensors))
    unknown = sorted(set(tensors) - set(spec))
    if missing or unknown:
        raise ValueError(f"{what}: quantized tensors missing {missing or '-'}, unexpected "
                         f"{unknown or '-'} for this quantization config")
    for name, (shape, dtypes) in spec.items():
        t = tensors[name]
        if tuple(t.shape) != shape or (t.dtype not in dtypes if dtypes
                                       else not t.dtype.is_floating_point):
            raise ValueError(f"{what}.{name}: got {tuple(t.shape)} {t.dtype}, expected {shape} "
                             f"{' or '.join(map(str, dtypes)) or 'float'}")


class WeightOnlyMethod:
    """W8A16 (per channel) and W4A16 (group-wise): dequantization inside the GEMM kernel."""

    def __init__(self, cfg: QuantConfig) -> None:
        self.cfg = cfg
        self.bits, self.group_size = cfg.bits, cfg.group_size

    def tensor_spec(self, layer: Linear) -> dict[str, tuple[tuple[int, ...], tuple]]:
        n, k = layer.out_features, layer.in_features
        groups = 1 if self.group_size == -1 else k // self.group_size
        spec = {"qweight": ((n, k // 8), (torch.int32,)) if self.bits == 4
                else ((n, k), (torch.uint8,)),
                "scales": ((n, groups), ())}
        if not self.cfg.symmetric:
            spec["zeros"] = ((n, groups), (torch.uint8,))
        if self.cfg.act_order:
            spec["perm"] = ((k,), (torch.int32, torch.int64))
        if self.cfg.method == "awq":
            spec["smooth"] = ((k,), ())
        return spec

    def set_weight(self, layer: Linear, w: IntWeight) -> None:
        tensors = {"qweight": w.qweight(), "scales": w.scales, "zeros": w.zeros,
                   "perm": w.perm, "smooth": w.smooth}
        self.set_tensors(layer, {k: v for k, v in tensors.items() if v is not None}, "layer")

    def check_codes(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        """Refuse index and zero-point values no quantizer writes: a perm that is no
        permutation of the input channels failed (or silently repeated channels) only at the
        first forward; a zero point off the grid dequantizes to weights far out of range."""
        perm = tensors.get("perm")
        identity = None if perm is None else torch.arange(len(perm), device=perm.device)
        if perm is not None and not torch.equal(perm.sort().values.long(), identity):
            raise ValueError(f"{what}.perm is not a permutation of 0..{len(perm) - 1}")
        zeros = tensors.get("zeros")
        if zeros is not None and zeros.numel() and int(zeros.max()) >= 2**self.bits:
            raise ValueError(f"{what}.zeros: {int(zeros.max())} is past the {self.bits}-bit "
                             f"grid (0..{2**self.bits - 1})")

    def set_tensors(self, layer: Linear, tensors: dict[str, torch.Tensor], what: str) -> None:
        check_tensors(what, tensors, self.tensor_spec(layer))
        self.check_codes(tensors, what)
        _set(layer, {
            "qweight": tensors["qweight"],
            "scales": tensors["scales"].to(layer.params_dtype),
            "zeros": tensors.get("zeros"),
            "perm": tensors["perm"].to(torch.int32) if "perm" in tensors else None,
            "smooth": tensors["smooth"].float() if "smooth" in tensors else None,
        })

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = _dense(layer)
        if w is not None:  # on-the-fly: round to nearest on the format's grid
            self.set_weight(layer, rtn_quantize(w, self.bits, self.group_size,
                                                self.cfg.symmetric, scale_dtype=w.dtype))

    def dequantized_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        return wint_dequant_ref(layer.qweight, layer.scales, layer.zeros, self.bits,
                                self.group_size, dtype, layer.perm, layer.smooth)

    def input_quant(self, layer: Linear, num_rows: int) -> RowQuant | None:
        return None

    def apply(self, layer: Linear, x: torch.Tensor, out_dtype: torch.dtype | None = None,
              gated: bool = False, out_quant: RowQuant | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        return wint_linear(x, layer.qweight, layer.scales, layer.zeros, self.bits,
                           self.group_size, layer.perm, layer.smooth, layer.bias, out_dtype, gated,
                           residual)


class W8A8Method:
    """FP8 (``torch._scaled_mm``) or INT8 (``torch._int_mm``) weights and activations.

    FP8 on CUDA dispatches on the number of rows M (a host int, so CUDA graphs capture one
    path per batch size): M <= GEMV_FMA_MAX_M (decode) runs the e4m3 weights through the
    weight-only CUDA-core GEMV of kiln/kernels/quant_gemm.py with x in the model dtype. A small-M
    GEMM is bound by reading the weights, the same bytes either way, and the GEMV skips the
    per-token activation-quantization kernel (the activations are not rounded, and a static
    act_scale goes unused). Above, the GEMV gives way to the tile kernel, which _scaled_mm beats
    (benchmarks/results/h100/quant_kernels.txt). INT8 keeps _int_mm: the GEMV decodes unsigned
    codes with a zero point, not int8's two's complement.
    """

    def __init__(self, cfg: QuantConfig) -> None:
        self.cfg = cfg
        self.kind = cfg.w8a8_dtype

    def tensor_spec(self, layer: Linear) -> dict[str, tuple[tuple[int, ...], tuple]]:
        n, k = layer.out_features, layer.in_features
        spec = {"qweight": ((n, k), (STORAGE[self.kind],)), "w_scales": ((n,), ())}
        if self.cfg.method == "smoothquant":
            spec["smooth"] = ((k,), ())
        if self.cfg.activation_scheme == "static":
            spec["act_scale"] = ((), ())
        return spec

    def set_tensors(self, layer: Linear, tensors: dict[str, torch.Tensor], what: str) -> None:
        check_tensors(what, tensors, self.tensor_spec(layer))
        if self.kind == "fp8":
            check_fp8_supported(layer.params_device)
        _set(layer, {
            "qweight": tensors["qweight"],
            "w_scales": tensors["w_scales"].float(),
            "smooth": tensors["smooth"].float() if "smooth" in tensors else None,
            "act_scale": tensors["act_scale"].float() if "act_scale" in tensors else None,
        })

    def quantize_dense(self, layer: Linear, w: torch.Tensor, smooth: torch.Tensor | None = None,
                       act_scale: torch.Tensor | None = None) -> None:
        """Quantize ``w`` (already multiplied by SmoothQuant's s when ``smooth`` is given)."""
        wq, scales = quantize_weight(w, self.kind, self.cfg.weight_granularity)
        tensors = {"qweight": wq, "w_scales": scales}
        if smooth is not None:
            tensors["smooth"] = smooth
        if act_scale is not None:
            tensors["act_scale"] = act_scale.reshape(())
        self.set_tensors(layer, tensors, "layer")

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = _dense(layer)
        if w is not None:
            if self.kind == "fp8":
                check_fp8_supported(w.device)
            self.quantize_dense(layer, w)

    def dequantized_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        w = layer.qweight.float() * layer.w_scales[:, None]
        return (w if layer.smooth is None else w * layer.smooth[None, :]).to(dtype)

    def _weight_only(self, layer: Linear, num_rows: int) -> bool:
        """FP8 decode rows go through the weight-only GEMV, with 16-bit activations."""
        return (self.kind == "fp8" and num_rows <= GEMV_FMA_MAX_M
                and use_triton(layer.qweight))

    def input_quant(self, layer: Linear, num_rows: int) -> RowQuant | None:
        if self._weight_only(layer, num_rows):
            return None
        return row_quant(self.kind, layer.smooth, layer.act_scale)

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedRows,
              out_dtype: torch.dtype | None = None, gated: bool = False,
              out_quant: RowQuant | None = None, residual: torch.Tensor | None = None
              ) -> torch.Tensor | QuantizedRows:
        """The result always (``residual``: _scaled_mm / _int_mm take no addend)."""
        if not isinstance(x, QuantizedRows) and self._weight_only(layer,
                                                                   x.shape[:-1].numel()):
            # silu_and_mul after the GEMV even where its epilogue could take it: with e4m3
            # weights the fused epilogue ran slower end to end (H100 batch-1 decode, 285
            # against 290 tok/s; bf16, int8 and int4 weights gain 1.5% from it), ab_runs.txt 16
            out = self.apply_weight_only(layer, x)
            out = silu_and_mul(out) if gated else out
        else:
            out = w8a8_linear(x, layer.qweight, layer.w_scales, self.kind, layer.smooth,
                              layer.act_scale, layer.bias, gated=gated,
                              dtype=layer.params_dtype, out_quant=out_quant)
        return out if out_dtype is None else out.to(out_dtype)

    def apply_weight_only(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """FP8 weights through the Triton weight-only GEMM, x unquantized (the small-M path)."""
        return wint_linear_triton(x, layer.qweight, layer.w_scales[:, None], None, 8, -1, None,
                                  layer.smooth, layer.bias)


QuantMethod = WeightOnlyMethod | W8A8Method


def make_method(cfg: QuantConfig) -> QuantMethod:
    return WeightOnlyMethod(cfg) if cfg.scheme == "wint" else W8A8Method(cfg)


def quantized_linears(model: torch.nn.Module, lm_head: bool = True) -> list[tuple[str, Linear]]:
    """The Linears a config may quantize: every one, the LM head only if ``lm_head``."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and (lm_head or not isinstance(m, LMHead))]


def linear_configs(model: torch.nn.Module, cfg: QuantConfig
                   ) -> list[tuple[str, Linear, QuantConfig]]:
    """The Linears ``cfg`` quantizes, each with its format checked against its shape: ``cfg``
    for the layers, ``cfg.lm_head_config()`` for the LM head (left out when dense)."""
    head = cfg.lm_head_config()
    layers = []
    for name, layer in quantized_linears(model, lm_head=head is not None):
        layer_cfg = head if isinstance(layer, LMHead) else cfg
        layer_cfg.check_layer(layer.in_features, name)
        layers.append((name, layer, layer_cfg))
    return layers


def install_methods(model: torch.nn.Module, cfg: QuantConfig) -> list[tuple[str, Linear]]:
    """Give the config's Linears their methods (the LM head its own); weights untouched."""
    layers = linear_configs(model, cfg)
    for _name, layer, layer_cfg in layers:
        if not hasattr(layer, "params_dtype"):
            layer.params_dtype = layer.weight.dtype
            layer.params_device = layer.weight.device
        layer.method = make_method(layer_cfg)
    return [(name, layer) for name, layer, _ in layers]


__all__ = ["FP8_DTYPE", "QUANTIZED_TENSORS", "QuantMethod", "W8A8Method", "WeightOnlyMethod",
           "check_tensors", "install_methods", "linear_configs", "make_method",
           "quantized_linears"]
