"""Shared helpers for the engine tests."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kiln
from kiln.engine.llm_engine import LLMEngine


def make_engine(path, **options) -> LLMEngine:
    options = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 2048, **options}
    return LLMEngine.from_kwargs(str(path), **options)


def random_workload(num: int, seed: int, max_prompt: int = 300, max_out: int = 24,
                    vocab: int = 300) -> tuple[list[list[int]], list[kiln.SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
               for _ in range(num)]
    params = [kiln.SamplingParams(max_tokens=rng.randint(1, max_out), temperature=0.0,
                                  ignore_eos=True) for _ in range(num)]
    return prompts, params


def run_all(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = engine.run_to_completion()
    return {o.request_id: [c.token_ids for c in o.outputs] for o in done}


def generate_in_order(engine: LLMEngine, prompts, params) -> list[kiln.RequestOutput]:
    """Run the requests to completion: their outputs in input order, every KV block given back."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {o.request_id: o for o in engine.run_to_completion()}
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


class DeviceOps(TorchDispatchMode):
    """Records each aten op run under it with the dtypes of its tensors: on CUDA each such
    pair is a kernel (or a copy) of its own, loaded on its first launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[tuple[str, tuple[str, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.ops.add((str(func), tuple(sorted({str(t.dtype) for t in tensors}))))
        return func(*args, **kwargs)

    def around(self, fn: Callable) -> Callable:
        """``fn`` recording what it runs here."""
        def recorded(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return recorded
