"""The accuracy table: format x method x calibrator -> held-out perplexity and model size.

    python -m kiln.quant.accuracy --model kiln-tiny --max-tokens 8192 --out table.json

Each row quantizes a fresh copy of the dense model (calibrated on the zoo's *train* split by
default, so that the scored held-out text is never seen during calibration) and scores the same
held-out token stream with ``kiln.eval.perplexity``. A tool at the top of the stack: it imports
the loader and the evaluator, which the rest of ``kiln.quant`` never does.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import click

from kiln.quant.config import QuantConfig
from kiln.zoo import DEFAULT_MODEL

ROWS: list[dict[str, Any]] = [
    dict(method="rtn", bits=8, group_size=-1),
    dict(method="rtn", bits=4, group_size=128),
    dict(method="awq", bits=4, group_size=128),
    dict(method="gptq", bits=4, group_size=128),
    dict(method="gptq", bits=4, group_size=128, act_order=True),
    dict(method="rtn", bits=4, group_size=128, symmetric=False),
    dict(method="awq", bits=4, group_size=128, symmetric=False),
    dict(method="gptq", bits=4, group_size=128, symmetric=False, act_order=True),
    dict(method="fp8", scheme="w8a8"),
    dict(method="fp8", scheme="w8a8", weight_granularity="tensor"),
    dict(method="rtn", scheme="w8a8", w8a8_dtype="int8"),
    dict(method="smoothquant", scheme="w8a8", w8a8_dtype="int8"),
    *[dict(method="smoothquant", scheme="w8a8", w8a8_dtype="int8", activation_scheme="static",
           observer=obs) for obs in ("minmax", "percentile", "entropy", "mse")],
]


def accuracy_table(model: str = DEFAULT_MODEL, max_tokens: int = 4096, window: int | None = 512,
                   stride: int | None = 384, calibration: str = "zoo-train",
                   num_samples: int = 64, seq_len: int = 256,
                   device: str = "cpu", rows: list[dict[str, Any]] | None = None,
                   eval_file: Path | None = None) -> list[dict[str, Any]]:
    from kiln.eval.perplexity import dataset_texts, encode_documents, kiln_logits_fn, perplexity
    from kiln.models.loader import load_model
    from kiln.quant.calibration import calibration_ids
    from kiln.quant.quantize import collect_stats, model_size_bytes, quantize_model

    dense = load_model(model, device=device)
    ids = encode_documents(dense.tokenizer, dataset_texts(
        None if eval_file else "zoo-heldout", eval_file), max_tokens)
    window = window or dense.arch.max_position_embeddings
    seq_len = min(seq_len, dense.arch.max_position_embeddings)
    calib = calibration_ids(dense.tokenizer, calibration, num_samples, seq_len)
    stats = collect_stats(dense.model, calib)  # all rows calibrate on the same dense model

    def score(loaded: Any) -> float:
        return perplexity(kiln_logits_fn(loaded), ids, window, stride).perplexity

    base = score(dense)
    size = model_size_bytes(dense.model)
    out = [dict(format=f"dense {str(dense.dtype).removeprefix('torch.')}", method="-",
                calibrator="-", ppl=base, delta_pct=0.0, linear_mib=size["linear"] / 2**20,
                total_mib=sum(size.values()) / 2**20, seconds=0.0)]
    for kwargs in ROWS if rows is None else rows:
        cfg = QuantConfig(**kwargs)
        start = time.perf_counter()
        quantized = copy.copy(dense)
        quantized.model = copy.deepcopy(dense.model)
        quantize_model(quantized.model, cfg, calib, kv_scales=False, stats=stats)
        ppl = score(quantized)
        size = model_size_bytes(quantized.model)
        static = cfg.scheme == "w8a8" and cfg.activation_scheme == "static"
        label, _, method = cfg.name.rstrip(")").rpartition(" (")
        out.append(dict(format=label, method=method,
                        calibrator=cfg.observer if static else "-", ppl=ppl,
                        delta_pct=100 * (ppl / base - 1), linear_mib=size["linear"] / 2**20,
                        total_mib=sum(size.values()) / 2**20,
                        seconds=time.perf_counter() - start))
        print(markdown(out[-1:], header=len(out) == 2), flush=True)
    return out


def markdown(rows: list[dict[str, Any]], header: bool = True) -> str:
    lines = ["| format | method | calibrator | perplexity | delta | linear MiB | total MiB |",
             "|---|---|---|---|---|---|---|"] if header else []
    for r in rows:
        lines.append(f"| {r['format']} | {r['method']} | {r['calibrator']} | {r['ppl']:.4f} | "
                     f"{r['delta_pct']:+.2f}% | {r['linear_mib']:.2f} | {r['total_mib']:.2f} |")
    return "\n".join(lines)


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--max-tokens", type=int, default=4096, show_default=True)
@click.option("--window", type=int, default=512, show_default=True)
@click.option("--stride", type=int, default=384, show_default=True)
@click.option("--calibration", default="zoo-train", show_default=True)
@click.option("--num-samples", type=int, default=64, show_default=True)
@click.option("--seq-len", type=int, default=256, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dense-lm-head", is_flag=True,
              help="weight-only rows keep the LM head dense instead of W8A16 (W8A8 rows "
              "always do)")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="JSON rows")
def main(model: str, max_tokens: int, window: int, stride: int, calibration: str,
         num_samples: int, seq_len: int, device: str, dense_lm_head: bool,
         out: Path | None) -> None:
    """Perplexity of every quantization row on the zoo held-out split."""
    configs = [dict(r, lm_head_bits=None) for r in ROWS] if dense_lm_head else None
    rows = accuracy_table(model, max_tokens, window, stride, calibration, num_samples, seq_len,
                          device, configs)
    click.echo(markdown(rows))
    if out is not None:
        out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
