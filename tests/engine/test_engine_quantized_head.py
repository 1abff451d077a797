"""The paged engine on a weight-only quantized model, LM head included (greedy, float32, CPU).

The head is W8A16 (uint8 codes per output channel) whether the layers are int8 or int4.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_engine, random_workload, run_all
from tiny_models import TRITON_GEOMETRY, build_model

from kiln.engine.reference import reference_generate


@pytest.fixture(scope="module", params=["llama3.1", "qwen2"])  # untied; tied embeddings
def model_dir(request, tmp_path_factory):
    # 256 / 384 wide: int4's groups of 128 divide every Linear's inputs
    return build_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer=False,
                       **TRITON_GEOMETRY)


@pytest.mark.parametrize("quantization,layer_codes", [("int8", torch.uint8),
                                                      ("int4", torch.int32)])
def test_engine_generates_with_a_quantized_head(model_dir, quantization, layer_codes):
    engine = make_engine(model_dir, quantization=quantization)
    model = engine.loaded.model
    assert model.layers[0].mlp.down_proj.qweight.dtype == layer_codes
    assert model.lm_head.qweight.dtype == torch.uint8
    assert "weight" in dict(model.embed_tokens.named_parameters())  # lookups stay dense
    prompts, params = random_workload(12, seed=7, max_prompt=80)
    with torch.inference_mode():
        ref = reference_generate(engine.loaded, prompts, params, engine.max_model_len)
    expected = {str(i): [c.token_ids for c in r.outputs] for i, r in enumerate(ref)}
    assert run_all(engine, prompts, params) == expected
    assert sum(len(t[0]) for t in expected.values()) == sum(p.max_tokens for p in params)
