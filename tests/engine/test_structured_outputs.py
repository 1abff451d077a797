"""Structured outputs through the paged engine on kiln-tiny (a trained tokenizer; its weights
know no JSON, so every output below conforms because the grammar's mask made it): JSON schemas,
regexes, choices, grammars, n > 1, mixed batches, async scheduling and preemption."""

from __future__ import annotations

import json
import re

import pytest
from engine_helpers import DeviceOps, generate_in_order, make_engine

import kiln
from kiln.engine.reference import reference_generate

P, S = kiln.SamplingParams, kiln.StructuredOutputsParams
PROMPT = "def parse(data):\n    return"
COLORS = ["red", "green", "light blue"]
SCHEMA = {"type": "object",
          "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"type": "string", "enum": COLORS}},
          "required": ["age", "color"]}
REGEX = r"(0|[1-9][0-9]{0,3})-[a-z]{2,6}"
CHOICES = ["alpha", "beta", "gamma delta"]


def follows_schema(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"age", "color"}, text
    age = value["age"]
    assert isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 150, text
    assert value["color"] in COLORS, text


@pytest.fixture(scope="module")
def engine():
    return make_engine("kiln-tiny", num_kv_blocks=128)


def samples(outputs) -> list[kiln.CompletionOutput]:
    return [c for o in outputs for c in o.outputs]


@pytest.mark.parametrize("compact", [False, True])
def test_a_json_schema_request_decodes_to_an_object_that_follows_it(engine, compact):
    structured = S(json=SCHEMA, disable_any_whitespace=compact)
    params = [P(temperature=0.0, max_tokens=64, structured_outputs=structured),
              P(temperature=1.0, seed=3, n=2, max_tokens=64, structured_outputs=structured)]
    got = samples(generate_in_order(engine, [PROMPT] * 2, params))
    assert len(got) == 3
    for c in got:
        assert c.finish_reason == "stop" and c.stop_reason is None, c
        follows_schema(c.text)
        if compact:
            assert "\n" not in c.text


def test_a_regex_request_matches_it_whole(engine):
    params = [P(temperature=1.0, seed=seed, max_tokens=48, structured_outputs=S(regex=REGEX))
              for seed in range(4)] + [P(temperature=0.0, max_tokens=48,
                                         structured_outputs=S(regex=REGEX))]
    got = samples(generate_in_order(engine, [PROMPT] * len(params), params))
    for c in got:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c
    assert len({c.text for c in got}) > 1


def test_a_choice_request_returns_one_of_the_choices_each_sample(engine):
    params = P(temperature=1.5, seed=1, n=4, max_tokens=16, structured_outputs=S(choice=CHOICES))
    got = samples(generate_in_order(engine, [PROMPT], [params]))
    assert len(got) == 4
    for c in got:
        assert c.text in CHOICES and c.finish_reason == "stop", c
    assert len({c.text for c in got}) > 1  # each sample its own matcher, its own draw


def test_json_object_and_an_ebnf_grammar(engine):
    grammar = 'root ::= "x = " num (" + " num)? ";"\nnum ::= [1-9] [0-9]?'
    params = [P(temperature=0.0, max_tokens=48,
                structured_outputs=S(json_object=True, disable_any_whitespace=True)),
              P(temperature=1.0, seed=4, max_tokens=48, structured_outputs=S(grammar=grammar))]
    obj, expr = samples(generate_in_order(engine, [PROMPT] * 2, params))
    assert obj.finish_reason == "stop" and json.loads(obj.text), obj  # a non-empty object
    assert expr.finish_reason == "stop" and re.fullmatch(r"x = [1-9]\d?( \+ [1-9]\d?)?;",
                                                         expr.text), expr


def test_a_grammar_that_ends_ends_the_output_despite_ignore_eos(engine):
    params = P(temperature=0.0, max_tokens=16, ignore_eos=True,
               structured_outputs=S(choice=CHOICES))
    (c,) = samples(generate_in_order(engine, [PROMPT], [params]))
    assert c.text in CHOICES and c.finish_reason == "stop" and c.stop_reason is None


def test_a_grammar_other_constraints_leave_no_token_ends_in_abort(engine):
    # once "yes" is out only EOS may follow, and min_tokens bans it
    params = P(temperature=0.0, max_tokens=16, min_tokens=8, structured_outputs=S(choice=["yes"]))
    (c,) = samples(generate_in_order(engine, [PROMPT], [params]))
    assert c.text == "yes" and c.finish_reason == "abort", c


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_plain_requests_beside_structured_ones_are_token_identical_to_running_alone(
        async_scheduling):
    engine = make_engine("kiln-tiny", num_kv_blocks=128, async_scheduling=async_scheduling)
    plain = P(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["import os\n", "class Stack:\n", PROMPT]
    alone = [c.token_ids for c in samples(generate_in_order(engine, prompts, [plain] * 3))]
    mixed = generate_in_order(engine, [prompts[0], PROMPT, prompts[1], PROMPT, prompts[2]],
                     [plain, P(temperature=0.0, max_tokens=64, structured_outputs=S(json=SCHEMA)),
                      plain, P(temperature=0.9, seed=2, max_tokens=16,
                               structured_outputs=S(choice=CHOICES)), plain])
    got = samples(mixed)
    assert [got[0].token_ids, got[2].token_ids, got[4].token_ids] == alone
    follows_schema(got[1].text)
    assert got[3].text in CHOICES


def test_structured_steps_chain_sampling_after_the_step_before_and_async_changes_no_output(
        monkeypatch):
    """Async scheduling launches a step before the host has the last one's tokens; a
    structured row's mask needs them, so a chained step with one applies the step before
    between its forward and its sampling (and only then builds the masks)."""
    params = [P(temperature=0.0, max_tokens=40, ignore_eos=True),
              P(temperature=1.0, seed=5, max_tokens=64, structured_outputs=S(json=SCHEMA)),
              P(temperature=0.0, max_tokens=40, ignore_eos=True),
              P(temperature=0.7, seed=6, max_tokens=48, structured_outputs=S(regex=REGEX)),
              P(temperature=0.0, max_tokens=8, structured_outputs=S(choice=CHOICES))]
    prompts = ["import os\n", PROMPT, "class Stack:\n", PROMPT, PROMPT]
    outputs = {}
    for async_scheduling in (True, False):
        engine = make_engine("kiln-tiny", num_kv_blocks=128, async_scheduling=async_scheduling)
        steps = []  # (chained, any structured row, the step before applied before sampling)
        real = engine.runner.execute

        def spy(out, lookahead_ids=None, before_sampling=None, real=real, steps=steps):
            def applied_first():
                steps[-1] = (*steps[-1][:2], True)
                before_sampling()

            steps.append((lookahead_ids is not None,
                          any(item.seq.grammar is not None for item in out.scheduled), False))
            return real(out, lookahead_ids, before_sampling and applied_first)

        monkeypatch.setattr(engine.runner, "execute", spy)
        outputs[async_scheduling] = got = samples(generate_in_order(engine, prompts, params))
        follows_schema(got[1].text)
        assert re.fullmatch(REGEX, got[3].text)
        assert got[4].text in CHOICES and got[4].finish_reason == "stop"
        # every chained step with a grammar samples after the step before is applied; no other
        assert all(first == (chained and structured) for chained, structured, first in steps)
        assert any(chained and structured for chained, structured, _ in steps) == async_scheduling
    assert [c.token_ids for c in outputs[True]] == [c.token_ids for c in outputs[False]]


def test_a_preempted_structured_request_resumes_its_grammar():
    prompts = [PROMPT * 6, "import os\n" * 16, "class Stack:\n" * 9, PROMPT * 5]
    structured = S(json=SCHEMA, disable_any_whitespace=True)
    params = [P(temperature=1.0, seed=s, max_tokens=64, structured_outputs=structured)
              for s in range(4)]
    roomy = samples(generate_in_order(make_engine("kiln-tiny", num_kv_blocks=128), prompts, params))
    tight = make_engine("kiln-tiny", num_kv_blocks=10, block_size=16, max_model_len=160)
    got = samples(generate_in_order(tight, prompts, params))
    assert tight.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in roomy]
    for c in got:
        follows_schema(c.text)


def test_what_does_not_compile_is_refused_before_anything_is_queued(engine):
    for structured, says in ((S(json={"type": "foo"}), "the JSON schema does not compile"),
                             (S(regex="(ab"), "the regex does not compile")):
        with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs: {says}"):
            engine.add_request("bad", PROMPT, P(structured_outputs=structured))
        assert not engine.requests and not engine.has_unfinished_requests()


def test_structured_steps_run_no_device_op_their_first_compile_did_not(tiny_llama,
                                                                       monkeypatch):
    """The mask's device ops (its kernel, and laying its rows out) run once when the engine
    compiles its first grammar, on the caller's thread: on CUDA the first structured step then
    loads nothing while the batch waits."""
    at_start_up = DeviceOps()
    with at_start_up:
        engine = make_engine(tiny_llama)
        engine.add_request("0", [5, 6, 7], P(temperature=0.0, max_tokens=6,
                                             structured_outputs=S(regex="[a-f]+")))
    sampling = DeviceOps()
    monkeypatch.setattr(engine.runner, "_sample", sampling.around(engine.runner._sample))
    engine.add_request("1", [8, 9], P(temperature=0.8, max_tokens=6, n=2,
                                      structured_outputs=S(choice=["ab", "cd"])))
    engine.add_request("2", [8, 9], P(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.run_to_completion()
    assert ("aten.index_copy_.default", ("torch.int32", "torch.int64")) in sampling.ops
    assert sampling.ops <= at_start_up.ops, sorted(sampling.ops - at_start_up.ops)


def test_llm_generate_and_chat_take_structured_outputs():
    llm = kiln.LLM("kiln-tiny", device="cpu", dtype="float32", num_kv_blocks=64)
    params = P(temperature=0.0, max_tokens=16, structured_outputs=S(choice=CHOICES))
    [chat] = llm.chat([{"role": "user", "content": "Pick one."}], params)
    [plain] = llm.generate(PROMPT, params)
    assert chat.outputs[0].text in CHOICES and plain.outputs[0].text in CHOICES
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs: the regex does not"):
        llm.generate([PROMPT, PROMPT], [params, P(structured_outputs=S(regex="["))])
    assert not llm.engine.requests


def test_the_reference_generator_refuses_structured_outputs(engine):
    with pytest.raises(ValueError, match="reference_generate does not implement"):
        reference_generate(engine.loaded, [[5, 6]], [P(structured_outputs=S(choice=["a"]))],
                           engine.max_model_len)
