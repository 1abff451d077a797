"""Batched token sampling: one call per engine step, no host synchronization inside.

Pipeline per step (all rows at once): structured outputs' grammar bitmask -> allowed_token_ids
mask -> logit_bias -> repetition/frequency/presence penalties -> min_tokens and bad_words bans ->
greedy argmax -> temperature -> min-p -> top-k -> top-p -> exponential race (vLLM v1's order, but
for the bad words, which vLLM bans before the bias: -inf stays -inf through both, so the tokens
are the same; transformers applies min-p last, which differs when min-p and top-p are combined).
Branches depend only on host metadata (e.g. "some row uses top-k"), never on tensor values, so
the caller decides when to wait for the GPU (by reading `SamplerOutput.token_ids`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.kernels.argmax import argmax_rows
from kiln.sampling.grammar import GrammarState, apply_grammar_bitmask, grammar_bitmask
from kiln.sampling.params import SamplingParams
from kiln.upload import upload

_MASK64 = (1 << 64) - 1
# Exp(1) draws can be exactly 0 (CPU computes -log(1 - u) with u = 0); 0 / 0 would be NaN and
# argmax picks NaN, i.e. a masked token. Clamping to the smallest normal float avoids that.
_TINY = torch.finfo(torch.float32).tiny


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def generator_for(seed: int, sample_index: int, device: torch.device | str) -> torch.Generator:
    """A torch.Generator for sample `sample_index` of a request seeded with `seed`.

    Sample 0 uses the seed itself; sample i > 0 uses a splitmix64 mix of (seed, i), which is a
    bijection in i, so the n samples of one request get distinct, reproducible streams.
    """
    base = seed & _MASK64
    mixed = base if sample_index == 0 else _splitmix64(base ^ _splitmix64(sample_index))
    gen = torch.Generator(device=device)
    gen.manual_seed(mixed)
    return gen


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    return upload(torch.tensor(data, dtype=dtype), device)


def _pad(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [list(r) + [-1] * (width - len(r)) for r in rows]


@dataclass
class LogprobsTensors:
    """Each row's chosen (or actual next) token logprob plus its top alternatives; rows that
    asked for fewer than `topk_*.shape[1]` slice their own k on the host."""

    token_logprobs: Tensor  # [num_rows] float32
    # [num_rows] int64, 1 = most likely (OpenAI / vLLM convention). Tied tokens share the
    # best rank (1 + the count strictly above); vLLM counts ties as above, giving the worst.
    token_ranks: Tensor
    topk_token_ids: Tensor  # [num_rows, max_k] int64, most likely first
    topk_logprobs: Tensor  # [num_rows, max_k] float32

    def map(self, fn: Callable[[Tensor], Tensor]) -> LogprobsTensors:
        """``fn`` applied to each tensor (a copy to the host, a selection of rows)."""
        return LogprobsTensors(fn(self.token_logprobs), fn(self.token_ranks),
                               fn(self.topk_token_ids), fn(self.topk_logprobs))


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [num_seqs] int64
    logprobs: LogprobsTensors | None = None  # set when any row asked for logprobs


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, num_logprobs: int) -> LogprobsTensors:
    """Pick each row's token logprob and rank, and its top `num_logprobs` from [rows, vocab]."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(chosen.squeeze(1), ranks, top.indices, top.values)


def compute_prompt_logprobs(
    logits: Tensor, prompt_token_ids: Sequence[int] | Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of each next prompt token: row i scores prompt_token_ids[i + 1].

    `logits[i]` is the model output at the position of prompt_token_ids[i] (rows beyond
    len(prompt_token_ids) - 1 are ignored), so a chunked prefill covering positions [a, b) can
    pass its own logits with prompt_token_ids[a:b + 1]. The first prompt token has no logprob.
    Logprobs come from the raw logits, like the sampler's.
    """
    targets = torch.as_tensor(prompt_token_ids, dtype=torch.int64, device=logits.device)[1:]
    if logits.shape[0] < targets.shape[0]:
        raise ValueError(f"need logits for {targets.shape[0]} positions, got {logits.shape[0]}")
    logprobs = logits[: targets.shape[0]].float().log_softmax(dim=-1)
    return gather_logprobs(logprobs, targets, num_logprobs)


@dataclass
class SamplingMetadata:
    """Per-step batch tensors, built once on the host. A None tensor means no row needs it."""

    num_seqs: int
    all_greedy: bool
    all_random: bool
    greedy_mask: Tensor | None  # [num_seqs] bool, only when greedy and random rows mix
    temperature: Tensor | None  # [num_seqs, 1] float32, 1.0 on greedy rows
    top_k: Tensor | None  # [num_seqs] int64, 0 = off
    max_top_k: int
    top_p: Tensor | None  # [num_seqs, 1] float32, 1.0 = off
    min_p: Tensor | None  # [num_seqs, 1] float32, 0.0 = off
    generators: dict[int, torch.Generator]  # row -> own stream (random rows only)
    needs_shared_draw: bool  # some random row has no generator of its own
    presence_penalty: Tensor | None  # [num_seqs, 1] float32; set together with frequency
    frequency_penalty: Tensor | None  # [num_seqs, 1] float32
    repetition_penalty: Tensor | None  # [num_seqs, 1] float32
    output_token_ids: Tensor | None  # [num_seqs, max_output_len] int64, -1 pads
    prompt_token_ids: Tensor | None  # [num_seqs, max_prompt_len] int64, -1 pads
    restricted_rows: Tensor | None  # [num_restricted] int64, rows with allowed_token_ids
    allowed_rows: Tensor | None  # [num_allowed] int64, with allowed_ids: (row, token) kept
    allowed_ids: Tensor | None  # [num_allowed] int64
    # (row, token) pairs set to -inf: EOS and stop ids before min_tokens, bad words' last tokens
    banned_rows: Tensor | None  # [num_banned] int64
    banned_ids: Tensor | None  # [num_banned] int64
    logit_bias_rows: Tensor | None  # [num_biased] int64, with logit_bias_ids: (row, token)
    logit_bias_ids: Tensor | None  # [num_biased] int64
    logit_bias_values: Tensor | None  # [num_biased] float32, added to those logits
    max_num_logprobs: int | None
    grammar_rows: Tensor | None = None  # [num_structured] int64, rows with structured outputs
    grammar_bitmask: Tensor | None = None  # [num_structured, ceil(vocab / 32)] int32, 1 = allowed

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        grammars: Sequence[GrammarState | None] = (),
    ) -> SamplingMetadata:
        """One row per sequence. `eos_token_ids` are masked (with each row's stop_token_ids)
        while a row has fewer than min_tokens outputs, ignore_eos or not: as in vLLM, min_tokens
        forbids EOS before that many tokens, and ignore_eos only keeps EOS from ending the
        output afterwards. `grammars`, when given, holds each row's structured-output state
        (None for a row without), whose allowed next tokens are read here, on the host."""
        num_seqs = len(params)
        if not (len(generators) == len(output_token_ids) == len(prompt_token_ids) == num_seqs
                and len(grammars) in (0, num_seqs)):
            raise ValueError(
                f"one row per sequence: {num_seqs} params, {len(generators)} generators, "
                f"{len(output_token_ids)} output lists, {len(prompt_token_ids)} prompt lists, "
                f"{len(grammars)} grammars"
            )
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        rand = [p for p, g in zip(params, greedy, strict=True) if not g]

        def column(values: list[float]) -> Tensor:
            return _to_device([[v] for v in values], torch.float32, device)

        def random_rows(value, off: float) -> list:
            # Greedy rows get the "off" value so the random path leaves them untouched.
            return [off if g else value(p) for p, g in zip(params, greedy, strict=True)]

        temperature = top_k = top_p = min_p = None
        if any(p.temperature != 1.0 for p in rand):
            temperature = column(random_rows(lambda p: p.temperature, 1.0))
        max_top_k = max((p.top_k for p in rand), default=0)
        if max_top_k > 0:
            top_k = _to_device(random_rows(lambda p: max(p.top_k, 0), 0), torch.int64, device)
        if any(p.top_p < 1.0 for p in rand):
            top_p = column(random_rows(lambda p: p.top_p, 1.0))
        if any(p.min_p > 0.0 for p in rand):
            min_p = column(random_rows(lambda p: p.min_p, 0.0))
        own = {i: gen for i, gen in enumerate(generators) if gen is not None and not greedy[i]}

        presence = frequency = repetition = out_ids = prompt_ids = None
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            presence = column([p.presence_penalty for p in params])
            frequency = column([p.frequency_penalty for p in params])
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = column([p.repetition_penalty for p in params])
            prompt_ids = _to_device(_pad(prompt_token_ids), torch.int64, device)
        if presence is not None or repetition is not None:
            out_ids = _to_device(_pad(output_token_ids), torch.int64, device)

        restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        restricted_rows = allowed_rows = allowed_ids = None
        if restricted:
            restricted_rows = _to_device(restricted, torch.int64, device)
            allowed_rows = _to_device([i for i in restricted for _ in params[i].allowed_token_ids],
                                      torch.int64, device)
            allowed_ids = _to_device([t for i in restricted for t in params[i].allowed_token_ids],
                                     torch.int64, device)

        rows: list[int] = []
        ids: list[int] = []
        for i, p in enumerate(params):
            banned = None
            if len(output_token_ids[i]) < p.min_tokens:
                banned = set(p.stop_token_ids) | set(eos_token_ids)
            if p.bad_words_token_ids:  # on the host, as in vLLM: the outputs are here
                words = bad_words_banned(p.bad_words_token_ids, output_token_ids[i])
                banned = words if banned is None else banned | words
            if banned:
                rows += [i] * len(banned)
                ids += sorted(banned)
        banned_rows = _to_device(rows, torch.int64, device) if rows else None
        banned_ids = _to_device(ids, torch.int64, device) if rows else None
        biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        bias_rows = bias_ids = bias_values = None
        if biased:
            rows_of, ids_of, values_of = (list(col) for col in zip(*biased, strict=True))
            bias_rows = _to_device(rows_of, torch.int64, device)
            bias_ids = _to_device(ids_of, torch.int64, device)
            bias_values = _to_device(values_of, torch.float32, device)

        all_greedy, all_random = all(greedy), not any(greedy)
        greedy_mask = None
        if not (all_greedy or all_random):
            greedy_mask = _to_device(greedy, torch.bool, device)
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        grammar_rows, bitmask = grammar_bitmask(grammars, device) or (None, None)
        return cls(
            num_seqs=num_seqs,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=own,
            needs_shared_draw=len(own) < len(rand),
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            output_token_ids=out_ids,
            prompt_token_ids=prompt_ids,
            restricted_rows=restricted_rows,
            allowed_rows=allowed_rows,
            allowed_ids=allowed_ids,
            banned_rows=banned_rows,
            banned_ids=banned_ids,
            logit_bias_rows=bias_rows,
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            grammar_rows=grammar_rows,
            grammar_bitmask=bitmask,
        )


def bad_words_banned(bad_words_token_ids: Sequence[Sequence[int]],
                     output_token_ids: Sequence[int]) -> set[int]:
    """The token ids the bad words ban next (vLLM v1's rule): each word's last token, where
    the output so far ends with the word's other tokens (a one-token word: always). Only the
    output counts, not the prompt."""
    banned: set[int] = set()
    num_output = len(output_token_ids)
    for word in bad_words_token_ids:
        num_before = len(word) - 1
        if num_before > num_output:
            continue
        if list(output_token_ids[num_output - num_before:]) == list(word[:num_before]):
            banned.add(word[-1])
    return banned


def _token_counts(padded_ids: Tensor, vocab_size: int) -> Tensor:
    """[num_seqs, vocab] token counts from -1-padded ids; pads land in a spill column."""
    ids = torch.where(padded_ids < 0, vocab_size, padded_ids)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Repetition (HF/vLLM: seen tokens' positive logits / p, negative * p, over prompt and
    output), then OpenAI's frequency and presence penalties over output tokens. In place."""
    if meta.output_token_ids is None:
        return logits
    vocab_size = logits.shape[1]
    counts = _token_counts(meta.output_token_ids, vocab_size)  # [num_seqs, vocab]
    in_output = counts > 0
    if meta.repetition_penalty is not None:
        seen = in_output | (_token_counts(meta.prompt_token_ids, vocab_size) > 0)
        rep = meta.repetition_penalty
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    if meta.frequency_penalty is not None:
        logits -= meta.frequency_penalty * counts
        logits -= meta.presence_penalty * in_output
    return logits


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, max_top_k: int, top_p: Tensor | None
) -> Tensor:
    """Set logits outside each row's top-k, then outside its nucleus (smallest top set with
    probability >= p, computed after top-k), to -inf. Ties at the k-th value are all kept."""
    vocab_size = logits.shape[1]
    if top_p is None:
        # Top-k alone: a partial topk is much cheaper than sorting the vocabulary.
        k_cap = min(max_top_k, vocab_size)
        top_vals = logits.topk(k_cap, dim=-1).values  # [num_seqs, k_cap], descending
        kth = top_vals.gather(1, (top_k.clamp(1, k_cap) - 1).unsqueeze(1))
        kth.masked_fill_((top_k <= 0).unsqueeze(1), float("-inf"))  # row has top-k off
        return logits.masked_fill_(logits < kth, float("-inf"))

    # Stable sort: tied logits break the same way whatever else is in the batch.
    sorted_logits, order = logits.sort(dim=-1, stable=True)  # ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # A token is outside the nucleus when the tokens ranked at or below it hold <= 1 - p.
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cum_probs <= 1 - top_p
    outside[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(outside, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill_(probs < threshold, float("-inf"))


class Sampler:
    """Turns one step's logits into next tokens (and logprobs) for every running sequence.

    `generator` is the stream that random rows without a seed of their own draw from (the
    engine's, seeded by its `seed` as in vLLM); None draws from torch's default generator.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def sample(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """`logits` [num_seqs, vocab] is not modified. Returns tokens still on its device."""
        if logits.dim() != 2 or logits.shape[0] != meta.num_seqs:
            raise ValueError(f"expected logits [{meta.num_seqs}, vocab], got {tuple(logits.shape)}")
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            # vLLM's default: logprobs describe the model, not the sampling transforms.
            raw_logprobs = logits.float().log_softmax(dim=-1)

        logits = logits.to(torch.float32, copy=True)  # the one copy; in place from here on
        # (row, token) pairs through the flat view: `logits[rows, ids] = -inf` copies the scalar
        # from the host and synchronizes on CUDA
        vocab_size = logits.shape[1]
        if meta.grammar_rows is not None:  # first: vLLM v1 masks the logits before its sampler
            apply_grammar_bitmask(logits, meta.grammar_rows, meta.grammar_bitmask)
        if meta.restricted_rows is not None:  # first of the sampler's own, as vLLM v1
            # the allowed logits put aside, their rows set to -inf, the allowed put back
            flat = meta.allowed_rows * vocab_size + meta.allowed_ids
            kept = logits.view(-1).index_select(0, flat)
            logits.index_fill_(0, meta.restricted_rows, float("-inf"))
            logits.view(-1).index_copy_(0, flat, kept)
        if meta.logit_bias_rows is not None:  # before the penalties, as vLLM v1
            flat = meta.logit_bias_rows * vocab_size + meta.logit_bias_ids
            logits.view(-1).index_add_(0, flat, meta.logit_bias_values)
        apply_penalties(logits, meta)
        if meta.banned_rows is not None:
            flat = meta.banned_rows * vocab_size + meta.banned_ids
            logits.view(-1).index_fill_(0, flat, float("-inf"))

        greedy_ids = None if meta.all_random else argmax_rows(logits)
        if meta.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = self._sample_random(logits, meta)
            if greedy_ids is not None:
                token_ids = torch.where(meta.greedy_mask, greedy_ids, token_ids)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    __call__ = sample

    def warm_up(self, vocab_size: int, device: torch.device) -> None:
        """Run every sampling path once on random logits: greedy and random rows together and
        random rows alone; temperature, top-k, top-p, min-p; a seeded and a shared draw;
        allowed_token_ids, logit_bias, penalties, min_tokens, bad words and logprobs; prompt
        logprobs. (Structured outputs' grammar mask runs once when the engine builds its grammar
        compiler, at its first structured request: GrammarCache.)

        On CUDA the first launch of a kernel loads it (lazy module loading) and waits for the
        device, and a Triton kernel compiles on its first call with new constants: at start-up
        that costs nothing, in the first step of the first request that samples it stalls the
        batch, in a chained step the GPU as well. The random streams (the sampler's own and
        torch's default generators) are left as they were."""
        params = [
            SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[1, 2, 3]),
            SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.01, seed=0,
                           presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                           min_tokens=2, logit_bias={1: 2.0}, bad_words_token_ids=[[1, 2]]),
            SamplingParams(temperature=1.0),
        ]
        device = torch.device(device)
        own_state = None if self.generator is None else self.generator.get_state()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for batch in (params, params[1:]):
                generators = [generator_for(p.seed, 0, device) if p.seed is not None else None
                              for p in batch]
                meta = SamplingMetadata.build(batch, generators, [[1]] * len(batch),
                                              [[2, 3]] * len(batch), device, eos_token_ids=[0])
                self.sample(torch.randn(len(batch), vocab_size, device=device), meta)
            compute_prompt_logprobs(torch.randn(2, vocab_size, device=device), [1, 2, 3], 2)
        if own_state is not None:
            self.generator.set_state(own_state)

    def _sample_random(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        if meta.temperature is not None:
            logits.div_(meta.temperature)
        # min-p before top-k/top-p, as in vLLM v1: the nucleus is then taken over the tokens
        # min-p kept (renormalized), so the same top_p + min_p gives the same distribution.
        if meta.min_p is not None:
            apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / q), q ~ Exp(1), is a draw from p without a CDF search.
        # Seeded rows draw q from their own generator so their tokens ignore the batch around
        # them; the rest share one batched draw from the sampler's stream.
        q = torch.empty_like(probs)
        if meta.needs_shared_draw:
            q.exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        q.clamp_min_(_TINY)
        return probs.div_(q).argmax(dim=-1)
