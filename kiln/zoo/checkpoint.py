"""What a zoo training run writes: resumable checkpoints, the loss log, and the final
Hugging Face model directory (bf16 safetensors shards, configs, tokenizer, loss curve)."""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_model, save_model

from kiln.provenance import git_commit
from kiln.zoo.tokenizer import tokenizer_config

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from kiln.zoo.train import TrainConfig

LOG_NAME = "training_log.csv"
LOG_COLUMNS = ("step", "tokens_seen", "lr", "train_loss", "heldout_loss", "grad_norm", "wall_s")
SHARD_SIZE = "15MB"  # keeps every committed weight file under 16 MB


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    train_wall_s: float = 0.0
    num_params: int = 0
    last_train_loss: float | None = None
    last_heldout_loss: float | None = None
    fingerprint: dict = field(default_factory=dict)


def append_log(out_dir: Path, row: list) -> None:
    path = out_dir / LOG_NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(LOG_COLUMNS)
        writer.writerow(["" if v is None else v for v in row])


def read_log(out_dir: Path) -> list[dict[str, float | None]]:
    path = Path(out_dir) / LOG_NAME
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [{k: float(v) if v != "" else None for k, v in r.items()} for r in csv.DictReader(f)]


def truncate_log(out_dir: Path, last_step: int) -> None:
    """Drop the log rows past `last_step`, where a run (re)starts: rows an interrupted run
    logged after its checkpoint (or before its first one, for a fresh start) are logged again
    by this run, and two copies would mix in the CSV and loss.png."""
    path = out_dir / LOG_NAME
    if not path.is_file():
        return
    header, *rows = path.read_text().splitlines(keepends=True)
    path.write_text(header + "".join(r for r in rows if int(r.split(",")[0]) <= last_step))


def save_checkpoint(ckpt_dir: Path, model: torch.nn.Module, optimizer, state: TrainState) -> None:
    """Write to a temporary directory, then swap it in: a crash never leaves half a checkpoint."""
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))  # fp32 master weights
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
    old = ckpt_dir.with_name(ckpt_dir.name + ".old")
    if ckpt_dir.exists():
        os.replace(ckpt_dir, old)
    os.replace(tmp, ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    ckpt_dir: Path, model: torch.nn.Module, optimizer, fingerprint: dict, device: torch.device
) -> TrainState:
    state = TrainState(**json.loads((ckpt_dir / "state.json").read_text()))
    if state.fingerprint != fingerprint:
        diff = {
            k: (state.fingerprint.get(k), v)
            for k, v in fingerprint.items()
            if state.fingerprint.get(k) != v
        }
        raise ValueError(
            f"checkpoint {ckpt_dir} was made with other settings (checkpoint, now): {diff}; "
            "use the same settings or another --out"
        )
    load_model(model, str(ckpt_dir / "model.safetensors"), device=str(device))
    # weights_only: the optimizer file holds tensors and numbers only, never arbitrary objects.
    optim_state = torch.load(ckpt_dir / "optimizer.pt", map_location=device, weights_only=True)
    optimizer.load_state_dict(optim_state)
    return state


def plot_loss(out_dir: Path, title: str) -> Path | None:
    """loss.png from the log; None where matplotlib is missing (draw it elsewhere from the CSV)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_log(out_dir)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(
        [r["tokens_seen"] / 1e6 for r in rows], [r["train_loss"] for r in rows], lw=1, label="train"
    )
    held = [r for r in rows if r["heldout_loss"] is not None]
    ax.plot(
        [r["tokens_seen"] / 1e6 for r in held],
        [r["heldout_loss"] for r in held],
        "o-",
        ms=3,
        label="held-out (in-training sample)",
    )
    ax.set(xlabel="tokens seen (millions)", ylabel="cross-entropy (nats/token)", title=title)
    ax.set_ylim(top=min(10.0, max(r["train_loss"] for r in rows)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def run_environment(device: torch.device) -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "device": gpu or f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def write_final_model(
    cfg: TrainConfig,
    model: LlamaForCausalLM,
    tokenizer_dir: Path,
    state: TrainState,
    device: torch.device,
) -> None:
    out = cfg.out_dir
    model.config.dtype = torch.bfloat16
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id = model.config.bos_token_id, model.config.eos_token_id
    gen.pad_token_id = model.config.pad_token_id
    # bf16 halves the committed bytes; training kept fp32 master weights.
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=SHARD_SIZE)
    shutil.copyfile(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    tok_config = tokenizer_config(model_max_length=cfg.preset.context_len)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    summary = {
        "size": cfg.size,
        "command": cfg.command,
        "git_commit": git_commit(),
        "settings": cfg.fingerprint(),
        "context_len": cfg.preset.context_len,
        "num_params": state.num_params,
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "train_wall_s": round(state.train_wall_s, 1),
        "final_train_loss": state.last_train_loss,
        "final_heldout_sample_loss": state.last_heldout_loss,
        **run_environment(device),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(out, f"{out.name}: {state.num_params / 1e6:.1f}M params, {cfg.size} preset")
