"""The synchronous engine: add requests, call ``step()`` until none are left.

Each step schedules (scheduler), runs the model once over the flat batch (model runner), then
updates every sequence: computed counts, prefix-cache hashes, sampled tokens, stop checks, the
fork of multi-sample requests, and freeing the blocks of whatever finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kiln.cache.kv_cache import KVCache
from kiln.cache.kv_cache_manager import KVCacheManager
from kiln.cache.window import max_blocks_held
from kiln.config import EngineConfig
from kiln.engine.gc_heap import finite_loop_heap
from kiln.engine.inputs import PromptLike, check_prompt_length, tokenize_prompt
from kiln.engine.model_runner import ModelRunner, StepResult
from kiln.engine.overlap import InFlightStep, chain_step, chainable, samples_from_host, warm_up
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler, SchedulerOutput
from kiln.engine.sequence import apply_sampler_output, prompt_logprobs_to_dicts
from kiln.engine.sizing import (
    attention_backend_for,
    num_kv_blocks_for,
    resolve_max_model_len,
    window_lookback,
)
from kiln.engine.stats import EngineStats
from kiln.kernels.kv_cache import kv_cache_torch_dtype
from kiln.models.loader import LoadedModel, load_model
from kiln.outputs import RequestOutput
from kiln.sampling.grammar import GrammarCache
from kiln.sampling.params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger("kiln.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.parallel.tensor_parallel_size > 1:
            # the layers shard already (kiln/parallel.py); the multi-process launcher does not
            # exist yet, so refuse rather than silently run on one GPU
            raise ValueError("tensor_parallel_size > 1 is not supported by the engine yet; "
                             "run with tensor_parallel_size=1")
        mc = config.model
        self.loaded = loaded or load_model(
            mc.model, dtype=mc.dtype, device=mc.device, load_format=mc.load_format,
            revision=mc.revision, max_model_len=mc.max_model_len, seed=mc.seed,
            quantization=mc.quantization)
        arch = self.loaded.arch
        self.max_model_len = resolve_max_model_len(mc.max_model_len, arch)
        self.backend = attention_backend_for(config.attention_backend, self.loaded.device,
                                             arch.head_dim)
        cc = config.cache
        start = time.perf_counter()
        lookback = window_lookback(arch.layer_windows, self.backend)
        num_blocks, num_cpu_blocks = num_kv_blocks_for(config, self.loaded, self.max_model_len,
                                                       self.backend, lookback)
        self.kv_cache = KVCache(arch.num_layers, num_blocks, cc.block_size,
                                self.loaded.model.num_kv_heads, arch.head_dim,
                                kv_cache_torch_dtype(cc.kv_cache_dtype, self.loaded.dtype),
                                self.loaded.device, num_cpu_blocks=num_cpu_blocks)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                 num_cpu_blocks=num_cpu_blocks, lookback=lookback)
        if self.kv.null_block is not None:
            self.kv_cache.zero_block(self.kv.null_block)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.loaded, self.kv_cache, self.kv, self.backend, mc.seed)
        self.grammars = GrammarCache(self.loaded.tokenizer, arch.vocab_size,
                                     self.loaded.eos_token_ids, self.loaded.device)
        self.requests: dict[str, Request] = {}
        self.num_scheduled_last_step = 0
        self._in_flight: InFlightStep | None = None
        self.stats = EngineStats(num_kv_blocks=num_blocks)
        self.startup_seconds = {"load_weights": self.loaded.load_seconds,
                                "warm_up_size_and_allocate_kv": time.perf_counter() - start}
        if self.backend == "triton" and not config.enforce_eager:
            self.startup_seconds["capture_cuda_graphs"] = self.runner.capture_graphs(
                config.scheduler.max_num_seqs, self.max_model_len)
        self.runner.warm_up_sampling()  # kernels a request may need first: loaded now
        if config.scheduler.async_scheduling:
            warm_up(self.loaded.device)  # the chained steps' own device ops, loaded now
        log.info("start-up: %s", ", ".join(f"{k} {v:.1f} s"
                                            for k, v in self.startup_seconds.items()))
        log.info("KV cache: %d blocks of %d tokens (%d tokens), %d CPU swap blocks; attention "
                 "backend %s; max_model_len %d", num_blocks, cc.block_size,
                 num_blocks * cc.block_size, num_cpu_blocks, self.backend, self.max_model_len)
        if lookback is not None:
            log.info("every layer slides: blocks more than %d keys behind a sequence's next query "
                     "are freed", lookback)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptLike, params: SamplingParams,
                    arrival_time: float | None = None, stream: bool = True) -> Request:
        """Validate and queue a request; bad input raises ValueError and changes nothing.

        ``stream=False`` returns the request from ``step()`` only once it has finished.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.make_request(request_id, prompt, params, arrival_time, stream)
        self.enqueue(request)
        return request

    def make_request(self, request_id: str, prompt: PromptLike, params: SamplingParams,
                     arrival_time: float | None = None, stream: bool = True) -> Request:
        """Tokenize and validate without touching the engine's state (safe from any thread)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a kiln.SamplingParams")
        params = params.with_bad_words_tokenized(self.tokenizer)
        vocab_size = self.loaded.arch.vocab_size
        parsed = tokenize_prompt(prompt, self.tokenizer, vocab_size)
        num_prompt = len(parsed.token_ids)
        check_prompt_length(num_prompt, self.max_model_len)
        max_num_seqs = self.config.scheduler.max_num_seqs
        if params.n > max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs={max_num_seqs}")
        for field, ids in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", list(params.logit_bias)),
                           ("allowed_token_ids", params.allowed_token_ids or []),
                           ("bad_words_token_ids",
                            [t for word in params.bad_words_token_ids for t in word])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{field} {bad} are outside the vocabulary "
                                 f"[0, {vocab_size})")
        # the n samples are scheduled together: if they can never hold their blocks at once the
        # request would be preempted and requeued forever, stalling everything behind it
        longest = min(self.max_model_len, num_prompt + (params.max_tokens or self.max_model_len))
        needed = params.n * max_blocks_held(longest, self.config.scheduler.max_num_batched_tokens,
                                            self.kv.block_size, self.kv.lookback)
        if needed > self.kv.num_usable_blocks:
            raise ValueError(f"SamplingParams.n={params.n} samples of up to {longest} tokens "
                             f"need {needed} KV "
                             f"blocks but the cache holds {self.kv.num_usable_blocks}; lower n or "
                             f"max_tokens")
        grammar = (self.compile_grammar(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        return Request(request_id, parsed.token_ids, params, self.loaded.eos_token_ids,
                       self.max_model_len, self.tokenizer, self.loaded.device,
                       prompt=parsed.text, arrival_time=arrival_time, stream=stream,
                       grammar=grammar)

    def compile_grammar(self, structured: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """xgrammar's compiled grammar of ``structured``, from the engine's cache or compiled
        now (synchronously, on the caller's thread; safe from any); ValueError saying why it
        does not compile."""
        try:
            return self.grammars.compile(structured)
        except ValueError as exc:
            raise ValueError(f"SamplingParams.structured_outputs: {exc}") from None

    def enqueue(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.remove(request)
        request.abort()
        request.metrics.finished_time = time.monotonic()
        self.stats.finished_by_reason["abort"] += 1
        self._refresh_gauges()
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the requests that progressed (or finished).

        With async scheduling a step may stay in flight: the next call launches the step after
        it first and only then applies it, so each call returns the outputs of the step before.
        """
        prev, self._in_flight = self._in_flight, None
        if prev is not None:  # a request admitted next can reuse the prompt blocks it fills
            self._cache_filled_blocks(prev.out)
        chained = chain_step(prev, self.scheduler, self.kv) if prev is not None else None
        if chained is not None:
            out, token_ids = chained
            self._note_scheduled(out)
            applied: list[list[RequestOutput]] = []

            def apply_prev() -> None:
                applied.append(self._update(*prev.wait()))

            # a step whose sampling reads prev's tokens on the host (a grammar's mask,
            # penalties ...) applies prev between its forward's launch and its sampling (the GPU
            # runs the forward meanwhile); the others launch whole, then apply prev
            reads_prev = any(samples_from_host(item.seq) for item in out.scheduled)
            result = self.runner.execute(out, token_ids, apply_prev if reads_prev else None)
            self._in_flight = InFlightStep.launch(out, result)
            outputs = applied[0] if applied else self._update(*prev.wait())
        else:
            outputs = self._update(*prev.wait()) if prev is not None else []
            outputs += self._schedule_and_run()
        self._refresh_gauges()
        return outputs

    def _schedule_and_run(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self._note_scheduled(out)
        if not out.scheduled:
            self.runner.apply_cache_ops(out)
            return []
        result = self.runner.execute(out)
        if self.config.scheduler.async_scheduling and chainable(out, result):
            self._in_flight = InFlightStep.launch(out, result)  # its blocks: at the next step()
            return []
        self._cache_filled_blocks(out)
        return self._update(out, result)

    def _note_scheduled(self, out: SchedulerOutput) -> None:
        self.num_scheduled_last_step = len(out.scheduled)
        now = time.monotonic()
        for item in out.scheduled:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = now

    def _cache_filled_blocks(self, out: SchedulerOutput) -> None:
        """Hash for prefix reuse the blocks a launched step fills, once every step before it is
        applied (so its tokens are on the host) and before the next is scheduled: a step
        launched after it reads them only after they are written. Once per step: a step kept
        in flight at the start of the next step(), one applied at once before its update."""
        block_size = self.kv_cache.block_size
        for item in out.scheduled:
            seq = item.seq
            end = seq.num_computed_tokens + item.num_new_tokens
            if end // block_size > seq.num_computed_tokens // block_size and not seq.finished:
                # token_ids copies the list: skip the steps that complete no block
                self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, end)

    def _update(self, out: SchedulerOutput, result: StepResult,
                now: float | None = None) -> list[RequestOutput]:
        """Apply a finished step; ``now``: when its tokens reached the host (default: now)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for item, first, lps in result.prompt_logprobs:
            ids = item.request.prompt_token_ids[first:first + lps.token_logprobs.shape[0] + 1]
            item.request.prompt_logprobs += prompt_logprobs_to_dicts(
                lps, ids, item.request.params.prompt_logprobs)[1:]
            item.request.prompt_logprob_ranks += lps.token_ranks.tolist()
        apply_sampler_output(result.seqs, result.token_ids, result.logprobs)
        self.stats.generation_tokens += len(result.seqs)
        now = time.monotonic() if now is None else now
        sampled = {r.request_id: r for r in result.requests}  # in order, each once
        outputs = []
        num_prompt_tokens = 0
        for request in sampled.values():
            if not request.forked:
                self._fork(request)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                num_prompt_tokens += len(request.prompt_token_ids)
            metrics.token_times.append(now)
        self.stats.prompt_tokens += num_prompt_tokens
        if result.seqs:  # as vLLM's iteration_tokens_total: the steps that sampled, prompts whole
            self.stats.iteration_tokens.observe(num_prompt_tokens + len(result.seqs))
        for seq in result.seqs:
            if seq.finished:
                self.kv.free(seq.seq_id)
        finished = [r for r in sampled.values() if r.finished]
        for request in finished:
            self._finish(request, now)
        if finished:
            done = {id(r) for r in finished}
            self.scheduler.running = [r for r in self.scheduler.running if id(r) not in done]
        for request in sampled.values():
            if request.stream or request.finished:
                outputs.append(request.output())
        return outputs

    def _fork(self, request: Request) -> None:
        parent = request.seqs[0]
        for child in request.seqs[1:]:
            self.kv.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
        request.forked = True

    def _finish(self, request: Request, now: float) -> None:
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = now
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            self.stats.finished_by_reason[seq.finish_reason] += 1

    def _refresh_gauges(self) -> None:
        s, kv = self.stats, self.kv
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_swapped = len(self.scheduler.swapped)
        s.kv_usage = kv.usage
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = kv.stats.prefix_cache_queries
        s.prefix_cache_hits = kv.stats.prefix_cache_hits

    def stream_outputs(self) -> Iterator[RequestOutput]:
        """Step until idle, yielding every step's outputs as it returns them, with the heap of
        the loop's start out of garbage collection and no full collections (gc_heap.py)."""
        with finite_loop_heap():
            while self.has_unfinished_requests():
                yield from self.step()

    def run_to_completion(self) -> list[RequestOutput]:
        """Step until idle; the final output of every request, in finishing order."""
        return [o for o in self.stream_outputs() if o.finished]
