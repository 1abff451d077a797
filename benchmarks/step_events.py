"""Step times around preemptions and long prompts, and Triton variants compiled after start-up.

    PYTHONPATH=. python3 benchmarks/step_events.py swap|recompute|fp8kv [--stagger] [--model DIR]

swap / recompute: 16 requests that fit, then three rounds of 32 requests (301 prompt, 400 output
tokens) over a pool of 700 blocks, so the newest are preempted as the others grow and come back
as the first finish (``--stagger``: prompts of 201-400 tokens, so that the requests cross block
boundaries at different steps rather than all at once). fp8kv (an fp8 KV cache): a round of 16
short requests, then two rounds beside a 12,000-token prompt (chunked by the token budget). Every
engine step is timed between device synchronizations; a first-use stall shows as a step of the
first round far slower than the same step of the next ones. Dummy weights of the Llama-3.1-8B
architecture by default.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from triton.runtime.jit import JITFunction

from kiln.llm import LLM
from kiln.sampling.params import SamplingParams

compiled: list[tuple[str, int]] = []  # (kernel, ms): every variant this process compiles or loads
_compile = JITFunction._do_compile


def _timed_compile(self, *args, **kwargs):
    start = time.perf_counter()
    kernel = _compile(self, *args, **kwargs)
    compiled.append((self.__name__, round((time.perf_counter() - start) * 1000)))
    return kernel


JITFunction._do_compile = _timed_compile


def run_round(llm: LLM, name: str, requests: list[tuple[list[int], int]]) -> None:
    """Step ``requests`` to completion; print the step times and what happened at the slowest."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(f"{name}-{i}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times, events, first = [], [], len(compiled)
    while engine.has_unfinished_requests():
        preempted, swapped = scheduler.num_preemptions, len(scheduler.swapped)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
        event = []
        if scheduler.num_preemptions > preempted:
            event.append(f"preempt+{scheduler.num_preemptions - preempted}")
        if len(scheduler.swapped) < swapped:
            event.append(f"swap_in{swapped - len(scheduler.swapped)}")
        events.append(",".join(event) or "-")
    median = sorted(times)[len(times) // 2]
    print(f"{name:28s} steps {len(times)} median {median:6.2f} ms, total {sum(times):8.1f} ms, "
          f"preemptions so far {scheduler.num_preemptions}, swap-outs {scheduler.num_swap_outs}")
    slowest = sorted(sorted(range(len(times)), key=lambda i: -times[i])[:8])
    print("   slowest:", "  ".join(f"#{i}:{times[i]:.1f}({events[i]})" for i in slowest))
    if len(compiled) > first:
        print("   compiled after start-up:", compiled[first:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["swap", "recompute", "fp8kv"])
    parser.add_argument("--model", default="benchmarks/workloads/llama-3.1-8b")
    parser.add_argument("--stagger", action="store_true",
                        help="swap / recompute: prompt lengths drawn from 201-400 tokens")
    args = parser.parse_args()
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, 120_000) for _ in range(n)]

    start = time.perf_counter()
    if args.mode == "fp8kv":
        llm = LLM(args.model, load_format="dummy", max_model_len=16384, kv_cache_dtype="fp8",
                  enable_prefix_caching=False)
    else:
        llm = LLM(args.model, load_format="dummy", max_model_len=4096, num_kv_blocks=700,
                  preemption_mode=args.mode, swap_space=8, enable_prefix_caching=False)
    print(f"== {args.mode}: start-up {time.perf_counter() - start:.1f} s, compiled "
          f"{len(compiled)} variants ({sum(ms for _, ms in compiled) / 1000:.1f} s)")
    if args.mode == "fp8kv":
        for name in ("warm", "first long", "second long"):
            requests = [(prompt(301), 48) for _ in range(16)]
            if name != "warm":
                requests.append((prompt(12_000), 8))
            run_round(llm, name, requests)
    else:
        run_round(llm, "warm (no preemption)", [(prompt(301), 48) for _ in range(16)])
        for name in ("first", "second", "third"):
            lengths = [rng.randint(201, 400) if args.stagger else 301 for _ in range(32)]
            run_round(llm, f"{name} preempting round", [(prompt(n), 400) for n in lengths])


if __name__ == "__main__":
    main()
