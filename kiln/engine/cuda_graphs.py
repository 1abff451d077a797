"""CUDA graphs for decode steps: one graph per batch size of a ladder, replayed padded up.

A decode step launches hundreds of small kernels; replaying a captured graph removes their
launch overhead, which dominates at small batch. Every graph reads its inputs from the same
static buffers and shares one memory pool. Attention is captured with ``max_seqlen_k`` fixed at
``max_model_len``: the decode kernel sizes its KV partitions from it and skips the partitions
beyond each sequence's real length, so one graph serves every context length.
"""

from __future__ import annotations

import logging
import time

import torch

from kiln.layers.attention import AttentionMetadata
from kiln.models.llama import LlamaForCausalLM

log = logging.getLogger("kiln.engine")


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 beyond (vLLM's ladder, capped)."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 1025, 16))
    capped = [s for s in sizes if s < max_num_seqs]
    return capped + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.batch_sizes = batch_size_ladder(max_num_seqs)
        max_bs = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        on = {"device": device}
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, **on)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, **on)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, **on)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, **on)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, **on)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, **on)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [bs, vocab] float32, written by replay
        self.greedy_ids: dict[int, torch.Tensor] = {}  # [bs] argmax, for all-greedy batches
        self.pool = None
        # pinned host mirrors of the per-step inputs: the host writes them, one async copy each
        pinned = {"pin_memory": True}
        self.host_ids = torch.zeros(max_bs, dtype=torch.int64, **pinned)
        self.host_positions = torch.zeros(max_bs, dtype=torch.int64, **pinned)
        self.host_slots = torch.zeros(max_bs, dtype=torch.int64, **pinned)
        self.host_seq_lens = torch.ones(max_bs, dtype=torch.int32, **pinned)
        self.host_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, **pinned)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, kv_caches=self.kv_caches, backend="triton")

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every batch size, largest first so smaller graphs reuse its pool memory."""
        start = time.perf_counter()
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs], self.greedy_ids[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.graphs),
                 self.batch_sizes[-1], seconds)
        return seconds

    def fits(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.batch_sizes[-1]

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]],
            block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest graph holding the batch: (logits [n, vocab], argmax ids [n]).

        Sequence i feeds ``tokens[i]`` at ``positions[i]`` and reads blocks ``tables[i]``;
        padded rows write nothing and attend to one slot of block 0.
        """
        n = len(tokens)
        bs = next(s for s in self.batch_sizes if s >= n)
        width = max(len(t) for t in tables)
        slots = [t[p // block_size] * block_size + p % block_size
                 for t, p in zip(tables, positions, strict=True)]
        self.host_ids[:n] = torch.tensor(tokens)
        self.host_positions[:n] = torch.tensor(positions)
        self.host_slots[:n] = torch.tensor(slots)
        self.host_slots[n:bs] = -1
        self.host_seq_lens[:n] = torch.tensor(positions) + 1
        self.host_seq_lens[n:bs] = 1
        table_rows = self.host_tables[:n, :width].numpy()
        for row, table in enumerate(tables):
            table_rows[row, : len(table)] = table
        for dst, src in ((self.input_ids, self.host_ids), (self.positions, self.host_positions),
                         (self.slot_mapping, self.host_slots),
                         (self.seq_lens, self.host_seq_lens)):
            dst[:bs].copy_(src[:bs], non_blocking=True)
        self.block_tables[:n, :width].copy_(self.host_tables[:n, :width], non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[bs][:n], self.greedy_ids[bs][:n]
