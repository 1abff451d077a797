"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.parallel import SINGLE, TPContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_local = -(-vocab_size // tp.size)  # ceil: the last rank may hold padding rows
        self.vocab_start = tp.rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)

    def load(self, param_name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if loaded.shape[1] != self.weight.shape[1] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit embedding "
                             f"[{self.vocab_size}, {self.weight.shape[1]}]")
        piece = loaded[self.vocab_start:self.vocab_start + self.num_local]
        self.weight.data.zero_()
        self.weight.data[: piece.shape[0]].copy_(piece)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class LMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; may share its weight with the embedding (tied)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
