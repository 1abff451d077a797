"""GPU checks of the model and engine (run on the device machine with `pytest -m gpu`).

Figures (max relative error, token match rates) are printed and appended to the JSON file
named by $KILN_GPU_REPORT so the GPU suite can record them.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import transformers

import kiln
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.reference import reference_generate
from kiln.models import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]


def report(name: str, value) -> None:
    print(f"GPU-REPORT {name} = {value}")
    path = os.environ.get("KILN_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "value": value}) + "\n")


@pytest.mark.parametrize("variant", ["llama2", "llama3.1", "mistral", "qwen2", "qwen3"])
def test_bf16_logits_close_to_transformers(variant, tiny_model_dirs):
    path = tiny_model_dirs[variant]
    loaded = load_model(str(path), dtype="bfloat16", device="cuda")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    ref = ref.cuda().eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, loaded.arch.vocab_size, (3, 45), generator=gen).cuda()
    with torch.no_grad():
        expected = ref(ids).logits.float()
    got = loaded.model.full_logits(ids)
    rel = ((got - expected).norm() / expected.norm()).item()
    report(f"bf16_logits_rel_error[{variant}]", rel)
    assert rel <= 2e-2, f"{variant}: relative error {rel:.3e}"


def _workload(num: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 300))] for _ in range(num)]
    params = [kiln.SamplingParams(max_tokens=rng.randint(1, 32), temperature=0.0,
                                  ignore_eos=True) for _ in range(num)]
    return prompts, params


def _heldout_workload(num: int, seed: int):
    """Prompts cut from the zoo's held-out stdlib files (1..300 kiln-tiny tokens): text the model
    predicts with confidence, unlike random ids, where near-ties are everywhere."""
    from kiln.eval.perplexity import dataset_texts, encode_documents
    from kiln.models.loader import load_tokenizer
    from kiln.zoo import model_path

    ids = encode_documents(load_tokenizer(model_path("kiln-tiny")), dataset_texts("zoo-heldout",
                                                                                None), 200_000)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        length = rng.randint(1, 300)
        start = rng.randrange(0, ids.numel() - length)
        prompts.append(ids[start:start + length].tolist())
    params = [kiln.SamplingParams(max_tokens=rng.randint(1, 32), temperature=0.0,
                                  ignore_eos=True) for _ in range(num)]
    return prompts, params


def _cuda_engine(path, backend: str, dtype: str = "bfloat16", **options) -> LLMEngine:
    """A fresh CUDA engine: 96 tokens a step and 4096 KV blocks unless the options say
    otherwise."""
    options.setdefault("max_num_batched_tokens", 96)
    options.setdefault("num_kv_blocks", 4096)
    return LLMEngine.from_kwargs(str(path), dtype=dtype, device="cuda", attention_backend=backend,
                                 **options)


def _complete(engine: LLMEngine, prompts, params) -> list:
    """Every request's RequestOutput, in request order; every KV block free again after."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    done = {o.request_id: o for o in engine.run_to_completion()}
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


def _engine_outputs(path, backend: str, prompts, params, dtype: str = "bfloat16",
                    **options) -> list:
    return _complete(_cuda_engine(path, backend, dtype, **options), prompts, params)


def _engine_run(path, backend: str, prompts, params, dtype: str = "bfloat16", **options) -> list:
    return [o.outputs[0] for o in _engine_outputs(path, backend, prompts, params, dtype,
                                                  **options)]


def _engine_tokens(path, backend: str, prompts, params, **options) -> list[list[int]]:
    return [c.token_ids for c in _engine_run(path, backend, prompts, params, **options)]


def _match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    total = sum(len(x) for x in a)
    same = sum(x == y for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))
    return same / total


def _assert_divergences_at_near_ties(eager: list, fast: list, name: str) -> None:
    """Where a fast-path sequence first leaves the torch backend's, the torch run's top two
    logprobs there are a near-tie (every later token follows from the flip); at most a quarter
    of the sequences diverge."""
    gaps = []
    for e, f in zip(eager, fast, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(e.token_ids, f.token_ids, strict=True))
                      if a != b), None)
        if first is not None:
            top = sorted(e.logprobs[first].values(), reverse=True)
            gaps.append(top[0] - top[1])
    report(f"{name}_divergence_logprob_gaps", [round(g, 4) for g in gaps])
    assert all(g < 0.25 for g in gaps), f"a divergence at a clear choice (gap {max(gaps):.3f})"
    assert len(gaps) <= len(eager) // 4


def test_engine_torch_backend_matches_reference_on_cuda(tiny_llama):
    prompts, params = _workload(64, seed=1)
    got = _engine_tokens(tiny_llama, "torch", prompts, params)
    loaded = load_model(str(tiny_llama), dtype="bfloat16", device="cuda")
    ref = reference_generate(loaded, prompts, params, 512)
    rate = _match_rate([r.outputs[0].token_ids for r in ref], got)
    report("engine_torch_vs_reference_bf16_token_match", rate)
    assert rate >= 0.99


def test_engine_triton_backend_and_graphs_match_torch_backend():
    """Triton attention + CUDA graphs against the torch backend on kiln-tiny (head_dim 64, GQA 3),
    64 prompts cut from held-out standard-library source.

    bf16 kernels round differently, so a near-tie can flip a greedy token, and every later token
    of that sequence then differs too. The test therefore checks that each first divergence is a
    near-tie in the torch backend's own logprobs, and reports the raw token match rate.
    """
    prompts, params = _heldout_workload(64, seed=2)
    with_lps = [kiln.SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True,
                                    logprobs=2) for p in params]
    eager = _engine_run("kiln-tiny", "torch", prompts, with_lps, enforce_eager=True)
    fast = _engine_run("kiln-tiny", "triton", prompts, with_lps)  # CUDA graphs for decode
    # plain greedy (no logprobs) takes the argmax captured inside the graph: same tokens
    assert _engine_tokens("kiln-tiny", "triton", prompts, params) == [c.token_ids for c in fast]
    # one request at a time: short prompts take the captured prefill graphs
    alone = [_engine_run("kiln-tiny", "triton", [p], [sp])[0]
             for p, sp in zip(prompts[:8], with_lps[:8], strict=True)]
    fast_alone = fast[:8]
    assert _match_rate([c.token_ids for c in fast_alone], [c.token_ids for c in alone]) >= 0.9
    rate = _match_rate([c.token_ids for c in eager], [c.token_ids for c in fast])
    report("engine_triton_graphs_vs_torch_bf16_token_match", rate)
    _assert_divergences_at_near_ties(eager, fast, "engine_triton_graphs_vs_torch")


def _teacher_forced_choices(backend: str, prompts, outputs, **options) -> list[list[int]]:
    """The backend's greedy choice at every generated position with the context forced: each
    request is its prompt followed by ``outputs`` (another run's tokens), and the choice for
    output i is the top prompt logprob at its position, given that run's first i tokens."""
    params = kiln.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                 prompt_logprobs=1)
    forced = [prompt + out for prompt, out in zip(prompts, outputs, strict=True)]
    done = _engine_outputs("kiln-tiny", backend, forced, [params] * len(forced), **options)
    return [[max(lps, key=lps.get) for lps in o.prompt_logprobs[len(p):len(p) + len(out)]]
            for o, p, out in zip(done, prompts, outputs, strict=True)]


def test_engine_triton_backend_agrees_token_by_token_with_context_forced():
    """The bf16 comparison without the cascade: free running, one near-tie flip changes every
    later token of its sequence; here both backends choose each token of the torch backend's
    own greedy outputs (the same 64 held-out prompts) with that output as the context (prompt
    logprobs: the prefill kernels), so a disagreement counts once, where the kernels disagree."""
    prompts, params = _heldout_workload(64, seed=2)
    outputs = _engine_tokens("kiln-tiny", "torch", prompts, params, enforce_eager=True)
    torch_choices = _teacher_forced_choices("torch", prompts, outputs, enforce_eager=True)
    triton_choices = _teacher_forced_choices("triton", prompts, outputs)
    # forced on its own outputs the torch backend picks them again, but where its prefill path
    # (other GEMM shapes and attention kernels than a decode step's) rounds a near-tie otherwise
    report("engine_torch_teacher_forced_self_agreement", _match_rate(outputs, torch_choices))
    rate = _match_rate(torch_choices, triton_choices)
    report("engine_triton_vs_torch_bf16_teacher_forced_agreement", rate)
    assert rate >= 0.99


def test_engine_triton_backend_matches_torch_backend_in_float32():
    """The same comparison in float32, where rounding no longer flips near-ties: what is left
    to differ is the engine's fast path itself (paged Triton kernels, CUDA graphs, async
    scheduling). Triton's float32 dots run in IEEE precision, cuBLAS' without TF32."""
    prompts, params = _heldout_workload(64, seed=2)
    eager = _engine_tokens("kiln-tiny", "torch", prompts, params, dtype="float32",
                           enforce_eager=True)
    fast = _engine_tokens("kiln-tiny", "triton", prompts, params, dtype="float32")
    rate = _match_rate(eager, fast)
    report("engine_triton_graphs_vs_torch_fp32_token_match", rate)
    assert rate >= 0.99


def _staggered_outputs(prompts, params, gaps: list[int], **options) -> list:
    """kiln-tiny float32 completions (each request's first) of requests that arrive while the
    earlier ones decode: ``gaps[i]`` steps run after request i arrives."""
    engine = LLMEngine.from_kwargs("kiln-tiny", dtype="float32", device="cuda",
                                   num_kv_blocks=4096, **options)
    done = {}
    for i, (prompt, sp, gap) in enumerate(zip(prompts, params, gaps, strict=True)):
        engine.add_request(str(i), prompt, sp)
        for _ in range(gap):
            done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    done |= {o.request_id: o.outputs[0] for o in engine.run_to_completion()}
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


def _staggered_tokens(prompts, params, gaps: list[int], **options) -> list[list[int]]:
    return [c.token_ids for c in _staggered_outputs(prompts, params, gaps, **options)]


def _record_splits(monkeypatch) -> list[bool]:
    """For every step the runner considers splitting: whether it replayed the decode graph and
    a prefill graph."""
    from kiln.engine.model_runner import ModelRunner

    splits = []
    real_split = ModelRunner._graph_split

    def recording_split(self, scheduled):
        split = real_split(self, scheduled)
        splits.append(split is not None and len(split[0]) > 0)
        return split

    monkeypatch.setattr(ModelRunner, "_graph_split", recording_split)
    return splits


def _record_prefill_replays(monkeypatch) -> list[list[int]]:
    """The start positions of the chunks of every prefill-graph replay, as they happen."""
    from kiln.engine.cuda_graphs import StepGraphs

    replays = []
    real_run_prefill = StepGraphs.run_prefill

    def recording_run_prefill(self, chunks):
        replays.append([start for _, start, _ in chunks])
        return real_run_prefill(self, chunks)

    monkeypatch.setattr(StepGraphs, "run_prefill", recording_run_prefill)
    return replays


def test_prompts_admitted_beside_decodes_replay_two_graphs(monkeypatch):
    """Requests admitted while others decode, one to three at a time: the step replays the
    decode graph and one prefill graph for its prompts instead of one eager mixed step, and
    every token is the eager engine's (float32: no bf16 near-tie flips), with and without async
    scheduling."""
    prompts, _ = _heldout_workload(12, seed=5)
    params = [kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 12
    splits = _record_splits(monkeypatch)
    replays = _record_prefill_replays(monkeypatch)
    # admitted together: {0}, {1, 2}, {3, 4, 5}, {6}, {7, 8, 9}, {10}, {11}
    gaps = [2, 0, 2, 0, 0, 2, 2, 0, 0, 2, 2, 2]
    eager = _staggered_tokens(prompts, params, gaps, enforce_eager=True)
    assert not any(splits) and not replays  # no graphs: nothing to split into
    for async_scheduling in (True, False):
        splits.clear()
        replays.clear()
        assert _staggered_tokens(prompts, params, gaps, async_scheduling=async_scheduling) == eager
        assert sum(splits) >= 4, splits
        assert max(len(chunks) for chunks in replays) == 3, replays


def test_batches_padded_to_a_larger_faster_graph_change_no_token(monkeypatch):
    """Where start-up timing finds a larger decode graph faster, a batch replays it with padded
    rows: every token is the eager engine's (float32), here with every batch routed to the
    largest graph."""
    from kiln.engine import cuda_graphs

    def largest(sizes, ms, margin=0.05):
        return {size: sizes[-1] for size in sizes[:-1]}

    replayed = []  # (the smallest graph holding a batch, the graph it replayed, the largest)
    real_replay_size = cuda_graphs.StepGraphs.replay_size

    def recording_replay_size(self, num_seqs):
        size = real_replay_size(self, num_seqs)
        smallest = next(s for s in self.batch_sizes if s >= num_seqs)
        replayed.append((smallest, size, self.batch_sizes[-1]))
        return size

    monkeypatch.setattr(cuda_graphs, "fastest_holding", largest)
    monkeypatch.setattr(cuda_graphs.StepGraphs, "replay_size", recording_replay_size)
    prompts, _ = _heldout_workload(12, seed=5)
    params = [kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 12
    gaps = [2, 0, 2, 0, 0, 2, 2, 0, 0, 2, 2, 2]
    eager = _staggered_tokens(prompts, params, gaps, enforce_eager=True)
    assert not replayed  # no graphs
    assert _staggered_tokens(prompts, params, gaps) == eager
    assert replayed and all(size == largest_size for _, size, largest_size in replayed)
    assert any(smallest < size for smallest, size, _ in replayed)  # past the next graph


def test_graph_steps_sample_logprobs_and_penalties_like_eager(monkeypatch):
    """Admissions beside decodes where requests ask for logprobs or penalties: the two replays'
    logits are sampled together, and every token and logprob is the eager engine's (float32)."""
    prompts, _ = _heldout_workload(12, seed=9)
    variants = [{"logprobs": 2}, {"presence_penalty": 0.5, "frequency_penalty": 0.3},
                {"repetition_penalty": 1.2, "logprobs": 1}, {}]
    params = [kiln.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                  **variants[i % 4]) for i in range(12)]
    splits = _record_splits(monkeypatch)
    gaps = [2, 0, 2, 0, 0, 2, 2, 0, 0, 2, 2, 2]
    eager = _staggered_outputs(prompts, params, gaps, enforce_eager=True)
    splits.clear()
    graphs = _staggered_outputs(prompts, params, gaps, async_scheduling=False)
    assert sum(splits) >= 4, splits
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]
    for fast, ref in zip(graphs, eager, strict=True):
        assert (fast.logprobs is None) == (ref.logprobs is None)
        for got, want in zip(fast.logprobs or [], ref.logprobs or [], strict=True):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-3 for t in want), (got, want)


def test_prompt_tails_after_cached_tokens_replay_prefill_graphs(monkeypatch):
    """Prompts cut by a 64-token budget, and prompts whose first blocks another request left in
    the prefix cache, compute their last chunk after tokens already in the pages: a prefill
    graph replays it (beside decodes, or alone), its keys read from the pages, and every token
    is the eager engine's (float32)."""
    heldout, _ = _heldout_workload(12, seed=7)
    shared = max(heldout, key=len)[:80]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(heldout)]
    params = [kiln.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 12
    replays = _record_prefill_replays(monkeypatch)
    # each arrives alone, 7 steps after the one before: its last chunk (or the tail after a
    # prefix hit) has the step's budget to itself beside the decodes; with async scheduling
    # the rest of a cut prompt comes in a step chained to the one in flight
    gaps = [7] * 12
    eager = _staggered_tokens(prompts, params, gaps, enforce_eager=True,
                              max_num_batched_tokens=64)
    for async_scheduling in (True, False):
        replays.clear()
        assert _staggered_tokens(prompts, params, gaps, max_num_batched_tokens=64,
                                 async_scheduling=async_scheduling) == eager
        assert sum(start > 0 for starts in replays for start in starts) >= 4, replays


@pytest.mark.parametrize("quantization", [None, "int4", "int8", "fp8"])
def test_programmatic_dependent_launch_changes_no_token(quantization, monkeypatch):
    """PDL (kernels starting before their predecessor ends) must not change a bit: every kernel
    waits before it reads an activation, so the tokens with and without it are identical, in
    bf16, through the weight-only GEMV that loads its weights before the wait, and through FP8
    W8A8 (the norms' and the gated quantizer's codes feeding the tile GEMM and cuBLAS)."""
    prompts, params = _heldout_workload(32, seed=3)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("KILN_PDL", flag)
        runs.append(_engine_tokens("kiln-tiny", "triton", prompts, params,
                                   quantization=quantization))
    assert runs[0] == runs[1]


def test_int8_large_batch_decode_through_wint_ws_changes_no_token_with_pdl(monkeypatch):
    """300 requests decoding together: W8A16's GEMMs from 32 rows, the LM head's float32 logits
    included, run the persistent Gluon kernel (kiln/kernels/wint_ws.py: its TMA descriptors
    baked into the CUDA graphs, its producer waiting for the kernel before it). The tokens with
    and without PDL are identical, and the Gluon kernel ran."""
    from kiln.kernels import quant_gemm

    calls = []
    real = quant_gemm.wint_ws_gemm
    monkeypatch.setattr(quant_gemm, "wint_ws_gemm",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts, params = _heldout_workload(300, seed=5)
    params = [kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 300
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("KILN_PDL", flag)
        runs.append(_engine_tokens("kiln-tiny", "triton", prompts, params, quantization="int8",
                                   max_num_seqs=512, max_num_batched_tokens=2048))
    assert calls
    assert runs[0] == runs[1]


def test_quantized_engine_is_deterministic():
    """The same requests give the same tokens run after run: split-K partial sums are added in a
    fixed order (per-split slices, not atomics, whose order flipped near-ties between runs)."""
    prompts, params = _heldout_workload(32, seed=3)
    runs = [_engine_tokens("kiln-tiny", "triton", prompts, params, quantization="int4")
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_engine_seed_repeats_unseeded_sampling_through_graphs_and_chained_steps():
    """On CUDA (graphs, async scheduling) requests without a seed of their own draw from the
    engine's stream: one engine seed repeats its tokens whatever torch's default stream holds,
    another seed gives others."""
    prompts, _ = _heldout_workload(24, seed=4)
    params = [kiln.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, ignore_eos=True)
              for _ in prompts]

    def sampled(seed: int, torch_seed: int) -> list[list[int]]:
        torch.manual_seed(torch_seed)
        return _engine_tokens("kiln-tiny", "triton", prompts, params, seed=seed)

    first = sampled(11, torch_seed=0)
    assert sampled(11, torch_seed=1) == first
    assert sampled(12, torch_seed=0) != first


def test_engine_fp8_kv_cache_with_chunked_prompts_next_to_decodes():
    """An fp8 cache through the Triton backend, 96 tokens a step, so prompt chunks share steps
    with decodes (the attention layer splits such batches, and an fp8 cache reads every key back
    from its pages): every request completes, and the greedy tokens follow the torch backend over
    the same fp8 cache up to near-ties."""
    prompts, params = _heldout_workload(32, seed=3)
    with_lps = [kiln.SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True,
                                    logprobs=2) for p in params]
    eager = _engine_run("kiln-tiny", "torch", prompts, with_lps, kv_cache_dtype="fp8",
                        enforce_eager=True)
    fast = _engine_run("kiln-tiny", "triton", prompts, with_lps, kv_cache_dtype="fp8")
    assert [len(c.token_ids) for c in fast] == [p.max_tokens for p in params]
    rate = _match_rate([c.token_ids for c in eager], [c.token_ids for c in fast])
    report("engine_triton_vs_torch_fp8_kv_token_match", rate)
    _assert_divergences_at_near_ties(eager, fast, "engine_triton_vs_torch_fp8_kv")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_through_graphs_and_chained_steps_changes_no_token(mode):
    """48 requests of up to 332 tokens, a third of them n = 3 seeded samples that share their
    prompt's blocks, on a pool of 48 blocks (768 tokens): requests are preempted by swap or by
    recompute again and again (on CPU 30 and 21 times) while decode graphs, prefill graphs and
    chained steps run. In float32 every sample's tokens are those of a pool where nothing is
    preempted."""
    prompts, params = _heldout_workload(48, seed=5)
    params = [p if i % 3 else kiln.SamplingParams(n=3, max_tokens=p.max_tokens, temperature=0.8,
                                                   seed=i, ignore_eos=True)
              for i, p in enumerate(params)]
    ample = _engine_outputs("kiln-tiny", "triton", prompts, params, dtype="float32",
                            max_model_len=400)
    engine = _cuda_engine("kiln-tiny", "triton", dtype="float32", max_model_len=400,
                          num_kv_blocks=48, preemption_mode=mode)
    tight = _complete(engine, prompts, params)
    report(f"engine_preemption_{mode}_counts",
           [engine.scheduler.num_preemptions, engine.scheduler.num_swap_outs])
    assert engine.scheduler.num_preemptions > 0
    assert (engine.scheduler.num_swap_outs > 0) == (mode == "swap")
    engine.kv.check_integrity()
    want = [c.token_ids for o in ample for c in o.outputs]
    got = [c.token_ids for o in tight for c in o.outputs]
    assert [len(t) for t in got] == [len(t) for t in want]
    rate = _match_rate(want, got)
    report(f"engine_preemption_{mode}_token_match", rate)
    assert rate >= 0.99
