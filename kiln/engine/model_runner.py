"""Runs one scheduled step on the model: flat inputs in, sampled tokens out.

The batch is flat and unpadded: the new tokens of every scheduled sequence laid end to end, with
flash-attention style metadata (``cu_seqlens_q``, ``seq_lens``, ``slot_mapping``,
``block_tables``). Logits are computed only at the rows that sample (and at prompt rows whose
logprobs were asked for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kiln.cache.kv_cache import KVCache
from kiln.cache.kv_cache_manager import KVCacheManager
from kiln.engine.cuda_graphs import StepGraphs
from kiln.engine.request import Request
from kiln.engine.scheduler import ScheduledSeq, SchedulerOutput
from kiln.engine.sequence import Sequence
from kiln.layers.attention import AttentionMetadata, OutputRows, last_rows
from kiln.models.loader import LoadedModel
from kiln.sampling.params import SamplingParams
from kiln.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
)
from kiln.upload import take_rows, upload


@dataclass
class StepResult:
    seqs: list[Sequence]  # one per sampled row (a request's fork step contributes n rows)
    requests: list[Request]  # the request of each row
    token_ids: torch.Tensor  # [num_rows]
    logprobs: LogprobsTensors | None
    prompt_logprobs: list[tuple[ScheduledSeq, int, LogprobsTensors]]  # (item, position, lps)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, kv: KVCacheManager,
                 attention_backend: str, seed: int = 0) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.kv_cache = kv_cache
        self.kv = kv
        self.block_size = kv_cache.block_size
        self.backend = attention_backend
        # requests without a seed of their own draw from this stream, so that an engine's
        # sampled outputs repeat run to run for a given seed and differ between seeds (vLLM)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        self.kv_caches = list(zip(kv_cache.k_caches, kv_cache.v_caches, strict=True))
        self.graphs: StepGraphs | None = None

    @torch.inference_mode()  # as in execute: the same ops
    def warm_up_sampling(self) -> None:
        """Run once what sampling runs besides the model: every path of the sampler (see
        Sampler.warm_up) and the row gather of a step whose requests fork into n sequences."""
        vocab_size = self.loaded.arch.vocab_size
        self.sampler.warm_up(vocab_size, self.device)
        take_rows(torch.zeros(2, vocab_size, device=self.device), [1, 1, 0])

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        """Enable CUDA graphs (CUDA + Triton attention only); returns capture seconds."""
        self.graphs = StepGraphs(self.model, self.kv_caches, max_num_seqs, max_model_len,
                                 self.block_size, self.device)
        return self.graphs.capture()

    def prepare(self, scheduled: list[ScheduledSeq],
                lookahead_ids: torch.Tensor | None = None) -> BatchInputs:
        """Flat inputs; ``lookahead_ids`` [num_tokens] are the input ids of a step chained to
        the one still in flight (async scheduling: its sampled tokens, then the prompt chunks'
        tokens), already on the device and laid out in the order of ``scheduled``."""
        tokens: list[int] = []
        starts, lens, tables = [], [], []
        for item in scheduled:
            start = item.start
            if lookahead_ids is None:
                tokens += item.seq.token_slice(start, start + item.num_new_tokens)
            starts.append(start)
            lens.append(item.num_new_tokens)
            tables.append(self.kv.block_table(item.seq.seq_id))
        starts_np, lens_np = np.array(starts), np.array(lens)
        # positions of every new token, e.g. starts [5, 0], lens [2, 3] -> [5, 6, 0, 1, 2]
        cu = np.concatenate([[0], np.cumsum(lens_np)])
        positions = np.arange(cu[-1]) - np.repeat(cu[:-1] - starts_np, lens_np)
        max_blocks = max(len(t) for t in tables)
        table_np = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for row, table in enumerate(tables):
            table_np[row, : len(table)] = table
        seq_rows = np.repeat(np.arange(len(tables)), lens_np)
        slots = (table_np[seq_rows, positions // self.block_size].astype(np.int64)
                 * self.block_size + positions % self.block_size)
        seq_lens = starts_np + lens_np
        meta = self._metadata(slots, cu, seq_lens, table_np, lens_np)
        # callers order single-token sequences first (see execute)
        num_decode = int(np.argmax(lens_np != 1)) if (lens_np != 1).any() else len(lens_np)
        if self.backend == "triton" and 0 < num_decode < len(lens_np):
            meta.num_decode_seqs = num_decode
            meta.prefill = self._metadata(None, cu[num_decode:] - cu[num_decode],
                                          seq_lens[num_decode:], table_np[num_decode:],
                                          lens_np[num_decode:])
        input_ids = (self._to_device(np.array(tokens), torch.int64) if lookahead_ids is None
                     else lookahead_ids)
        return BatchInputs(input_ids, self._to_device(positions, torch.int64), meta)

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return upload(torch.from_numpy(np.ascontiguousarray(array)).to(dtype), self.device)

    def _metadata(self, slots: np.ndarray | None, cu: np.ndarray, seq_lens: np.ndarray,
                  table: np.ndarray, lens: np.ndarray) -> AttentionMetadata:
        to = self._to_device
        return AttentionMetadata(
            slot_mapping=to(slots, torch.int64) if slots is not None else None,
            cu_seqlens_q=to(cu, torch.int32), seq_lens=to(seq_lens, torch.int32),
            block_tables=to(table, torch.int32), max_seqlen_q=int(lens.max()),
            max_seqlen_k=int(seq_lens.max()), kv_caches=self.kv_caches, backend=self.backend)

    def apply_cache_ops(self, out: SchedulerOutput) -> None:
        """In the order the cache manager requires: swap out, copy-on-write, swap in."""
        if out.swap_out:
            self.kv_cache.swap_out(out.swap_out)
        if out.copies:
            self.kv_cache.copy_blocks(out.copies)
        if out.swap_in:
            self.kv_cache.swap_in(out.swap_in)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, lookahead_ids: torch.Tensor | None = None,
                before_sampling: Callable[[], None] | None = None) -> StepResult:
        """Launch the step; ``lookahead_ids`` as in ``prepare``. ``before_sampling`` runs once
        the forward is launched and before the sampler reads the host's state of the rows (a
        chained step's grammar masks, penalties ... need the step before it applied first), if
        it samples through the sampler at all."""
        self.apply_cache_ops(out)
        if self._graph_step(out.scheduled):
            return self._graph_runs(out.scheduled, [], lookahead_ids, before_sampling)
        split = self._graph_split(out.scheduled)
        if split is not None:
            return self._graph_runs(*split, lookahead_ids, before_sampling)
        # single-token rows first, so attention can send them to the decode kernel (a stable
        # sort: a chained step comes in this order already, as its lookahead ids are laid out)
        scheduled = sorted(out.scheduled, key=lambda item: item.num_new_tokens != 1)
        batch = self.prepare(scheduled, lookahead_ids)
        ends = np.cumsum([s.num_new_tokens for s in scheduled]) - 1
        read = [i for i, item in enumerate(scheduled) if item.samples]
        rows = self._output_rows(scheduled, batch.meta, read, int(ends[-1]) + 1)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, rows)
        prompt_lps = self._prompt_logprobs(scheduled, hidden, ends)
        if not read:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return StepResult([], [], empty, None, prompt_lps)
        logits = self.model.compute_logits(
            hidden if rows is not None else take_rows(hidden, [int(ends[i]) for i in read]))
        if before_sampling is not None:
            before_sampling()
        return self._sample(logits, [(scheduled[i], row) for row, i in enumerate(read)],
                            prompt_lps)

    def _output_rows(self, scheduled: list[ScheduledSeq], meta: AttentionMetadata,
                     read: list[int], num_rows: int) -> OutputRows | None:
        """The rows the last layer runs past its K/V write: the last of each sequence ``read``
        (indices into ``scheduled``), or None, all rows, where every row samples or prompt
        logprobs read them."""
        if len(read) == num_rows or any(item.request.prompt_logprobs is not None
                                        for item in scheduled):
            return None
        seqs = (upload(torch.tensor(read), self.device) if read
                else torch.empty(0, dtype=torch.int64, device=self.device))  # nothing to copy
        return last_rows(meta, seqs)

    def _graph_step(self, scheduled: list[ScheduledSeq]) -> bool:
        """Pure decode steps (one new token per sequence, all sampling) replay a graph."""
        return (self.graphs is not None and self.graphs.fits(len(scheduled))
                and all(item.num_new_tokens == 1 and item.samples for item in scheduled))

    def _graph_split(self, scheduled: list[ScheduledSeq]
                     ) -> tuple[list[ScheduledSeq], list[ScheduledSeq]] | None:
        """Prompts' last chunks that one prefill graph holds (whole prompts, or what follows
        their cached or already computed part), none asking for prompt logprobs, alone (the
        batch-1 first token, a prefix-cache hit) or beside decodes that a decode graph holds
        (requests admitted while others decode, the rest of a prompt the token budget cut):
        (decodes, prompts) to replay as the decode graph and the prompts' prefill graph. Beside
        decodes that reads the weights once more (~6 ms for an 8B model) but skips the eager
        mixed step's Python launch (~37 ms). Else None."""
        if self.graphs is None:
            return None
        decodes = [item for item in scheduled if item.num_new_tokens == 1]
        prompts = [item for item in scheduled if item.num_new_tokens != 1]
        if (not prompts or (decodes and not self._graph_step(decodes))
                or not all(item.samples and item.request.prompt_logprobs is None
                           for item in prompts)
                or not self.graphs.fits_prefill([item.num_new_tokens for item in prompts])):
            return None
        return decodes, prompts

    def _graph_runs(self, decodes: list[ScheduledSeq], prompts: list[ScheduledSeq],
                    lookahead_ids: torch.Tensor | None,
                    before_sampling: Callable[[], None] | None = None) -> StepResult:
        """Replay the decode graph (when there are decodes), then the prompts' prefill graph
        (when there are prompts). Plain greedy batches take the argmax computed inside the
        graphs; anything else samples their logits together. A chained step's lookahead ids
        start with the decodes' (see ``prepare``); the prompt chunks' tokens are on the host."""
        items = decodes + prompts
        greedy = all(item.request.forked and _plain_greedy(item.seq.params) for item in items)
        wanted = 1 if greedy else 0  # of each replay's (logits, argmax ids)
        parts = []
        if decodes:
            ids = None if lookahead_ids is None else lookahead_ids[: len(decodes)]
            parts.append(self._replay_decode(decodes, ids)[wanted])
        if prompts:
            if parts:  # the graphs share one memory pool: what the decode replay returned is
                parts[0] = parts[0].clone()  # copied out before the prefill replay reuses it
            parts.append(self._replay_prefill(prompts)[wanted])
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if greedy:
            return StepResult([item.seq for item in items], [item.request for item in items],
                              out, None, [])
        if before_sampling is not None:
            before_sampling()
        return self._sample(out, [(item, row) for row, item in enumerate(items)], [])

    def _replay_decode(self, decodes: list[ScheduledSeq], lookahead_ids: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence through a decode graph: (logits, argmax ids)."""
        positions = [item.start for item in decodes]
        tokens = lookahead_ids if lookahead_ids is not None else [
            item.seq.token_slice(p, p + 1)[0] for item, p in zip(decodes, positions, strict=True)]
        tables = [self.kv.block_table(item.seq.seq_id) for item in decodes]
        return self.graphs.run(tokens, positions, tables)

    def _replay_prefill(self, prompts: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts' last chunks through one prefill graph: (logits, argmax ids)."""
        chunks = [(item.seq.token_slice(item.start, item.start + item.num_new_tokens),
                   item.start, self.kv.block_table(item.seq.seq_id)) for item in prompts]
        return self.graphs.run_prefill(chunks)

    def _sample(self, logits: torch.Tensor, rows: list[tuple[ScheduledSeq, int]],
                prompt_lps: list[tuple[ScheduledSeq, int, LogprobsTensors]]) -> StepResult:
        """Sample each (item, logits row); a request's first sample forks into n sequences.
        A sequence that finished since the step was launched (``execute``'s before_sampling;
        its row is dropped when the step is applied) samples without its grammar, which has
        ended."""
        index, seqs, requests = [], [], []
        for item, row in rows:
            group = item.request.seqs if not item.request.forked else [item.seq]
            index += [row] * len(group)
            seqs += group
            requests += [item.request] * len(group)
        if index != list(range(logits.shape[0])):
            logits = take_rows(logits, index)
        meta = SamplingMetadata.build(
            [s.params for s in seqs], [s.generator for s in seqs],
            [s.output_token_ids for s in seqs], [s.prompt_token_ids for s in seqs],
            self.device, self.loaded.eos_token_ids,
            [None if s.finished else s.grammar for s in seqs])
        sampled = self.sampler.sample(logits, meta)
        return StepResult(seqs, requests, sampled.token_ids, sampled.logprobs, prompt_lps)

    def _prompt_logprobs(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor,
                         ends: np.ndarray) -> list[tuple[ScheduledSeq, int, LogprobsTensors]]:
        """(item, first position, logprobs) for chunks covering prompt positions not yet scored.

        Position p's logits score prompt token p + 1; a request has scored positions
        [0, len(prompt_logprobs) - 1). A recompute after preemption resumes where that stops.
        """
        results = []
        for item, end in zip(scheduled, ends, strict=True):
            request = item.request
            if request.prompt_logprobs is None or item.seq.index != 0:
                continue
            start = item.start
            first = len(request.prompt_logprobs) - 1  # the next position to score
            stop = min(start + item.num_new_tokens, len(request.prompt_token_ids) - 1)
            if not start <= first < stop:
                continue
            row = int(end) - item.num_new_tokens + 1 + (first - start)  # hidden row of `first`
            logits = self.model.compute_logits(hidden[row:row + stop - first])
            ids = request.prompt_token_ids[first:stop + 1]
            results.append((item, first, compute_prompt_logprobs(
                logits, ids, request.params.prompt_logprobs)))
        return results


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits first: the token is a plain argmax."""
    return (params.greedy and params.logprobs is None and not params.has_penalties
            and params.min_tokens == 0 and not params.logit_bias
            and params.allowed_token_ids is None and not params.bad_words_token_ids
            and params.structured_outputs is None)
