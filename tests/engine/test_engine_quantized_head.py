"""The paged engine on a weight-only quantized model, LM head included (greedy, float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_engine, random_workload, run_all

from kiln.engine.reference import reference_generate


@pytest.mark.parametrize("variant", ["llama3.1", "qwen2"])  # untied; tied embeddings
def test_engine_generates_with_a_quantized_head(tiny_model_dirs, variant):
    engine = make_engine(tiny_model_dirs[variant], quantization="int8")
    model = engine.loaded.model
    assert model.lm_head.qweight.dtype == torch.uint8
    assert "weight" in dict(model.embed_tokens.named_parameters())  # lookups stay dense
    prompts, params = random_workload(12, seed=7, max_prompt=80)
    with torch.inference_mode():
        ref = reference_generate(engine.loaded, prompts, params, engine.max_model_len)
    expected = {str(i): [c.token_ids for c in r.outputs] for i, r in enumerate(ref)}
    assert run_all(engine, prompts, params) == expected
    assert sum(len(t[0]) for t in expected.values()) == sum(p.max_tokens for p in params)
