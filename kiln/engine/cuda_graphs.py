"""CUDA graphs for decode steps (a ladder of batch sizes) and for prefills of up to
MAX_PREFILL_SEQS prompts together (a ladder of token counts), each replayed padded up to the
next captured size (a decode batch: or to a larger one that start-up timing found faster); a
step that admits prompts beside decodes replays the decode graph, then the prefill graph of its
prompts.

A step launches hundreds of small kernels; replaying a captured graph removes their launch
overhead, which dominates at small batch (decode) and for short prompts (time to first token).
Every graph reads its inputs from the same static buffers and shares one memory pool. Decode
attention is captured with ``max_seqlen_k`` fixed at ``max_model_len``, which sets only its split
count: the kernel cuts each sequence's real length over those splits on the device, so one graph
serves every context length. A prefill graph of T tokens serves the last chunks of up to
MAX_PREFILL_SEQS prompts, T tokens in all, laid end to end (varlen, as the eager step lays them):
each the whole prompt, or what follows a cached prefix (a prefix-cache hit, or the rest of a
prompt the token budget cut), whose keys the prefill kernel reads from the pages. Sequence slots
left empty have no query rows, so their attention programs return at once; padded rows write no
KV and no real row attends to them. Past its attention the last layer runs only each slot's last
row (OutputRows); an empty slot's is the last real row again, attending a one-token sequence, and
its logits are dropped.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from kiln.kernels.argmax import argmax_rows
from kiln.layers.attention import AttentionMetadata, last_rows
from kiln.models.llama import LlamaForCausalLM

log = logging.getLogger("kiln.engine")


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 beyond (vLLM's ladder, capped)."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 1025, 16))
    capped = [s for s in sizes if s < max_num_seqs]
    return capped + [max_num_seqs]


# share of a graph's start-up time a larger graph must save to take its batches (decode steps
# timed twice on one machine differed by at most 0.5%). At 5% the int4 engine kept batches of
# 264-272 on their own graph: 13.50-13.74 ms a step at 384 tokens of context, against 13.07-13.17
# replaying 320's at 2% (results/h100/wint_ws_order.txt); bf16's routes were the same at both.
ROUTE_MARGIN = 0.02
# and at least this much time a step: a padded batch runs other GEMM tiles, so its near-tie tokens
# can differ, and a route decided by timing noise would make them differ between processes.
# kiln-tiny's graphs (0.1-0.3 ms) timed twice differed by up to 7 us, their "faster" larger
# graphs saved 3-10 us and changed from process to process; the 8B's routes save 0.3-4.5 ms
# (results/h100/graph_routing_noise.txt).
ROUTE_MIN_SAVED_MS = 0.05


def fastest_holding(sizes: list[int], ms: dict[int, float], margin: float = ROUTE_MARGIN,
                    min_saved_ms: float = ROUTE_MIN_SAVED_MS) -> dict[int, int]:
    """For each batch size whose graph a larger one beats by more than ``margin`` and
    ``min_saved_ms`` (its device time ``ms``), the fastest larger size: a batch padded up to it
    runs sooner (cuBLAS's bf16 GEMMs at 448 rows take longer than at 512 on the H100). Padded
    rows cost only GEMM rows."""
    route = {}
    for i, size in enumerate(sizes):
        best = min(sizes[i:], key=ms.__getitem__)
        if ms[best] < min((1 - margin) * ms[size], ms[size] - min_saved_ms):
            route[size] = best
    return route


PREFILL_SIZES = (16, 32, 64, 128, 256, 512, 768, 1024)
# prompts one prefill graph holds: a step's admissions (beyond that the step is eager, and its
# prefill GEMMs about cover the launch)
MAX_PREFILL_SEQS = 8
# graphs a step may replay: its decodes', then its prompts'
MAX_RUNS_PER_STEP = 2


class StepGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.batch_sizes = batch_size_ladder(max_num_seqs)
        self.prefill_sizes = [t for t in PREFILL_SIZES if t < max_model_len]
        max_bs = self.batch_sizes[-1]
        max_tokens = max(max_bs, *self.prefill_sizes)
        max_blocks = -(-max_model_len // block_size)
        on = {"device": device}
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, **on)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, **on)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, **on)
        seqs = MAX_PREFILL_SEQS
        self.prefill_cu_seqlens_q = torch.zeros(seqs + 1, dtype=torch.int32, **on)
        self.prefill_seq_lens = torch.ones(seqs, dtype=torch.int32, **on)
        self.prefill_block_tables = torch.zeros(seqs, max_blocks, dtype=torch.int32, **on)
        self.prefill_seqs = torch.arange(seqs, **on)  # each slot's last row is read (sampled)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, **on)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, **on)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, **on)
        # keyed by ("decode", batch size) or ("prefill", token count)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[str, int], torch.Tensor] = {}  # [rows, vocab] float32
        self.greedy_ids: dict[tuple[str, int], torch.Tensor] = {}  # [rows] argmax
        self.pool = None
        self._route: dict[int, int] = {}  # batch size -> a larger, faster graph (capture)
        # One set per run, used in turn: with async scheduling the host fills step N+1's inputs
        # while the copies of step N's (up to MAX_RUNS_PER_STEP runs each) may still wait in
        # the stream; it has waited for step N before it comes back to step N's sets.
        self._host = tuple(HostInputs(max_tokens, max(max_bs, seqs), max_blocks)
                           for _ in range(2 * MAX_RUNS_PER_STEP))
        self._turn = 0

    def _next_host_inputs(self) -> HostInputs:
        self._turn = (self._turn + 1) % len(self._host)
        return self._host[self._turn]

    def _decode_meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, kv_caches=self.kv_caches, backend="triton")

    def _prefill_meta(self, num_tokens: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], cu_seqlens_q=self.prefill_cu_seqlens_q,
            seq_lens=self.prefill_seq_lens, block_tables=self.prefill_block_tables,
            max_seqlen_q=num_tokens, max_seqlen_k=num_tokens, kv_caches=self.kv_caches,
            backend="triton")

    def _forward(self, key: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        kind, size = key
        meta = self._decode_meta(size) if kind == "decode" else self._prefill_meta(size)
        rows = last_rows(meta, self.prefill_seqs) if kind == "prefill" else None
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta, rows)
        logits = self.model.compute_logits(hidden)
        return logits, argmax_rows(logits)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first so smaller graphs reuse its pool memory."""
        start = time.perf_counter()
        keys = [("prefill", t) for t in reversed(self.prefill_sizes)] + \
            [("decode", bs) for bs in reversed(self.batch_sizes)]
        self.prefill_cu_seqlens_q[1:] = 1  # one query row (of the first sequence slot)
        for key in keys:
            self._forward(key)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[key], self.greedy_ids[key] = self._forward(key)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        ms = self._decode_ms()
        self._route = fastest_holding(self.batch_sizes, ms)
        seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs (decode batch 1..%d, prefill up to %d tokens) in "
                 "%.1f s", len(self.graphs), self.batch_sizes[-1],
                 max(self.prefill_sizes, default=0), seconds)
        for size, larger in self._route.items():
            log.info("decode batch %d replays the graph of %d (%.2f ms against %.2f)", size,
                     larger, ms[larger], ms[size])
        return seconds

    def _decode_ms(self) -> dict[int, float]:
        """Device ms of a replay of each decode graph, the median of three after a first, on the
        capture's inputs (one token of context a sequence: about the step's GEMMs alone)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = {}
        for size in self.batch_sizes:
            graph = self.graphs[("decode", size)]
            graph.replay()
            times = []
            for _ in range(3):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            ms[size] = statistics.median(times)
        return ms

    def replay_size(self, num_seqs: int) -> int:
        """The decode graph ``num_seqs`` sequences replay: the smallest that holds them, or a
        larger one that start-up timing found faster (fastest_holding)."""
        smallest = next(s for s in self.batch_sizes if s >= num_seqs)
        return self._route.get(smallest, smallest)

    def fits(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.batch_sizes[-1]

    def fits_prefill(self, num_new_tokens: list[int]) -> bool:
        """Whether one prefill graph holds chunks of these lengths."""
        return (bool(self.prefill_sizes) and len(num_new_tokens) <= MAX_PREFILL_SEQS
                and sum(num_new_tokens) <= self.prefill_sizes[-1])

    def run_prefill(self, chunks: list[tuple[list[int], int, list[int]]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts' last chunks, each (tokens, start, block table): its tokens at positions
        ``start``.. after the cached ones. Returns (logits [chunks, vocab], argmax [chunks]) at
        each chunk's last token."""
        total = sum(len(tokens) for tokens, _, _ in chunks)
        size = next(t for t in self.prefill_sizes if t >= total)
        bs = self.block_size
        host = self._next_host_inputs()
        row, width = 0, max(len(table) for _, _, table in chunks)
        host.prefill_cu[0] = 0
        for i, (tokens, start, table) in enumerate(chunks):
            n = len(tokens)
            positions = torch.arange(start, start + n)
            pages = torch.tensor(table, dtype=torch.int64)
            host.ids[row:row + n] = torch.tensor(tokens)
            host.positions[row:row + n] = positions
            host.slots[row:row + n] = pages[positions // bs] * bs + positions % bs
            host.seq_lens[i] = start + n
            host.tables[i, : len(table)] = pages
            row += n
            host.prefill_cu[i + 1] = row
        used = len(chunks)
        host.prefill_cu[used + 1:] = row  # empty slots: no query rows
        host.seq_lens[used:MAX_PREFILL_SEQS] = 1
        host.positions[row:size] = 0  # padded rows: any position the rotary table holds
        host.slots[row:size] = -1
        for dst, src in ((self.input_ids, host.ids), (self.positions, host.positions),
                         (self.slot_mapping, host.slots)):
            dst[:size].copy_(src[:size], non_blocking=True)
        self.prefill_cu_seqlens_q.copy_(host.prefill_cu, non_blocking=True)
        self.prefill_seq_lens.copy_(host.seq_lens[:MAX_PREFILL_SEQS], non_blocking=True)
        self.prefill_block_tables[:used, :width].copy_(host.tables[:used, :width],
                                                       non_blocking=True)
        key = ("prefill", size)
        self.graphs[key].replay()
        return self.logits[key][:used], self.greedy_ids[key][:used]

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int],
            tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the batch's graph (replay_size): (logits [n, vocab], argmax ids [n]).

        Sequence i feeds ``tokens[i]`` at ``positions[i]`` and reads blocks ``tables[i]``;
        padded rows write nothing and attend to one slot of block 0. ``tokens`` may already
        be on the device (async scheduling: the step in flight is sampling them).
        """
        n = len(positions)
        bs = self.replay_size(n)
        width = max(len(t) for t in tables)
        bsz = self.block_size
        slots = [t[p // bsz] * bsz + p % bsz for t, p in zip(tables, positions, strict=True)]
        host = self._next_host_inputs()
        host.positions[:n] = torch.tensor(positions)
        host.slots[:n] = torch.tensor(slots)
        host.slots[n:bs] = -1
        host.seq_lens[:n] = torch.tensor(positions) + 1
        host.seq_lens[n:bs] = 1
        table_rows = host.tables[:n, :width].numpy()
        for row, table in enumerate(tables):
            table_rows[row, : len(table)] = table
        if isinstance(tokens, torch.Tensor):
            self.input_ids[:n].copy_(tokens)
        else:
            host.ids[:n] = torch.tensor(tokens)
            self.input_ids[:n].copy_(host.ids[:n], non_blocking=True)
        for dst, src in ((self.positions, host.positions), (self.slot_mapping, host.slots),
                         (self.seq_lens, host.seq_lens)):
            dst[:bs].copy_(src[:bs], non_blocking=True)
        self.block_tables[:n, :width].copy_(host.tables[:n, :width], non_blocking=True)
        key = ("decode", bs)
        self.graphs[key].replay()
        return self.logits[key][:n], self.greedy_ids[key][:n]


class HostInputs:
    """Pinned host mirrors of one step's inputs: the host writes them, one async copy each."""

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int) -> None:
        pinned = {"pin_memory": True}
        self.ids = torch.zeros(max_tokens, dtype=torch.int64, **pinned)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, **pinned)
        self.slots = torch.zeros(max_tokens, dtype=torch.int64, **pinned)
        self.prefill_cu = torch.zeros(MAX_PREFILL_SEQS + 1, dtype=torch.int32, **pinned)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, **pinned)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, **pinned)
