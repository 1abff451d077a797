"""Batch-1 decode speed of the reference (contiguous-KV) generator: Llama-3.1-8B shape, dummy
weights, 128-token prompt, 256 greedy tokens (issue: foundation). Run from the repo root on the
GPU machine: PYTHONPATH=. python3 benchmarks/reference_decode.py
"""

import time

import numpy as np
import torch

import kiln
from kiln.engine.reference import reference_generate
from kiln.models import load_model

loaded = load_model("benchmarks/workloads/llama-3.1-8b", dtype="bfloat16", device="cuda",
                    load_format="dummy")
prompt = np.random.default_rng(0).integers(10, 120000, 128).tolist()
for backend in ("torch", "triton"):
    # the 8-token run times prefill + 7 decodes; the difference isolates 256 decodes
    for n in (8, 264):
        p = kiln.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        reference_generate(loaded, [prompt], [p], 4096, attention_backend=backend)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        reference_generate(loaded, [prompt], [p], 4096, attention_backend=backend)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(f"reference generator, attention {backend}: {n} tokens in {dt:.3f} s", flush=True)
        if n == 8:
            short = dt
    rate = 256 / (dt - short)
    print(f"reference generator, attention {backend}: batch-1 decode {rate:.1f} tok/s")
print(torch.cuda.get_device_name(), torch.__version__)
