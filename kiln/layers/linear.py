"""Linear layers: tensor-parallel sharding plus a pluggable weight format.

A layer owns the *sharding* (which slice of the checkpoint tensor this rank keeps, where merged
projections such as q/k/v sit); a ``LinearMethod`` owns the *format* (dense, int8, int4, fp8 ...):
how weights are stored after loading and how ``y = x W^T + b`` is computed. Quantized formats
plug in by implementing ``LinearMethod``; the models never change.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kiln.kernels.gemm import dense_gemm_applies, gemm_triton
from kiln.kernels.quant_gemm import dense_gemv, dense_gemv_applies, linear
from kiln.kernels.row_quant import QuantizedRows, RowQuant, quantize_rows
from kiln.parallel import SINGLE, TPContext


class LinearMethod(Protocol):
    """How a Linear stores its weight and runs. ``layer.weight`` is dense [out, in] at load.

    ``apply``'s ``out_dtype`` (None: x's) is how the LM head asks for float32 logits straight
    from the accumulator. ``gated``: the layer is a merged [gate; up] projection and the caller
    wants silu(gate) * up (formats fuse it into a decode GEMV's epilogue where they can).
    ``out_quant``: the next layer wants the result as codes (its ``input_quant``); a format may
    return them (``QuantizedRows``, fusing the quantization), or the tensor, which ``Linear``
    then quantizes. ``residual``: the decoder's residual stream [..., out]; a format whose GEMM
    can add the result into it in place does so and returns None, else it returns the result
    (the RMSNorm after the layer then adds it)."""

    def process_weights_after_loading(self, layer: Linear) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedRows,
              out_dtype: torch.dtype | None = None, gated: bool = False,
              out_quant: RowQuant | None = None, residual: torch.Tensor | None = None
              ) -> torch.Tensor | QuantizedRows | None: ...

    def input_quant(self, layer: Linear, num_rows: int) -> RowQuant | None:
        """How ``apply`` wants ``num_rows`` input rows quantized, so that the RMSNorm before the
        layer can write them as codes (``apply`` then gets ``QuantizedRows``); None: as they
        are."""
        ...


class DenseLinearMethod:
    def process_weights_after_loading(self, layer: Linear) -> None:
        return None

    def input_quant(self, layer: Linear, num_rows: int) -> RowQuant | None:
        return None

    def apply(self, layer: Linear, x: torch.Tensor, out_dtype: torch.dtype | None = None,
              gated: bool = False, out_quant: RowQuant | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        if dense_gemv_applies(x, layer.weight):  # a decode row: the streaming GEMV
            return dense_gemv(x, layer.weight, layer.bias, out_dtype, gated=gated)
        if dense_gemm_applies(x, layer.weight):  # a decode batch: the tile GEMM
            y = gemm_triton(x.reshape(-1, x.shape[-1]).contiguous(), layer.weight, layer.bias,
                            out_dtype, gated=gated)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return linear(x, layer.weight, layer.bias, out_dtype, gated, residual)


class Linear(nn.Module):
    """A linear layer holding this rank's shard of ``out_features x in_features``.

    ``shard_dim`` is 0 for column parallel (outputs split), 1 for row parallel (inputs split).
    ``shards`` lists the logical sub-matrices stacked along the output dimension (q/k/v, or
    gate/up) as ``{shard_id: (offset, size)}`` in *local* rows.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_dim: int | None,
                 tp: TPContext = SINGLE, shards: dict[str, tuple[int, int]] | None = None,
                 method: LinearMethod | None = None, reduce_output: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.shard_dim = shard_dim
        self.shards = shards or {}
        self.reduce_output = reduce_output
        self.method: LinearMethod = method or DenseLinearMethod()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        # a row-parallel bias is added once, after the reduction, so only rank 0 keeps it non-zero
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def input_quant(self, num_rows: int) -> RowQuant | None:
        return self.method.input_quant(self, num_rows)

    def forward(self, x: torch.Tensor | QuantizedRows, gated: bool = False,
                out_quant: RowQuant | None = None, residual: torch.Tensor | None = None
                ) -> torch.Tensor | QuantizedRows | None:
        """gated: this is a merged [gate; up] projection and the result silu(gate) * up
        [..., I] (column parallel: this rank's slice of I, which the row-parallel projection
        after it takes). out_quant: the result as the next layer's input codes. residual: the
        decoder's residual stream [..., out], to which the result is added in place where the
        format adds it in its GEMM (then None is returned; else the result, for the RMSNorm's
        fused residual add)."""
        assert not gated or (not self.reduce_output and list(self.shards) == ["gate", "up"])
        assert residual is None or (out_quant is None and not gated)
        if self.reduce_output and self.tp.size > 1:  # the reduced sum; the norm adds it
            y = self.tp.all_reduce(self.method.apply(self, x))
        else:
            y = self.method.apply(self, x, gated=gated, out_quant=out_quant, residual=residual)
        if out_quant is None or isinstance(y, QuantizedRows):
            return y  # None: added into the residual
        codes, scales = quantize_rows(y, out_quant)
        return QuantizedRows(codes.reshape(*y.shape), scales)

    def _local_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp.size == 1 or dim >= loaded.dim():
            return loaded
        size = loaded.shape[dim] // self.tp.size
        return loaded.narrow(dim, self.tp.rank * size, size)

    def load(self, param_name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy a checkpoint tensor (full, unsharded) into this rank's parameter."""
        param = getattr(self, param_name)
        if param_name == "bias" and self.shard_dim == 1:
            piece = loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
        else:
            piece = self._local_slice(loaded, self.shard_dim) if self.shard_dim is not None \
                else loaded
        target = param.data
        if shard_id is not None:
            offset, size = self.shards[shard_id]
            target = target.narrow(0, offset, size)
        if tuple(piece.shape) != tuple(target.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit parameter "
                             f"{param_name}{'[' + shard_id + ']' if shard_id else ''} of shape "
                             f"{tuple(target.shape)} (tensor_parallel_size={self.tp.size})")
        target.copy_(piece)


def column_parallel(in_features: int, out_sizes: dict[str, int] | int, bias: bool,
                    tp: TPContext = SINGLE) -> Linear:
    """Outputs split across ranks; ``out_sizes`` may name stacked shards (q/k/v, gate/up)."""
    sizes = out_sizes if isinstance(out_sizes, dict) else {"": out_sizes}
    shards, offset = {}, 0
    for shard_id, size in sizes.items():
        local = tp.shard(size, f"output size of shard {shard_id!r}" if shard_id else "out_features")
        shards[shard_id] = (offset, local)
        offset += local
    return Linear(in_features, offset, bias, shard_dim=0, tp=tp,
                  shards=shards if isinstance(out_sizes, dict) else None)


def row_parallel(in_features: int, out_features: int, bias: bool,
                 tp: TPContext = SINGLE) -> Linear:
    """Inputs split across ranks; partial outputs are summed with an all-reduce."""
    return Linear(tp.shard(in_features, "in_features"), out_features, bias, shard_dim=1, tp=tp,
                  reduce_output=True)
