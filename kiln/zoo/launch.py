"""Start a training run: resolve a time budget into steps and record the command line that
started the run. Free of typer, so a bare machine with only torch and transformers can call
`run_training` directly."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kiln.provenance import command_line
from kiln.zoo.checkpoint import TrainState
from kiln.zoo.train import (
    TrainConfig,
    autocast,
    build_model,
    check_out_dir,
    llama_config,
    make_optimizer,
    resolve_device,
    train,
)


def estimate_steps(cfg: TrainConfig, budget_s: float, num_timed: int = 10) -> int:
    """Steps that fit `budget_s` seconds, from timing a few steps on random tokens."""
    device = resolve_device(cfg.device)
    config = llama_config(cfg.size, 8192, {"bos": 1, "eos": 2, "pad": 0})
    model = build_model(config, cfg.seed).to(device)
    optimizer = make_optimizer(model, cfg, device)
    batch = torch.randint(0, 8192, (cfg.batch_size, cfg.preset.context_len), device=device)
    for i in range(num_timed + 3):
        if i == 3:  # the first steps pay for allocation and kernel selection
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss.item()
    step_s = (time.perf_counter() - t0) / num_timed
    del model, optimizer
    return max(1, int(budget_s / step_s))


def run_training(
    cfg: TrainConfig, budget_s: float | None = None, log: Callable[[str], None] = print
) -> TrainState:
    """Train `cfg`; with `budget_s`, first set cfg.steps to what fits that many seconds here."""
    if budget_s is not None:
        check_out_dir(cfg.out_dir)  # (train checks it too, but the estimate runs first)
        cfg.steps = estimate_steps(cfg, budget_s)
        cfg.warmup_steps = None
        cfg.__post_init__()  # re-derive the warmup from the new step count
        log(f"budget {budget_s:g}s: {cfg.steps} steps fit")
    # As given, every flag included (bench's result.json records it the same way); a budget's
    # resolved step count is in training.json's settings.
    cfg.command = command_line()
    return train(cfg, log=log)
