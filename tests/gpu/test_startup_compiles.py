"""Nothing compiles after start-up: every Triton kernel variant a mixed workload meets is
compiled (or loaded from the cache) while the engine starts, not in a step a request waits on.

Each case runs in a fresh process: kernel variants are cached per process, so one an earlier
test compiled would hide a late one here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import TRITON_GEOMETRY, build_model

pytestmark = pytest.mark.gpu

# the workload: a prompt longer than the token budget (its first chunk takes the long-prompt
# tiles), a prefix-cache hit, sampled, logprobs and n = 2 requests beside greedy ones
_SCRIPT = r"""
import json, random, sys
from triton.runtime.jit import JITFunction
import kiln
from kiln.engine.llm_engine import LLMEngine

late, started = [], [False]
compile_ = JITFunction._do_compile

def record(self, *args, **kwargs):
    if started[0]:
        late.append(self.__name__)
    return compile_(self, *args, **kwargs)

JITFunction._do_compile = record
path, kv_cache_dtype = sys.argv[1:3]
engine = LLMEngine.from_kwargs(path, dtype="bfloat16", device="cuda",
                               kv_cache_dtype=kv_cache_dtype, max_model_len=4096,
                               max_num_batched_tokens=2048, gpu_memory_utilization=0.5)
started[0] = True
rng = random.Random(0)

def ids(n):
    return [rng.randrange(3, 300) for _ in range(n)]

def greedy(n, **kw):
    return kiln.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)

shared = ids(600)
waves = [
    [(ids(3000), greedy(8)), (shared + ids(40), greedy(8)),
     (ids(30), kiln.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1)),
     (ids(30), greedy(8, logprobs=3)), (ids(30), kiln.SamplingParams(max_tokens=8, n=2))]
    + [(ids(rng.randint(1, 300)), greedy(rng.randint(1, 40))) for _ in range(16)],
    [(shared + ids(50), greedy(8)), (ids(3000), greedy(4))],
]
for w, wave in enumerate(waves):
    for i, (prompt, params) in enumerate(wave):
        engine.add_request(f"{w}-{i}", prompt, params)
    engine.run_to_completion()
print(json.dumps({"late": late, "prefix_hits": engine.kv.stats.prefix_cache_hits}))
"""


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_nothing_compiles_after_start_up(kv_cache_dtype, tmp_path):
    path = build_model("llama3.1", tmp_path / "m", max_position_embeddings=4096,
                       **TRITON_GEOMETRY)
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), kv_cache_dtype],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["prefix_hits"] > 0
    assert result["late"] == [], f"compiled after start-up: {result['late']}"
