"""Structured outputs' parameters, grammar cache and bitmask, on kiln-tiny's trained tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar

from kiln.models.loader import load_tokenizer
from kiln.sampling import Sampler, SamplingMetadata, SamplingParams, StructuredOutputsParams
from kiln.sampling.grammar import (
    GrammarCache,
    GrammarState,
    apply_grammar_bitmask,
    choice_grammar,
    grammar_bitmask,
)
from kiln.zoo import model_path

S = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"},
                                           "color": {"enum": ["red", "green"]}},
          "required": ["age", "color"]}
EOS = 2
NUM_PADDING = 40  # the LM head may be wider than the tokenizer's vocabulary


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(model_path("kiln-tiny"))


@pytest.fixture
def cache(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, len(tokenizer) + NUM_PADDING, [EOS], torch.device("cpu"))


def allowed(state: GrammarState) -> set[int]:
    bitmask = xgrammar.allocate_token_bitmask(1, state.vocab_size)
    state.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1  # [words, 32], token 32w + b
    return set(bits.flatten()[:state.vocab_size].nonzero().flatten().tolist())


@pytest.mark.parametrize("kwargs, says", [
    ({}, "StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
         "json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of .*; got regex, choice"),
    ({"disable_any_whitespace": True}, "got none"),
    ({"json": "{not json"}, r"StructuredOutputsParams.json is not valid JSON: Expecting"),
    ({"json": "[1, 2]"}, r"StructuredOutputsParams.json must be a JSON schema: an object, or "
                         r"its JSON text, got \[1, 2\]"),
    ({"json": {"maximum": float("nan")}}, "StructuredOutputsParams.json is not JSON data"),
    ({"regex": ""}, "StructuredOutputsParams.regex must be a non-empty string without NUL"),
    ({"regex": "a\x00b"}, "StructuredOutputsParams.regex must be"),
    ({"choice": []}, "StructuredOutputsParams.choice must be a non-empty list of non-empty "
                     "strings, got \\[\\]"),
    ({"choice": "yes"}, "StructuredOutputsParams.choice must be"),
    ({"choice": ["yes", ""]}, "StructuredOutputsParams.choice must be"),
    ({"grammar": 3}, "StructuredOutputsParams.grammar must be a non-empty string"),
    ({"json_object": False}, "StructuredOutputsParams.json_object must be True"),
    ({"choice": ["a"], "disable_any_whitespace": 1},
     "StructuredOutputsParams.disable_any_whitespace must be a boolean, got 1")])
def test_bad_structured_outputs_are_value_errors_naming_the_field(kwargs, says):
    with pytest.raises(ValueError, match=says):
        S(**kwargs)


def test_a_schema_as_text_is_parsed_once_and_the_kind_named():
    params = S(json=json.dumps(SCHEMA))
    assert params.json == SCHEMA and params.kind == "json"
    assert S(choice=("a", "b")).choice == ["a", "b"] and S(json_object=True).kind == "json_object"
    assert SamplingParams(structured_outputs=params).structured_outputs is params
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs must be None or a "
                                         "kiln.StructuredOutputsParams, got {'regex': 'a'}"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_a_grammar_compiles_once_per_kind_spec_and_whitespace(cache):
    first = cache.compile(S(json=SCHEMA))
    assert cache.compile(S(json=json.dumps(SCHEMA))) is first  # the same schema as text
    assert cache.compile(S(json=SCHEMA, disable_any_whitespace=True)) is not first
    assert cache.compile(S(choice=["a", "b"])) is cache.compile(S(choice=["a", "b"]))
    assert cache.compile(S(choice=["a", "b"])) is not cache.compile(S(regex="a|b"))
    assert cache._compiler is not None and len(cache._grammars) == 4


def test_the_cache_drops_the_least_recently_used_past_its_bytes(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), [EOS], torch.device("cpu"), max_bytes=1)
    a = cache.compile(S(regex="a+"))
    assert cache.compile(S(regex="a+")) is a
    cache.compile(S(regex="b+"))  # over the budget: only the newest stays
    assert list(cache._grammars) == [("regex", "b+", False)]
    assert cache.compile(S(regex="a+")) is not a


@pytest.mark.parametrize("structured, says", [
    (S(json={"type": "foo"}), 'the JSON schema does not compile: Unsupported type "foo"'),
    (S(json={"type": "integer", "minimum": 5, "maximum": 1}),
     "the JSON schema does not compile: Invalid range: minimum greater than maximum"),
    (S(regex="(ab"), "the regex does not compile: Regex parsing error at position 4"),
    (S(grammar="root ::= "), "the grammar does not compile: EBNF parser error at line 1")])
def test_what_does_not_compile_says_why_without_xgrammars_source_lines(cache, structured, says):
    with pytest.raises(ValueError) as caught:
        cache.compile(structured)
    assert str(caught.value).startswith(says) and ".cc:" not in str(caught.value), caught.value


def test_structured_outputs_need_a_tokenizer():
    cache = GrammarCache(None, 100, [EOS], torch.device("cpu"))
    with pytest.raises(ValueError, match="structured outputs need the model's tokenizer"):
        cache.compile(S(choice=["a"]))


def test_choices_are_matched_exactly_whatever_they_hold(cache):
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "café 🙂", "\x01ctl"]
    assert choice_grammar(["a", 'b"']) == 'root ::= "a" | "b\\""'
    compiled = cache.compile(S(choice=choices))
    for text in [*choices, "say", 'say "hi" ']:
        matcher = xgrammar.GrammarMatcher(compiled)
        whole = matcher.accept_string(text) and matcher.is_completed()
        assert whole == (text in choices), text


def test_padding_ids_past_the_tokenizer_are_never_allowed(cache, tokenizer):
    state = GrammarState(cache.compile(S(regex="[^x]+")))  # nearly every token allowed
    ids = allowed(state)
    assert len(ids) > len(tokenizer) // 2
    assert max(ids) < len(tokenizer)


def test_a_state_advances_on_allowed_tokens_and_ends_on_eos(cache, tokenizer):
    state = GrammarState(cache.compile(S(choice=["yes", "no"])))
    tokens = tokenizer.encode("yes", add_special_tokens=False)
    assert not state.accept(tokenizer.encode("maybe", add_special_tokens=False)[0])
    for token in tokens:
        assert state.accept(token) and not state.terminated
    assert allowed(state) == {EOS}
    assert state.accept(EOS) and state.terminated


def test_the_bitmask_masks_only_the_structured_rows(cache, tokenizer):
    vocab_size = cache.vocab_size
    states = [None, GrammarState(cache.compile(S(choice=["yes", "no"]))), None,
              GrammarState(cache.compile(S(regex="[0-9]+")))]
    rows, bitmask = grammar_bitmask(states, torch.device("cpu"))
    assert rows.tolist() == [1, 3] and bitmask.shape == (2, (vocab_size + 31) // 32)
    assert bitmask.dtype == torch.int32
    logits = torch.randn(4, vocab_size)
    masked = logits.clone()
    apply_grammar_bitmask(masked, rows, bitmask)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # untouched, bit for bit
    for row in (1, 3):
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        keep[list(allowed(states[row]))] = True
        assert torch.equal(masked[row][keep], logits[row][keep])
        assert torch.isneginf(masked[row][~keep]).all()
    assert grammar_bitmask([None, None], torch.device("cpu")) is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_draws_structured_rows_from_their_grammar_and_others_as_before(
        cache, tokenizer, temperature):
    vocab_size = cache.vocab_size
    digits = {t for t in range(len(tokenizer)) if tokenizer.decode([t]).isdigit()}
    params = [SamplingParams(temperature=temperature)] * 3
    logits = torch.randn(3, vocab_size)
    logits[:, sorted(digits)] -= 100  # no row would pick a digit unforced

    def sample(grammars):
        torch.manual_seed(0)  # the rows without a grammar draw the same
        meta = SamplingMetadata.build(params, [None] * 3, [[]] * 3, [[1]] * 3, "cpu",
                                      grammars=grammars)
        return Sampler().sample(logits, meta).token_ids.tolist()

    free = sample(())
    state = GrammarState(cache.compile(S(regex="[0-9]+")))
    forced = sample([None, state, None])
    assert forced[1] in digits and forced[1] in allowed(state)
    assert forced[0] == free[0] and forced[2] == free[2]
