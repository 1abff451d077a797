"""Quantize a loaded dense model in place: calibrate, choose each Linear's grid, install methods.

    cfg = QuantConfig(method="awq", bits=4, group_size=128)
    quantize_model(model, cfg, calibration_ids(tokenizer, "zoo-train", 64, 512))

All statistics come from the dense model in one pass over the calibration ids (plus a second
pass for static activation ranges, which must be observed after SmoothQuant's smoothing).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.quant.awq import awq_quantize
from kiln.quant.calibration import LinearStats, collect_kv_amax, collect_linear_stats
from kiln.quant.config import QuantConfig
from kiln.quant.gptq import gptq_quantize
from kiln.quant.kv_cache import FP8_MAX, set_kv_scales
from kiln.quant.methods import (
    W8A8Method,
    WeightOnlyMethod,
    install_methods,
    linear_configs,
    quantized_linears,
)
from kiln.quant.observers import QMAX, make_observer
from kiln.quant.rtn import rtn_quantize
from kiln.quant.smoothquant import smooth_scales

log = logging.getLogger("kiln.quant")
AWQ_ROWS = 512  # calibration rows per layer for AWQ's search
CALIBRATED = ("awq", "gptq", "smoothquant")  # the methods that need statistics of the inputs


def needs_calibration(cfg: QuantConfig) -> bool:
    return cfg.method in CALIBRATED or (
        cfg.scheme == "w8a8" and cfg.activation_scheme == "static")


def collect_stats(model: nn.Module, ids: torch.Tensor, batch_size: int = 4
                  ) -> dict[str, LinearStats]:
    """Every statistic AWQ, GPTQ and SmoothQuant use, in one pass (to share between runs), of
    every Linear: the LM head too, for a config that puts it in the layers' 4-bit format."""
    return collect_linear_stats(model, quantized_linears(model), ids, lambda _name: LinearStats(
        channel_max=True, channel_mean=True, hessian=True, num_samples=AWQ_ROWS), batch_size)


def check_dense(layers: list[tuple[str, nn.Module, QuantConfig]]) -> None:
    """Refuse Linears that hold no dense weight: rounding them again would need the weights
    they were rounded from (the model came quantized, from a checkpoint or the on-the-fly
    ``quantization`` option, or went through ``quantize_model`` already)."""
    done = [name for name, layer, _ in layers if "weight" not in layer._parameters]
    if done:
        raise ValueError(f"the model is already quantized ({done[0]} holds no dense weight); "
                         "quantize_model needs the dense model: load the dense checkpoint "
                         "(without quantization) and quantize that")


def quantize_model(model: nn.Module, cfg: QuantConfig, ids: torch.Tensor | None = None,
                   batch_size: int = 4, kv_scales: bool = True,
                   stats: dict[str, LinearStats] | None = None) -> QuantConfig:
    """Quantize every Linear of ``model`` (dense weights loaded) as ``cfg`` says.

    The LM head takes ``cfg.lm_head_config()``: W8A16 by RTN, which needs no statistics, or
    (``lm_head_bits=4``) the layers' method, AWQ and GPTQ calibrating it on the final hidden
    states like any layer's inputs.

    ``ids`` [num_samples, seq_len] are the calibration tokens; they are required by AWQ, GPTQ,
    SmoothQuant and static activation scales, and when given (and ``kv_scales``) also set the
    FP8 KV-cache scales. ``stats`` from ``collect_stats`` on the same dense model and ids
    skip the statistics pass. Returns ``cfg`` with ``kv_cache_scales`` filled in.
    """
    layers = linear_configs(model, cfg)
    check_dense(layers)
    if needs_calibration(cfg) and ids is None:
        raise ValueError(f"method={cfg.method!r} (activations {cfg.activation_scheme}) needs "
                         "calibration data")
    # only the layers quantized by cfg's method: an RTN LM head needs no statistics
    calibrated = [(name, layer) for name, layer, layer_cfg in layers
                  if layer_cfg.method in CALIBRATED]
    if stats is None and calibrated:
        def make(_name: str) -> LinearStats:
            return LinearStats(channel_max=cfg.method == "smoothquant",
                               channel_mean=cfg.method == "awq", hessian=cfg.method == "gptq",
                               num_samples=AWQ_ROWS if cfg.method == "awq" else 0)
        stats = collect_linear_stats(model, calibrated, ids, make, batch_size)
    stats = stats or {}
    smooth: dict[str, torch.Tensor] = {}
    if cfg.method == "smoothquant":
        for name, layer in calibrated:
            smooth[name] = 1.0 / smooth_scales(stats[name].abs_max, layer.weight, cfg.alpha)
    act_amax: dict[str, float] = {}
    if cfg.scheme == "w8a8" and cfg.activation_scheme == "static":
        kind = cfg.w8a8_dtype
        observed = collect_linear_stats(
            model, [(name, layer) for name, layer, _ in layers], ids,
            lambda n: LinearStats(observer=make_observer(cfg.observer, kind),
                                  transform=smooth.get(n)), batch_size)
        act_amax = {name: s.observer.amax() for name, s in observed.items()}

    install_methods(model, cfg)
    for name, layer, layer_cfg in layers:
        w = layer.weight.detach().float()
        dtype = layer.params_dtype
        method = layer.method
        if isinstance(method, WeightOnlyMethod):
            bits, gs, sym = layer_cfg.bits, layer_cfg.group_size, layer_cfg.symmetric
            if layer_cfg.method == "awq":
                st = stats[name]
                q = awq_quantize(w, st.sample(), st.abs_mean, bits, gs, sym, dtype)
            elif layer_cfg.method == "gptq":
                q = gptq_quantize(w, stats[name].hessian_matrix, bits, gs, sym,
                                  layer_cfg.act_order, scale_dtype=dtype)
            else:
                q = rtn_quantize(w, bits, gs, sym, dtype)
            method.set_weight(layer, q)
        else:
            assert isinstance(method, W8A8Method)
            sm = smooth.get(name)
            act_scale = (torch.tensor(max(act_amax[name], 1e-6) / QMAX[cfg.w8a8_dtype])
                         if name in act_amax else None)
            method.quantize_dense(layer, w if sm is None else w / sm, sm, act_scale)
        log.info("quantized %s (%s)", name, layer_cfg.name)
    if ids is not None and kv_scales:
        amax = collect_kv_amax(model, ids, batch_size)
        cfg.kv_cache_scales = [[max(k, 1e-6) / FP8_MAX, max(v, 1e-6) / FP8_MAX] for k, v in amax]
        set_kv_scales(model, cfg.kv_cache_scales)
    return cfg


def model_size_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the checkpoint (``state_dict``, tied weights once): Linear layers and the rest.

    The LM head is a Linear; a dense tied one is the embedding's tensor, counted as the rest.
    """
    linear_names = {name for name, _ in quantized_linears(model)}
    seen: set[int] = set()
    sizes = {"linear": 0, "other": 0}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        part = "linear" if name.rpartition(".")[0] in linear_names else "other"
        sizes[part] += t.numel() * t.element_size()
    return sizes
