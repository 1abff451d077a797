"""On CUDA with graphs and async scheduling: structured outputs' grammar mask (xgrammar's Triton
kernel) holds in graph-replayed steps, greedy included (never the argmax the graphs compute for
plain greedy batches), and the plain requests beside them keep their tokens."""

from __future__ import annotations

import json
import re

import pytest
import torch

import kiln
from kiln.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]

P, S = kiln.SamplingParams, kiln.StructuredOutputsParams
SCHEMA = {"type": "object",
          "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"type": "string", "enum": ["red", "green"]}},
          "required": ["age", "color"]}
REGEX = r"(0|[1-9][0-9]{0,3})-[a-z]{2,6}"
PROMPTS = ["import os\n", "def parse(data):\n    return", "class Stack:\n",
           "def parse(data):\n    return", "def parse(data):\n    return"]


def _outputs(params, **options) -> list[kiln.CompletionOutput]:
    # float32: the eager and graph paths then agree token for token, no bf16 near-tie flips
    engine = LLMEngine.from_kwargs("kiln-tiny", dtype="float32", device="cuda",
                                   num_kv_blocks=1024, **options)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {o.request_id: o.outputs for o in engine.run_to_completion()}
    return [c for i in range(len(PROMPTS)) for c in done[str(i)]]


def test_grammar_masks_hold_in_graph_steps_and_plain_rows_keep_their_tokens():
    plain = P(temperature=0.0, max_tokens=24, ignore_eos=True)
    compact = S(json=SCHEMA, disable_any_whitespace=True)
    params = [plain, P(temperature=0.0, max_tokens=64, structured_outputs=compact), plain,
              P(temperature=0.8, seed=3, n=2, max_tokens=48, structured_outputs=S(regex=REGEX)),
              P(temperature=0.0, max_tokens=16, structured_outputs=S(choice=["yes", "no"]))]
    alone = _outputs([plain] * len(PROMPTS))
    eager = _outputs(params, enforce_eager=True)
    value = json.loads(eager[1].text)
    assert set(value) == {"age", "color"} and value["color"] in ("red", "green")
    assert all(re.fullmatch(REGEX, c.text) for c in eager[3:5])
    assert eager[5].text in ("yes", "no")
    assert all(c.finish_reason == "stop" for c in eager[1:2] + eager[3:])
    assert [eager[0].token_ids, eager[2].token_ids] == [alone[0].token_ids, alone[2].token_ids]
    for async_scheduling in (True, False):
        got = _outputs(params, async_scheduling=async_scheduling)
        assert [c.token_ids for c in got] == [c.token_ids for c in eager]
