"""The Llama family in one implementation: Llama 2/3/3.1, Mistral, Qwen2 and Qwen3.

Variants differ only by flags in ``ArchConfig`` (q/k/v bias, per-head q/k RMSNorm, tied
embeddings, rope scaling, each layer's sliding window). Tokens are laid flat ([num_tokens])
across all sequences of a batch; ``AttentionMetadata`` tells attention where each sequence starts
and where its KV lives.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.row_quant import QuantizedRows
from kiln.layers.attention import (
    Attention,
    AttentionMetadata,
    OutputRows,
    contiguous_kv_caches,
    contiguous_metadata,
)
from kiln.layers.embedding import LMHead, VocabParallelEmbedding
from kiln.layers.linear import column_parallel, row_parallel
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.models.arch import ArchConfig
from kiln.parallel import SINGLE, TPContext


def check_sequence_length(seq_len: int, max_positions: int) -> None:
    """Refuse a sequence Kiln would compute wrong: past the rotary table."""
    if seq_len > max_positions:
        raise ValueError(f"sequence of {seq_len} tokens is longer than the model's "
                         f"{max_positions} positions; split it")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 tp: TPContext) -> None:
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.qkv_proj = column_parallel(
            cfg.hidden_size, {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
            bias=cfg.qkv_bias, tp=tp)
        self.o_proj = row_parallel(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, tp=tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, cfg.head_dim,
                              cfg.layer_windows[layer_idx])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None = None,
                rows: OutputRows | None = None) -> torch.Tensor | None:
        """The attention output (of ``rows`` only, when given), or None where o_proj added it
        into ``residual`` (Linear)."""
        q, k, v = self._qkv(x)
        return self.o_proj(self.attn(q, k, v, meta, positions, self.rotary.cos_sin_cache, rows),
                           residual=residual)

    def write_kv(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> None:
        """Every row's K/V into the cache, nothing attended: the last layer where no row is
        read (prompt chunks that sample nothing)."""
        self.attn.write(*self._qkv(x), meta, positions, self.rotary.cos_sin_cache)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k and v [T, Hkv, D], before rotary."""
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: before rotary, which runs inside self.attn
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: TPContext) -> None:
        super().__init__()
        self.gate_up_proj = column_parallel(
            cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
            bias=cfg.mlp_bias, tp=tp)
        self.down_proj = row_parallel(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                      tp=tp)

    def forward(self, x: torch.Tensor | QuantizedRows,
                residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MLP output, or None where down_proj added it into ``residual`` (Linear)."""
        # a W8A8 down projection takes its input as codes: quantized with the activation
        quant = self.down_proj.input_quant(x.shape[:-1].numel())
        return self.down_proj(self.gate_up_proj(x, gated=True, out_quant=quant),
                              residual=residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 tp: TPContext) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | None,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(x, residual) -> (the MLP's output, the residual stream). The first layer gets the
        embeddings as x and no residual. A None x is an output already added into the residual
        by the GEMM that made it (Linear's ``residual``). With ``rows`` (the last layer) both
        come out for those rows only: the other rows just write their K/V."""
        # a W8A8 projection takes its input as codes, written by the norm before it
        num_rows = positions.shape[0]
        quant = self.self_attn.qkv_proj.input_quant(num_rows)
        if residual is None:
            residual = x
            x = self.input_layernorm(x, quant=quant)
        else:
            x, residual = self.input_layernorm(x, residual, quant)
        if rows is not None:
            residual = residual.index_select(0, rows.index)
            if residual.shape[0] == 0:  # no row read: the layer only writes its K/V
                self.self_attn.write_kv(positions, x, meta)
                return None, residual
        x = self.self_attn(positions, x, meta, residual, rows)
        x, residual = self.post_attention_layernorm(
            x, residual, self.mlp.gate_up_proj.input_quant(residual.shape[0]))
        return self.mlp(x, residual), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: TPContext = SINGLE,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # one rotary table shared by every layer. Dynamic NTK scaling is the default rotary up
        # to max_position_embeddings and rescales past it: its table stops there.
        max_positions = max_positions or cfg.max_position_embeddings
        if cfg.rope.rope_type == "dynamic":
            max_positions = cfg.max_position_embeddings
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.max_positions = max_positions
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, rows: OutputRows | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden], or
        [len(rows.index), hidden]: the hidden states of ``rows`` only (see OutputRows)."""
        x = self.embed_tokens(input_ids)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, meta, rows if i == last else None)
        if residual.shape[0] == 0:  # no row read (OutputRows)
            return residual
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a persistent cache: [B, L] -> logits [B, L, V]."""
        num_seqs, seq_len = input_ids.shape
        check_sequence_length(seq_len, self.max_positions)
        device = input_ids.device
        caches = contiguous_kv_caches(self.cfg.num_layers, num_seqs, seq_len, self.num_kv_heads,
                                      self.cfg.head_dim, self.embed_tokens.weight.dtype, device)
        meta = contiguous_metadata([0] * num_seqs, [seq_len] * num_seqs, seq_len, caches, device)
        positions = torch.arange(seq_len, device=device).repeat(num_seqs)
        hidden = self.forward(input_ids.reshape(-1), positions, meta)
        return self.compute_logits(hidden).reshape(num_seqs, seq_len, -1)

    # checkpoint name fragment -> (Kiln module suffix, shard id) for stacked projections
    _STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
                "up_proj": ("gate_up_proj", "up")}
    _MERGED = {"qkv_proj", "gate_up_proj"}

    def checkpoint_targets(self, name: str) -> tuple[nn.Module, str, str | None] | None:
        """Map a Hugging Face tensor name to (module, parameter name, shard id).

        Returns None for tensors that carry no weights Kiln needs (rotary inv_freq buffers, the
        LM head of a tied model).
        """
        if "rotary_emb." in name:
            return None
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        module_path, _, param = name.rpartition(".")
        parts = module_path.split(".")
        shard_id = None
        if parts and parts[-1] in self._MERGED:  # Kiln's own names are not checkpoint names
            raise KeyError(name)
        if parts and parts[-1] in self._STACKED:
            parts[-1], shard_id = self._STACKED[parts[-1]]
        try:
            module = self.get_submodule(".".join(parts))
        except AttributeError:
            raise KeyError(name) from None
        # only parameters load: not a bias this config has not (None), a buffer or an attribute
        if not isinstance(getattr(module, param, None), nn.Parameter):
            raise KeyError(name)
        return module, param, shard_id

    def expected_checkpoint_names(self) -> set[str]:
        """Every checkpoint tensor a complete Hugging Face checkpoint must provide."""
        inverse = {kiln: hf for hf, kiln in self._STACKED.items()}
        names = set()
        for full, _ in self.named_parameters(remove_duplicate=True):
            module_path, _, param = full.rpartition(".")
            parts = module_path.split(".")
            prefix = "" if parts[0] == "lm_head" else "model."
            if parts[-1] in ("qkv_proj", "gate_up_proj"):
                for (kiln_name, _shard), hf_name in inverse.items():
                    if kiln_name == parts[-1]:
                        names.add(prefix + ".".join([*parts[:-1], hf_name, param]))
            else:
                names.add(prefix + full)
        return names
