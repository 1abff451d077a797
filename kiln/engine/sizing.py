"""Start-up decisions: context length, attention backend, how far back attention reads, and how
many KV blocks fit."""

from __future__ import annotations

import logging
import warnings

import torch

from kiln.cache.kv_cache import KVCache
from kiln.cache.window import max_blocks_held
from kiln.config import EngineConfig
from kiln.kernels.attention import MAX_KEY_TILE
from kiln.kernels.kv_cache import kv_cache_torch_dtype
from kiln.layers.attention import contiguous_kv_caches, contiguous_metadata
from kiln.models.arch import ArchConfig
from kiln.models.loader import LoadedModel

log = logging.getLogger("kiln.engine")
GB = 1 << 30
TRITON_HEAD_DIMS = (64, 128)


def resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    """The context length Kiln serves: the user's choice, bounded by what the model supports."""
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds what the model supports ({limit}); "
                         f"lower --max-model-len")
    return requested


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attention_backend_for(requested: str, device: torch.device, head_dim: int) -> str:
    if requested == "triton" and device.type != "cuda":
        raise ValueError("attention_backend='triton' needs a CUDA device; use 'torch' or 'auto'")
    if requested != "auto":
        return requested
    if device.type != "cuda" or not triton_available():
        return "torch"
    if head_dim not in TRITON_HEAD_DIMS:
        warnings.warn(f"head_dim={head_dim} has no Triton attention kernel "
                      f"({TRITON_HEAD_DIMS}); using the torch backend", stacklevel=2)
        return "torch"
    return "triton"


def window_lookback(layer_windows: tuple[int | None, ...], backend: str) -> int | None:
    """The most keys before a query's position that attention may load when every layer slides
    (kiln/cache/window.py): the widest window's window - 1 that the query sees, and with the
    Triton kernels up to MAX_KEY_TILE - 1 more, as their first tile starts at a multiple of its
    width (the torch reference gathers from the page of the first key seen). None when a layer
    attends to the whole context: then no block is ever out of reach."""
    if not layer_windows or None in layer_windows:
        return None
    tile = MAX_KEY_TILE if backend == "triton" else 1
    return max(layer_windows) - 1 + tile - 1


def _peak_activation_bytes(loaded: LoadedModel, num_tokens: int, max_model_len: int,
                           backend: str, block_size: int, kv_dtype: torch.dtype,
                           logit_rows: int) -> int:
    """Run the largest prefill a step can hold and the LM head on ``logit_rows`` of it (a step
    samples at most one row a sequence), and measure what they needed beyond the weights: a
    quantized head past wint_mma's rows is dequantized into a dense temporary, which counts.

    Its KV goes in blocks of the engine's ``block_size`` and ``kv_dtype``, so the prefill
    attention compiles and loads here the variant that the first long prompt would otherwise (on
    an H100 with an empty Triton cache, a 12,000-token prompt's first step took 2.8 s instead of
    0.2; with an fp8 KV cache, 2.3 s instead of 0.19 while the probe's KV was bf16)."""
    model, arch, device = loaded.model, loaded.arch, loaded.device
    seq_len = min(num_tokens, max_model_len - 1)
    num_seqs = max(1, num_tokens // seq_len)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    caches = contiguous_kv_caches(arch.num_layers, num_seqs, seq_len, model.num_kv_heads,
                                  arch.head_dim, kv_dtype, device, page_size=block_size)
    meta = contiguous_metadata([0] * num_seqs, [seq_len] * num_seqs, seq_len, caches, device,
                               backend=backend)
    ids = torch.randint(0, arch.vocab_size, (num_seqs * seq_len,), device=device)
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)
    with torch.inference_mode():
        hidden = model(ids, positions, meta)
        model.compute_logits(hidden[-min(num_seqs * seq_len, logit_rows):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, meta, hidden
    torch.cuda.empty_cache()
    return peak


def num_kv_blocks_for(config: EngineConfig, loaded: LoadedModel, max_model_len: int,
                      backend: str, lookback: int | None) -> tuple[int, int]:
    """(GPU-or-CPU pool blocks, CPU swap blocks), failing clearly if one request cannot fit (with
    a ``lookback``, in the blocks it holds at once, besides the null block)."""
    cc, arch = config.cache, loaded.arch
    kv_dtype = kv_cache_torch_dtype(cc.kv_cache_dtype, loaded.dtype)
    per_block = KVCache.bytes_per_block(arch.num_layers, cc.block_size, loaded.model.num_kv_heads,
                                        arch.head_dim, kv_dtype)
    knob = "num_kv_blocks"
    if cc.num_kv_blocks is not None:
        num_blocks = cc.num_kv_blocks
    elif loaded.device.type == "cuda":
        knob = "gpu_memory_utilization"
        peak = _peak_activation_bytes(loaded, config.scheduler.max_num_batched_tokens,
                                      max_model_len, backend, cc.block_size, kv_dtype,
                                      config.scheduler.max_num_seqs)
        free, total = torch.cuda.mem_get_info(loaded.device)
        budget = cc.gpu_memory_utilization * total - (total - free) - peak
        num_blocks = max(0, int(budget // per_block))
    else:
        knob = "cpu_kv_cache_space"
        num_blocks = int(cc.cpu_kv_cache_space * GB // per_block)
    needed = max_blocks_held(max_model_len, config.scheduler.max_num_batched_tokens,
                             cc.block_size, lookback)
    if lookback is not None:
        needed += 1  # the null block
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * cc.block_size} tokens) but one "
            f"request of max_model_len={max_model_len} needs {needed} blocks; raise "
            f"--{knob.replace('_', '-')} or lower --max-model-len")
    num_cpu_blocks = (int(cc.swap_space * GB // per_block)
                      if config.scheduler.preemption_mode == "swap" else 0)
    return num_blocks, num_cpu_blocks
