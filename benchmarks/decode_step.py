"""Device time of one captured decode step, apart from the host: fills the batch-size-B decode
CUDA graph's inputs once for B sequences at a real context length (their pages hold whatever the
cache holds: timing does not depend on the values), then replays the graph back to back and
times the replays with CUDA events. Set next to `kiln bench latency`'s inter-token latency it
says whether a step is bound by the GPU or by the engine's host loop. Llama-3.1-8B shape, dummy
weights. On the GPU machine:

    PYTHONPATH=. python3 benchmarks/decode_step.py [--quantization int4] [--batch-size 1,16,64]
        [--context 256]

The context matters: replaying the graph with the inputs its capture left (one token of
context) hides the attention's share of the step (ab_runs.txt 16).
"""

import argparse

import torch

from kiln.config import SchedulerConfig
from kiln.engine.llm_engine import LLMEngine

parser = argparse.ArgumentParser()
parser.add_argument("--quantization", default=None)
parser.add_argument("--batch-size", default="1",
                    help="comma-separated batch sizes, each timed on the one engine")
parser.add_argument("--replays", type=int, default=200)
parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                    help="the engine's largest batch (its largest captured graph)")
parser.add_argument("--context", type=int, default=256,
                    help="tokens of context per sequence, the new one included (the latency "
                         "workload's mean: 128 prompt + 256 output)")
args = parser.parse_args()

engine = LLMEngine.from_kwargs("benchmarks/workloads/llama-3.1-8b", load_format="dummy",
                               max_model_len=4096, quantization=args.quantization,
                               max_num_seqs=args.max_num_seqs)
graphs = engine.runner.graphs
pages = -(-args.context // graphs.block_size)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for batch in [int(b) for b in args.batch_size.split(",")]:
    if batch * pages > engine.kv_cache.num_blocks:
        raise SystemExit(f"{batch} x {args.context} tokens need {batch * pages} KV blocks; the "
                         f"cache has {engine.kv_cache.num_blocks}")
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    graphs.run([0] * batch, [args.context - 1] * batch, tables)  # inputs, once
    size = graphs.replay_size(batch)  # the captured graph the batch replays (padded up, routed)
    graph = graphs.graphs[("decode", size)]
    for _ in range(10):
        graph.replay()
    start.record()
    for _ in range(args.replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.replays
    print(f"decode step, batch {batch} x {args.context} tokens of context, "
          f"{args.quantization or 'bf16'}: {ms:.3f} ms of "
          f"device time per step ({1e3 / ms:.1f} steps/s) over {args.replays} back-to-back replays "
          f"of the batch-{size} graph")
