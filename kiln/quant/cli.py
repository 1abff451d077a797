"""``kiln quantize``: dense checkpoint in, quantized checkpoint (safetensors + JSON) out.

    kiln quantize --model kiln-tiny --method awq --bits 4 --group-size 128 --out tiny-awq
    kiln generate --model tiny-awq --prompt "def "      # loads the result directly
"""

from __future__ import annotations

import time
from pathlib import Path

import click
from click.core import ParameterSource

from kiln.config import DEVICE_CHOICES, DTYPE_CHOICES
from kiln.quant.calibration import SOURCES
from kiln.quant.config import ACTIVATION_SCHEMES, METHODS, OBSERVERS, W8A8_DTYPES, QuantConfig
from kiln.zoo import DEFAULT_MODEL

WEIGHT_ONLY = ("rtn", "awq", "gptq")
W8A8 = ("fp8", "smoothquant")
# the options (click parameter names) that only some methods use, and those methods: given
# explicitly to another method, one is an error rather than silently ignored
METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "bits": WEIGHT_ONLY, "group_size": WEIGHT_ONLY, "asym": WEIGHT_ONLY,
    "dense_lm_head": WEIGHT_ONLY, "act_order": ("gptq",), "w8a8_dtype": ("smoothquant",),
    "weight_scale": W8A8, "activation_scheme": W8A8, "observer": W8A8, "alpha": ("smoothquant",),
}
WHAT_METHOD_MAKES = {**dict.fromkeys(WEIGHT_ONLY, "weight-only W4A16 / W8A16"),
                     "fp8": "FP8 W8A8, 8-bit", "smoothquant": "INT8 or FP8 W8A8, 8-bit"}


def build_config(method: str, bits: int, group_size: int | None, asym: bool, act_order: bool,
                 w8a8_dtype: str | None, weight_scale: str, activation_scheme: str,
                 observer: str, alpha: float, dense_lm_head: bool) -> QuantConfig:
    """Map command-line choices onto one QuantConfig (its checks give the error messages).

    Options that ``method`` does not use are ignored here: ``check_method_options`` has
    refused them when given explicitly.
    """
    if method in WEIGHT_ONLY:
        if group_size is None:
            group_size = 128 if bits == 4 else -1
        return QuantConfig(method=method, scheme="wint", bits=bits, group_size=group_size,
                           symmetric=not asym, act_order=act_order, observer=observer,
                           lm_head_bits=None if dense_lm_head else 8)
    dtype = "fp8" if method == "fp8" else w8a8_dtype or "int8"
    return QuantConfig(method=method, scheme="w8a8", w8a8_dtype=dtype,
                       weight_granularity=weight_scale, activation_scheme=activation_scheme,
                       observer=observer, alpha=alpha)


def given(ctx: click.Context, name: str) -> bool:
    """Whether option ``name`` was set by the user, not left at its default."""
    return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT,
                                                  ParameterSource.DEFAULT_MAP)


def option_text(ctx: click.Context, name: str) -> tuple[str, str]:
    """``name``'s flag as typed and with its value, e.g. ('--bits', '--bits 4')."""
    param = next(p for p in ctx.command.params if p.name == name)
    flag = param.opts[0]
    value = ctx.params[name]
    return flag, flag if isinstance(param, click.Option) and param.is_flag else f"{flag} {value}"


def check_method_options(ctx: click.Context, method: str, activation_scheme: str) -> None:
    """Refuse an explicitly given option that ``method`` (or the activation scheme) ignores."""
    for name, methods in METHOD_OPTIONS.items():
        if method in methods or not given(ctx, name):
            continue
        flag, typed = option_text(ctx, name)
        takes = ", ".join(option_text(ctx, n)[0] for n, ms in METHOD_OPTIONS.items()
                          if method in ms)
        raise click.UsageError(
            f"{typed} does not apply to --method {method} ({WHAT_METHOD_MAKES[method]}), which "
            f"takes {takes}; drop {flag} (it is for --method {' / '.join(methods)})")
    if given(ctx, "observer") and activation_scheme != "static":
        _, typed = option_text(ctx, "observer")
        raise click.UsageError(
            f"{typed} does not apply to --activation-scheme {activation_scheme} (its scales "
            "are computed per token at run time); pass --activation-scheme static or drop "
            "--observer")


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse an --out that is or lies under a file, or a non-empty one without --overwrite.

    --overwrite replaces only a directory that holds a checkpoint (config.json): an --out
    pointing at, say, a home or project directory by mistake is never wiped.
    """
    out = Path(out_dir)
    if not out.exists():
        ancestor = next((p for p in out.parents if p.exists()), None)
        if ancestor is not None and not ancestor.is_dir():
            raise click.UsageError(f"--out {out_dir}: {ancestor} is a file, not a directory; "
                                   "choose another --out")
        return
    if not out.is_dir():
        raise click.UsageError(f"--out {out_dir} is a file; choose a directory path")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise click.UsageError(f"--out {out_dir} already exists and is not empty; choose "
                               "another --out or pass --overwrite to replace it")
    if not (out / "config.json").is_file():
        raise click.UsageError(f"--out {out_dir} is not empty and holds no checkpoint (no "
                               "config.json); --overwrite replaces checkpoint directories only: "
                               "choose another --out")


def check_not_source(out_dir: str, model: str) -> None:
    """Refuse an --out that is or holds the --model directory: the quantized checkpoint would
    replace it (with --overwrite), losing the dense weights that any later quantization
    needs."""
    if not Path(model).is_dir():
        return
    source, out = Path(model).resolve(), Path(out_dir).resolve()
    if source == out:
        raise click.UsageError(f"--out {out_dir} is the --model directory; the quantized "
                               "checkpoint would replace the dense one: choose another --out")
    if source.is_relative_to(out):
        raise click.UsageError(f"--out {out_dir} holds the --model directory {model}; the "
                               "quantized checkpoint would replace it with the dense one inside: "
                               "choose another --out")


def check_dense_checkpoint(model: str, path: Path) -> None:
    """Refuse a checkpoint that ``kiln quantize`` wrote: it holds codes, not the dense weights
    a method rounds (and rounding rounded weights again only adds error)."""
    from kiln.quant.checkpoint import read_quant_config

    pre = read_quant_config(path)
    if pre is not None:
        raise ValueError(f"{model} is already quantized ({pre.name}); kiln quantize takes a "
                         "dense checkpoint: pass the dense model it was made from as --model")


def check_seq_len(ctx: click.Context, seq_len: int, model: str, path: Path) -> int:
    """--seq-len within the context of the model at ``path`` (its config.json, before loading):
    an explicit one past it is an error, the default is capped to it."""
    from kiln.models.loader import read_arch

    context = read_arch(path).max_position_embeddings
    if seq_len <= context:
        return seq_len
    if given(ctx, "seq_len"):
        raise click.UsageError(f"--seq-len {seq_len} exceeds the context of {model} ({context} "
                               f"tokens); pass --seq-len {context} or less")
    return context


@click.command("quantize")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="dense checkpoint directory, hub id or zoo name")
@click.option("--method", type=click.Choice(METHODS), required=True)
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True,
              help="weight bits of the layers for rtn / awq / gptq (the LM head takes 8)")
@click.option("--group-size", type=int, default=None,
              help="rtn / awq / gptq: 32, 64, 128, or -1 per channel "
              "[default: 128 for 4 bits, -1 for 8]")
@click.option("--asym", is_flag=True, help="rtn / awq / gptq: asymmetric grid (zero points)")
@click.option("--act-order", is_flag=True, help="GPTQ: columns by decreasing Hessian diagonal")
@click.option("--dense-lm-head", is_flag=True,
              help="rtn / awq / gptq: keep the LM head in the model dtype instead of W8A16 "
              "(int8 per output channel, RTN); W8A8 always keeps it dense")
@click.option("--w8a8-dtype", type=click.Choice(W8A8_DTYPES), default=None,
              help="smoothquant: int8 (default) or fp8")
@click.option("--weight-scale", type=click.Choice(["channel", "tensor"]), default="channel",
              show_default=True, help="fp8 / smoothquant: W8A8 weight scales")
@click.option("--activation-scheme", type=click.Choice(ACTIVATION_SCHEMES), default="dynamic",
              show_default=True,
              help="fp8 / smoothquant: per-token dynamic or calibrated static scale")
@click.option("--observer", type=click.Choice(OBSERVERS), default="minmax", show_default=True,
              help="range of static activation scales (--activation-scheme static)")
@click.option("--alpha", type=float, default=0.5, show_default=True,
              help="SmoothQuant migration strength")
@click.option("--calibration", default="zoo-train", show_default=True,
              help=f"a text file or {' / '.join(SOURCES)}")
@click.option("--num-samples", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=2), default=512,
              help="calibration window in tokens, at most the model's context "
              "[default: 512, or the context if shorter]")
@click.option("--out", "out_dir", required=True, help="output directory")
@click.option("--overwrite", is_flag=True,
              help="replace --out if it already holds a checkpoint")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True)
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.pass_context
def quantize_cmd(ctx: click.Context, model: str, method: str, bits: str, group_size: int | None,
                 asym: bool, act_order: bool, dense_lm_head: bool, w8a8_dtype: str | None,
                 weight_scale: str, activation_scheme: str, observer: str, alpha: float,
                 calibration: str, num_samples: int, seq_len: int, out_dir: str,
                 overwrite: bool, dtype: str, device: str, seed: int) -> None:
    """Quantize MODEL with METHOD and write a checkpoint that Kiln loads directly."""
    from kiln.models.loader import load_model, resolve_model_path
    from kiln.quant.calibration import calibration_ids
    from kiln.quant.checkpoint import StagedDir, save_quantized
    from kiln.quant.quantize import model_size_bytes, needs_calibration, quantize_model

    start = time.perf_counter()
    # every check before any work: a mistake costs seconds, not a quantization run
    check_method_options(ctx, method, activation_scheme)
    try:
        cfg = build_config(method, int(bits), group_size, asym, act_order, w8a8_dtype,
                           weight_scale, activation_scheme, observer, alpha, dense_lm_head)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    check_out_dir(out_dir, overwrite)
    check_not_source(out_dir, model)
    try:
        staged = StagedDir(out_dir)
    except OSError as exc:
        raise click.ClickException(f"cannot write --out {out_dir}: {exc.strerror} (creating "
                                   f"{exc.filename}); choose a location you can write to"
                                   ) from None
    # the checkpoint is built under a hidden name and replaces --out only when complete: a
    # failure or an interrupt leaves nothing behind and an overwritten checkpoint intact
    with staged as staging:
        try:
            path = resolve_model_path(model)
            check_dense_checkpoint(model, path)
            seq_len = check_seq_len(ctx, seq_len, model, path)
            loaded = load_model(str(path), dtype=dtype, device=device, seed=seed)
            before = model_size_bytes(loaded.model)
            ids = None
            if needs_calibration(cfg) or loaded.tokenizer is not None:
                if loaded.tokenizer is None:
                    raise ValueError(f"{model} has no tokenizer to encode calibration text")
                ids = calibration_ids(loaded.tokenizer, calibration, num_samples, seq_len, seed)
                cfg.calibration = {"source": calibration, "num_samples": num_samples,
                                   "seq_len": seq_len, "seed": seed}
            quantize_model(loaded.model, cfg, ids)
            save_quantized(loaded.model, cfg, staging, loaded.path)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            raise click.ClickException(str(exc)) from None
    after = model_size_bytes(loaded.model)
    click.echo(f"{cfg.name}: linear layers {before['linear'] / 2**20:.1f} MiB -> "
               f"{after['linear'] / 2**20:.1f} MiB, total {sum(before.values()) / 2**20:.1f} -> "
               f"{sum(after.values()) / 2**20:.1f} MiB ({loaded.dtype}); "
               f"{time.perf_counter() - start:.1f} s")
    click.echo(f"wrote {out_dir}")
