"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks.

Each rank holds ``ceil(vocab / tp)`` rows of the [vocab, hidden] table; rows past the vocabulary
(on the last rank) are zero padding, and the LM head slices its gathered logits back to the
vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.linear import Linear
from kiln.parallel import SINGLE, TPContext


def vocab_rows(vocab_size: int, tp: TPContext) -> tuple[int, int]:
    """(first row, number of rows) of this rank's shard of the padded vocabulary."""
    num_local = -(-vocab_size // tp.size)  # ceil: the last rank may hold padding rows
    return tp.rank * num_local, num_local


def load_vocab_rows(target: torch.Tensor, loaded: torch.Tensor, vocab_size: int,
                    vocab_start: int) -> None:
    """Copy this rank's rows of a full [vocab, hidden] checkpoint table into ``target``."""
    if loaded.dim() != 2 or loaded.shape[1] != target.shape[1] or loaded.shape[0] != vocab_size:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit the vocabulary table "
                         f"[{vocab_size}, {target.shape[1]}]")
    piece = loaded[vocab_start:vocab_start + target.shape[0]]
    target.zero_()
    target[: piece.shape[0]].copy_(piece)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.num_local = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)

    def load(self, param_name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        load_vocab_rows(self.weight.data, loaded, self.vocab_size, self.vocab_start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class LMHead(Linear):
    """Hidden states -> logits: a column-parallel Linear over the padded vocabulary.

    Being a Linear, it takes a ``LinearMethod`` like every projection (the weight-only formats
    quantize it). With tied embeddings ``weight`` is the embedding's Parameter; a quantized
    method drops that reference for codes of its own, so the embedding keeps its dense table.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext = SINGLE) -> None:
        vocab_start, num_local = vocab_rows(vocab_size, tp)
        super().__init__(hidden_size, num_local, bias=False, shard_dim=0, tp=tp)
        self.vocab_size = vocab_size
        self.vocab_start = vocab_start

    def load(self, param_name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        load_vocab_rows(self.weight.data, loaded, self.vocab_size, self.vocab_start)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> logits [..., vocab]. A 16-bit model on CUDA gets float32 logits
        straight from the GEMM's accumulator, whatever the head's format: bf16 logits are 1/16
        apart at |logit| 8..16, so rounding them makes near-ties exact ties, and greedy picks
        then flip between kernels that round the hidden state differently (it also saves the
        cast kernel after the head)."""
        if hidden.is_cuda and hidden.dtype in (torch.float16, torch.bfloat16):
            local = self.method.apply(self, hidden, out_dtype=torch.float32)
        else:
            local = super().forward(hidden)
        logits = self.tp.all_gather_last_dim(local)
        return logits[..., : self.vocab_size]
