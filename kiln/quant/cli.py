"""``kiln quantize``: dense checkpoint in, quantized checkpoint (safetensors + JSON) out.

    kiln quantize --model kiln-tiny --method awq --bits 4 --group-size 128 --out tiny-awq
    kiln generate --model tiny-awq --prompt "def "      # loads the result directly
"""

from __future__ import annotations

import time

import click

from kiln.quant.calibration import SOURCES
from kiln.quant.config import ACTIVATION_SCHEMES, METHODS, OBSERVERS, W8A8_DTYPES, QuantConfig


def build_config(method: str, bits: int, group_size: int | None, asym: bool, act_order: bool,
                 w8a8_dtype: str | None, weight_scale: str, activation_scheme: str,
                 observer: str, alpha: float, dense_lm_head: bool) -> QuantConfig:
    """Map command-line choices onto one QuantConfig (its checks give the error messages)."""
    if method in ("rtn", "awq", "gptq"):
        if group_size is None:
            group_size = 128 if bits == 4 else -1
        return QuantConfig(method=method, scheme="wint", bits=bits, group_size=group_size,
                           symmetric=not asym, act_order=act_order, observer=observer,
                           lm_head_bits=None if dense_lm_head else 8)
    dtype = w8a8_dtype or ("fp8" if method == "fp8" else "int8")
    if method == "fp8" and dtype != "fp8":
        raise ValueError("method='fp8' stores FP8 weights; use smoothquant for INT8 W8A8")
    return QuantConfig(method=method, scheme="w8a8", w8a8_dtype=dtype,
                       weight_granularity=weight_scale, activation_scheme=activation_scheme,
                       observer=observer, alpha=alpha)


@click.command("quantize")
@click.option("--model", default="kiln-tiny", show_default=True,
              help="dense checkpoint directory, hub id or zoo name")
@click.option("--method", type=click.Choice(METHODS), required=True)
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True,
              help="weight bits of the layers for rtn / awq / gptq (the LM head takes 8)")
@click.option("--group-size", type=int, default=None,
              help="32, 64, 128, or -1 per channel [default: 128 for 4 bits, -1 for 8]")
@click.option("--asym", is_flag=True, help="asymmetric grid (zero points)")
@click.option("--act-order", is_flag=True, help="GPTQ: columns by decreasing Hessian diagonal")
@click.option("--dense-lm-head", is_flag=True,
              help="rtn / awq / gptq: keep the LM head in the model dtype instead of W8A16 "
              "(int8 per output channel, RTN); W8A8 always keeps it dense")
@click.option("--w8a8-dtype", type=click.Choice(W8A8_DTYPES), default=None,
              help="smoothquant: int8 (default) or fp8")
@click.option("--weight-scale", type=click.Choice(["channel", "tensor"]), default="channel",
              show_default=True, help="W8A8 weight scales")
@click.option("--activation-scheme", type=click.Choice(ACTIVATION_SCHEMES), default="dynamic",
              show_default=True, help="W8A8: per-token dynamic or calibrated static scale")
@click.option("--observer", type=click.Choice(OBSERVERS), default="minmax", show_default=True,
              help="range of static activation scales")
@click.option("--alpha", type=float, default=0.5, show_default=True,
              help="SmoothQuant migration strength")
@click.option("--calibration", default="zoo-train", show_default=True,
              help=f"a text file or {' / '.join(SOURCES)}")
@click.option("--num-samples", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=2), default=512, show_default=True)
@click.option("--out", "out_dir", required=True, help="output directory")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def quantize_cmd(model: str, method: str, bits: str, group_size: int | None, asym: bool,
                 act_order: bool, dense_lm_head: bool, w8a8_dtype: str | None, weight_scale: str,
                 activation_scheme: str, observer: str, alpha: float, calibration: str,
                 num_samples: int, seq_len: int, out_dir: str, dtype: str, device: str,
                 seed: int) -> None:
    """Quantize MODEL with METHOD and write a checkpoint that Kiln loads directly."""
    from kiln.models.loader import load_model
    from kiln.quant.calibration import calibration_ids
    from kiln.quant.checkpoint import save_quantized
    from kiln.quant.quantize import model_size_bytes, needs_calibration, quantize_model

    start = time.perf_counter()
    try:
        cfg = build_config(method, int(bits), group_size, asym, act_order, w8a8_dtype,
                           weight_scale, activation_scheme, observer, alpha, dense_lm_head)
        loaded = load_model(model, dtype=dtype, device=device, seed=seed)
        before = model_size_bytes(loaded.model)
        ids = None
        if needs_calibration(cfg) or loaded.tokenizer is not None:
            if loaded.tokenizer is None:
                raise ValueError(f"{model} has no tokenizer to encode calibration text")
            seq_len = min(seq_len, loaded.arch.max_position_embeddings)
            ids = calibration_ids(loaded.tokenizer, calibration, num_samples, seq_len, seed)
            cfg.calibration = {"source": calibration, "num_samples": num_samples,
                               "seq_len": seq_len, "seed": seed}
        quantize_model(loaded.model, cfg, ids)
        save_quantized(loaded.model, cfg, out_dir, loaded.path)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    after = model_size_bytes(loaded.model)
    click.echo(f"{cfg.name}: linear layers {before['linear'] / 2**20:.1f} MiB -> "
               f"{after['linear'] / 2**20:.1f} MiB, total {sum(before.values()) / 2**20:.1f} -> "
               f"{sum(after.values()) / 2**20:.1f} MiB ({loaded.dtype}); "
               f"{time.perf_counter() - start:.1f} s")
    click.echo(f"wrote {out_dir}")
