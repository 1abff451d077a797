"""Training loop for the zoo's Llama models: AdamW, warmup + cosine, gradient clipping,
bf16 autocast on GPU, periodic checkpoints and exact resume.

The data order is a pure function of (seed, step), so a resumed run sees the same batches as an
uninterrupted one: the checkpoint only needs the weights, the optimizer state and the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kiln.models.loader import resolve_device
from kiln.zoo import corpus
from kiln.zoo.checkpoint import (
    TrainState,
    append_log,
    load_checkpoint,
    save_checkpoint,
    truncate_log,
    write_final_model,
)
from kiln.zoo.tokenizer import load_tokenizer, special_ids

# The shared tokenizer lives with kiln-tiny; every zoo model is trained with it unchanged.
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "models" / "kiln-tiny"
CHECKPOINT = "checkpoint"  # the resumable state's subdirectory of the output directory


@dataclass(frozen=True)
class ModelSize:
    """Architecture and default optimisation settings of one `--size` preset."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    context_len: int
    batch_size: int  # sequences of context_len tokens per step
    lr: float
    steps: int


SIZES: dict[str, ModelSize] = {
    # head_dim 64 for both real models: the size Kiln's attention kernels are tuned for.
    "tiny": ModelSize(384, 1024, 8, 6, 2, 1024, batch_size=32, lr=1.5e-3, steps=2200),
    "draft": ModelSize(128, 384, 4, 2, 1, 1024, batch_size=32, lr=3e-3, steps=4187),
    # CPU smoke-test size: trains in seconds, used by the tests.
    "micro": ModelSize(32, 64, 2, 2, 1, 64, batch_size=8, lr=3e-3, steps=40),
}


@dataclass
class TrainConfig:
    size: str
    out_dir: Path
    steps: int | None = None  # None: the preset's
    batch_size: int | None = None
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: 2% of steps, at least 1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_chunks: int = 16
    checkpoint_every: int = 500
    stop_at: int | None = None  # end this invocation after that step (resume later)
    max_files: int | None = None  # first N files of each split (tests)
    corpus_root: Path | None = None  # None: this interpreter's stdlib
    tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR
    device: str = "auto"
    command: str = ""  # how the run was started, recorded in the output

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"size={self.size!r}; valid: {', '.join(SIZES)}")
        preset = SIZES[self.size]
        self.out_dir = Path(self.out_dir)
        self.tokenizer_dir = Path(self.tokenizer_dir)
        self.steps = preset.steps if self.steps is None else self.steps
        self.batch_size = preset.batch_size if self.batch_size is None else self.batch_size
        self.lr = preset.lr if self.lr is None else self.lr
        if self.warmup_steps is None:
            self.warmup_steps = max(1, self.steps // 50)
        for name in ("steps", "batch_size", "log_every", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at={self.stop_at} must be in [1, steps={self.steps}]")

    @property
    def preset(self) -> ModelSize:
        return SIZES[self.size]

    def fingerprint(self) -> dict:
        """Settings a resumed run must share with the checkpoint it continues."""
        keys = ("size", "steps", "batch_size", "lr", "min_lr_ratio", "warmup_steps")
        keys += ("weight_decay", "grad_clip", "seed", "max_files")
        return {k: getattr(self, k) for k in keys}


def llama_config(size: str, vocab_size: int, ids: dict[str, int]) -> LlamaConfig:
    p = SIZES[size]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.context_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,  # halves the bytes the embedding costs in a small model
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )


def build_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [  # no weight decay on norm gains (the 1-D parameters)
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )


class ChunkSampler:
    """Non-overlapping chunks of the token stream; each epoch a seeded permutation of them."""

    def __init__(self, stream: torch.Tensor, chunk_len: int, batch_size: int, seed: int):
        num_chunks = stream.numel() // chunk_len
        if num_chunks < batch_size:
            raise ValueError(
                f"corpus has {num_chunks} chunks of {chunk_len} tokens, fewer than "
                f"batch_size={batch_size}; use more files or a smaller batch"
            )
        self.chunks = stream[: num_chunks * chunk_len].view(num_chunks, chunk_len)
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = num_chunks // batch_size
        self._epoch, self._perm = -1, None

    def batch(self, step: int) -> torch.Tensor:  # [batch_size, chunk_len]
        epoch, index = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = epoch
            self._perm = torch.randperm(self.chunks.shape[0], generator=gen)
        rows = self._perm[index * self.batch_size : (index + 1) * self.batch_size]
        return self.chunks[rows.to(self.chunks.device)]


def autocast(device: torch.device):
    # bf16 autocast on GPU; plain fp32 on CPU, where bf16 is slow and tests want determinism.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, chunks: torch.Tensor, device: torch.device) -> float:
    model.eval()
    with autocast(device):
        loss = model(input_ids=chunks, labels=chunks).loss.item()
    model.train()
    return loss


def check_out_dir(out_dir: Path) -> None:
    """Refuse an out_dir that holds a model no checkpoint of a zoo run resumes (another
    model's directory, or a finished run whose checkpoint was deleted): training would
    overwrite its weights and configs, and leave its other files beside the new model."""
    if (out_dir / "config.json").is_file() and not (out_dir / CHECKPOINT / "state.json").is_file():
        raise ValueError(
            f"{out_dir} holds a model (config.json) but no zoo checkpoint to resume "
            f"({CHECKPOINT}/state.json); training would overwrite it: choose another --out"
        )


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainState:
    """Train (or resume) the model described by `cfg`; write the HF model dir when done."""
    check_out_dir(cfg.out_dir)
    device = resolve_device(cfg.device)
    ctx_len = cfg.preset.context_len
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    ids = special_ids(tokenizer)
    t0 = time.perf_counter()
    train_files = corpus.read_files("train", cfg.corpus_root, cfg.max_files)
    heldout_files = corpus.read_files("heldout", cfg.corpus_root, cfg.max_files)
    train_stream = corpus.encode_files(tokenizer, train_files, ids["bos"], ids["eos"])
    heldout_stream = corpus.encode_files(tokenizer, heldout_files, ids["bos"], ids["eos"])
    log(
        f"corpus: {len(train_files)} train files, {train_stream.numel():,} tokens; "
        f"{len(heldout_files)} held-out files, {heldout_stream.numel():,} tokens "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    sampler = ChunkSampler(train_stream.to(device), ctx_len, cfg.batch_size, cfg.seed)
    num_eval = min(cfg.eval_chunks, heldout_stream.numel() // ctx_len)
    eval_chunks = heldout_stream[: num_eval * ctx_len].view(num_eval, ctx_len).to(device)

    config = llama_config(cfg.size, tokenizer.get_vocab_size(), ids)
    model = build_model(config, cfg.seed).to(device)
    optimizer = make_optimizer(model, cfg, device)
    state = TrainState(fingerprint=cfg.fingerprint(), num_params=model.num_parameters())
    ckpt_dir = cfg.out_dir / CHECKPOINT
    if (ckpt_dir / "state.json").is_file():
        state = load_checkpoint(ckpt_dir, model, optimizer, cfg.fingerprint(), device)
        log(f"resumed from {ckpt_dir} at step {state.step}")
    truncate_log(cfg.out_dir, state.step)
    log(f"model: {state.num_params:,} parameters on {device}; {cfg.steps} steps")

    model.train()
    end = cfg.steps if cfg.stop_at is None else cfg.stop_at
    tokens_per_step = cfg.batch_size * ctx_len
    window_losses: list[torch.Tensor] = []
    t_start = time.perf_counter()
    wall_before = state.train_wall_s
    while state.step < end:
        lr = lr_at(state.step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sampler.batch(state.step)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += tokens_per_step
        window_losses.append(loss.detach())
        if state.step % cfg.log_every == 0 or state.step == end:
            # One host sync per log line, not per step.
            train_loss = torch.stack(window_losses).float().mean().item()
            window_losses.clear()
            state.train_wall_s = wall_before + time.perf_counter() - t_start
            evaluate = state.step % cfg.eval_every == 0 or state.step == cfg.steps
            held = heldout_loss(model, eval_chunks, device) if evaluate and num_eval else None
            state.last_train_loss = train_loss
            if held is not None:
                state.last_heldout_loss = held
            row = [state.step, state.tokens_seen, lr, train_loss, held, grad_norm.item()]
            append_log(cfg.out_dir, [*row, state.train_wall_s])
            held_text = "" if held is None else f" heldout {held:.4f}"
            log(
                f"step {state.step}/{cfg.steps} loss {train_loss:.4f}{held_text} lr {lr:.2e} "
                f"tok/s {state.tokens_seen / max(state.train_wall_s, 1e-9):,.0f}"
            )
        if state.step % cfg.checkpoint_every == 0 or state.step == end:
            save_checkpoint(ckpt_dir, model, optimizer, state)
    if state.step >= cfg.steps:
        write_final_model(cfg, model, tokenizer_dir=cfg.tokenizer_dir, state=state, device=device)
        log(f"wrote {cfg.out_dir} after {state.step} steps, {state.train_wall_s:.0f}s training")
    return state


__all__ = ["SIZES", "ModelSize", "TrainConfig", "build_model", "llama_config", "train"]
