"""Calibration: token windows from text, and statistics of each Linear's inputs.

Statistics are gathered with forward pre-hooks while ``model.full_logits(ids)`` runs over the
calibration batches (any module with ``full_logits`` and Linear layers works). What is kept per
layer depends on the method: per-channel |x| max and mean (SmoothQuant, AWQ), X^T X (GPTQ), a
random subsample of input rows (AWQ's search), an observer of the (smoothed) input (static
activation scales). Attention layers report |k| and |v| maxima (FP8 KV-cache scales).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.kernels.rotary import apply_rotary_ref
from kiln.quant.kv_cache import attention_layers
from kiln.quant.observers import MinMaxObserver, finite_abs

SOURCES = ("zoo-train", "zoo-heldout")


def calibration_texts(source: str) -> Iterable[str]:
    """A text file, or the zoo corpus split ('zoo-train', 'zoo-heldout') in a seeded order."""
    if source in SOURCES:
        from kiln.zoo import corpus

        files = corpus.read_files(source.removeprefix("zoo-"))
        random.Random(0).shuffle(files)  # spread the samples over the whole library
        return (f.text for f in files)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"calibration={source!r} is neither a text file nor one of "
                         f"{', '.join(SOURCES)}")
    return [path.read_text(encoding="utf-8", errors="replace")]


def calibration_ids(tokenizer: Any, source: str, num_samples: int, seq_len: int,
                    seed: int = 0) -> torch.Tensor:
    """[num_samples, seq_len] int64 windows cut at random offsets from `<bos> text <eos>`."""
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples}, {seq_len}")
    # (here, not at the top: kiln.quant loads with every quantized model, eval's CLI need not)
    from kiln.eval.perplexity import encode_documents

    need = 4 * num_samples * seq_len  # headroom so that windows rarely overlap
    stream = encode_documents(tokenizer, calibration_texts(source), max_tokens=need)
    if len(stream) < seq_len:
        raise ValueError(f"calibration text {source!r} has {len(stream)} tokens; seq_len "
                         f"{seq_len} needs more")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len + 1, (num_samples,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


@dataclass
class LinearStats:
    channel_max: bool = False
    channel_mean: bool = False
    hessian: bool = False
    num_samples: int = 0  # input rows to keep (reservoir), 0: none
    observer: MinMaxObserver | None = None
    transform: torch.Tensor | None = None  # multiply inputs by this before observing
    abs_max: torch.Tensor | None = None  # [K]
    abs_sum: torch.Tensor | None = None  # [K]
    xtx: torch.Tensor | None = None  # [K, K] float32
    rows: torch.Tensor | None = None  # [<= num_samples, K] uniform sample of all rows seen
    row_keys: torch.Tensor | None = None
    num_rows: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)  # reproducible row sample

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        a = finite_abs(x)  # (max / mean / X^T X would carry a NaN into scales or the Cholesky)
        if self.channel_max:
            m = a.amax(0)
            self.abs_max = m if self.abs_max is None else torch.maximum(self.abs_max, m)
        if self.channel_mean:
            s = a.sum(0)
            self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        if self.hessian:
            h = x.t() @ x
            self.xtx = h if self.xtx is None else self.xtx + h
        if self.num_samples:
            # keep the rows with the smallest random keys: a uniform sample in bounded memory
            keys = torch.rand(x.shape[0], generator=self._gen).to(x.device)
            if self.rows is not None:
                keys, x_all = torch.cat([self.row_keys, keys]), torch.cat([self.rows, x])
            else:
                x_all = x
            keep = keys.argsort()[: self.num_samples]
            self.row_keys, self.rows = keys[keep], x_all[keep]
        if self.observer is not None:
            self.observer.update(x if self.transform is None else x * self.transform)
        self.num_rows += x.shape[0]

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.num_rows, 1)

    @property
    def hessian_matrix(self) -> torch.Tensor:
        """H = 2 X^T X / n (GPTQ's Hessian of the layer's squared output error)."""
        return 2 * self.xtx / max(self.num_rows, 1)

    def sample(self) -> torch.Tensor:
        """Up to ``num_samples`` input rows drawn uniformly from all calibration tokens."""
        return self.rows


def run_batches(model: nn.Module, ids: torch.Tensor, batch_size: int,
                hooks: Iterable[tuple[nn.Module, Callable]] = ()) -> None:
    """Run the calibration ids through the model with forward pre-hooks attached meanwhile."""
    handles = [module.register_forward_pre_hook(hook) for module, hook in hooks]
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for begin in range(0, ids.shape[0], batch_size):
                model.full_logits(ids[begin : begin + batch_size].to(device))
    finally:
        for handle in handles:
            handle.remove()


def collect_linear_stats(model: nn.Module, layers: list[tuple[str, nn.Module]],
                         ids: torch.Tensor, make_stats: Callable[[str], LinearStats],
                         batch_size: int = 4) -> dict[str, LinearStats]:
    """Run the calibration ids through the model and gather ``make_stats(name)`` for each of
    ``layers`` (named Linears of the model) from its inputs."""
    stats: dict[str, LinearStats] = {}
    hooks = []
    for name, layer in layers:
        stats[name] = make_stats(name)
        hooks.append((layer, (lambda s: lambda _mod, args: s.update(args[0]))(stats[name])))
    run_batches(model, ids, batch_size, hooks)
    return stats


def collect_kv_amax(model: nn.Module, ids: torch.Tensor, batch_size: int = 4
                    ) -> list[list[float]]:
    """Per attention layer (in layer order): [max |k|, max |v|] over the calibration ids."""
    layers = attention_layers(model)
    amax = [[MinMaxObserver(), MinMaxObserver()] for _ in layers]

    def hook_for(obs: list[MinMaxObserver]) -> Callable:
        def hook(_mod, args):  # args: (q, k, v, meta, positions, cos_sin_cache)
            # the cache stores k after rotary, which can raise |k| by up to sqrt(2)
            obs[0].update(apply_rotary_ref(args[0], args[1], args[4], args[5])[1])
            obs[1].update(args[2])
        return hook

    run_batches(model, ids, batch_size,
                [(attn, hook_for(obs)) for attn, obs in zip(layers, amax, strict=True)])
    return [[k.amax(), v.amax()] for k, v in amax]
