from __future__ import annotations

import pytest
import torch
from engine_helpers import make_engine, random_workload

from kiln.engine.reference import reference_generate


@pytest.fixture(scope="module")
def reference_outputs(tiny_llama):
    """Greedy outputs of the contiguous reference path for the shared 64-request workload."""
    prompts, params = random_workload(64, seed=1)
    engine = make_engine(tiny_llama)
    with torch.inference_mode():
        ref = reference_generate(engine.loaded, prompts, params, engine.max_model_len)
    return prompts, params, {str(i): [c.token_ids for c in r.outputs] for i, r in enumerate(ref)}
