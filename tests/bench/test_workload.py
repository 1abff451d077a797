"""Workloads: seeded, bounded to the vocabulary, and replayable as token-id JSONL."""

from __future__ import annotations

import json

import pytest

from kiln.bench.workload import BenchRequest, WorkloadSpec, build_requests, load_jsonl, write_jsonl


def test_fixed_workload_is_seeded_and_exact():
    spec = WorkloadSpec("fixed", num_prompts=5, input_len=12, output_len=7, seed=3)
    a, b = build_requests(spec), build_requests(spec)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(len(r.prompt) == 12 and r.output_len == 7 for r in a)
    assert all(10 <= t < 120000 for r in a for t in r.prompt)
    other = build_requests(WorkloadSpec("fixed", 5, 12, 7, seed=4))
    assert [r.prompt for r in other] != [r.prompt for r in a]


def test_token_ids_are_clipped_to_the_vocabulary():
    reqs = build_requests(WorkloadSpec("fixed", 20, 50, 4), vocab_size=64)
    ids = [t for r in reqs for t in r.prompt]
    assert min(ids) >= 10 and max(ids) < 64
    with pytest.raises(ValueError, match="no token ids"):
        build_requests(WorkloadSpec("fixed", 1, 4, 4), vocab_size=10)


def test_random_lengths_stay_in_range():
    reqs = build_requests(WorkloadSpec("random", 200, 100, 40, random_range_ratio=0.5, seed=1))
    in_lens = [len(r.prompt) for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150 and len(set(in_lens)) > 20
    assert min(out_lens) >= 20 and max(out_lens) <= 60


def test_shared_prefix_opens_every_prompt():
    """prefix_len tokens shared by every prompt, then each prompt's own input_len."""
    plain = build_requests(WorkloadSpec("random", 6, 20, 4, random_range_ratio=0.5, seed=2))
    shared = build_requests(WorkloadSpec("random", 6, 20, 4, random_range_ratio=0.5,
                                         prefix_len=32, seed=2))
    prefix = shared[0].prompt[:32]
    assert all(r.prompt[:32] == prefix for r in shared)
    assert [len(r.prompt) - 32 for r in shared] == [len(r.prompt) for r in plain]
    assert len({tuple(r.prompt[32:]) for r in shared}) == 6
    with pytest.raises(ValueError, match="prefix_len must be >= 0"):
        WorkloadSpec(prefix_len=-1)
    with pytest.raises(ValueError, match="JSONL"):
        WorkloadSpec("jsonl", dataset_path="x.jsonl", prefix_len=8)


def test_jsonl_round_trip_and_text_prompts(tmp_path):
    path = tmp_path / "w.jsonl"
    reqs = build_requests(WorkloadSpec("fixed", 3, 6, 5))
    write_jsonl(reqs + [BenchRequest("hello there", 9)], path)
    back = load_jsonl(path, 4, default_output_len=1)
    assert [r.prompt for r in back[:3]] == [r.prompt for r in reqs]
    assert back[3].prompt == "hello there" and back[3].output_len == 9
    assert back[3].prompt_len is None and back[0].prompt_len == 6
    spec = WorkloadSpec("jsonl", num_prompts=2, dataset_path=str(path))
    assert len(build_requests(spec)) == 2
    # what a result records: no generated-workload lengths the dataset did not use, and the
    # record rebuilds the same spec
    recorded = spec.to_dict()
    assert "input_len" not in recorded and "prefix_len" not in recorded
    assert WorkloadSpec(**recorded) == spec
    assert WorkloadSpec("fixed", 3, 6, 5).to_dict()["input_len"] == 6


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": [1, 2]}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_jsonl(path, 2, 4)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 3}) + "\n")
    assert load_jsonl(one, 1, 4)[0].output_len == 3
    with pytest.raises(ValueError, match="holds 1 prompts"):
        load_jsonl(one, 5, 4)


def test_spec_validation_and_canonical_files(tmp_path):
    with pytest.raises(ValueError, match="dataset_name"):
        WorkloadSpec("sharegpt")
    with pytest.raises(ValueError, match="dataset-path"):
        WorkloadSpec("jsonl")
    with pytest.raises(ValueError, match="random_range_ratio"):
        WorkloadSpec("random", random_range_ratio=1.0)
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"description": "x", "num_prompts": 64, "input_len": 512,
                                "output_len": 256}))
    spec = WorkloadSpec.from_file(path, num_prompts=2)
    assert (spec.num_prompts, spec.input_len, spec.output_len) == (2, 512, 256)
    path.write_text(json.dumps({"num_promts": 3}))
    with pytest.raises(ValueError, match="num_promts"):
        WorkloadSpec.from_file(path)


def test_jsonl_token_ids_past_the_vocabulary_name_the_line_and_the_fix(tmp_path):
    path = tmp_path / "w.jsonl"
    write_jsonl([BenchRequest([5, 9], 2), BenchRequest([7, 8191, 8192], 2)], path)
    assert len(load_jsonl(path, 2, 4, vocab_size=8193)) == 2
    with pytest.raises(ValueError, match=r"w.jsonl:2: token id 8192 is outside the model's "
                                         r"vocabulary of 8192 ids.*--vocab-size 8192"):
        load_jsonl(path, 2, 4, vocab_size=8192)
    spec = WorkloadSpec("jsonl", dataset_path=str(path), num_prompts=2)
    with pytest.raises(ValueError, match="w.jsonl:2"):
        build_requests(spec, vocab_size=8192)


def test_workload_files_that_are_not_objects_of_typed_fields_name_the_file(tmp_path):
    """Not a TypeError from deep in numpy, nor a JSON error that does not say which file."""
    path = tmp_path / "w.json"
    for text, message in [("nope", "not valid JSON"), ("[1, 2]", "a workload is one JSON object"),
                          ('{"num_prompts": "16"}', "num_prompts must be an integer, got '16'"),
                          ('{"input_len": 2.5}', "input_len must be an integer, got 2.5"),
                          ('{"output_len": true}', "output_len must be an integer, got True"),
                          ('{"random_range_ratio": "0.5"}', "random_range_ratio must be a num")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=f"w.json: {message}"):
            WorkloadSpec.from_file(path)


def test_jsonl_refuses_negative_token_ids_and_boolean_lengths(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, -3]}) + "\n")
    with pytest.raises(ValueError, match="w.jsonl:1: token id -3 is negative"):
        load_jsonl(path, 1, 4)
    path.write_text(json.dumps({"prompt_token_ids": [5, 3], "output_len": True}) + "\n")
    with pytest.raises(ValueError, match="w.jsonl:1: output_len must be an integer >= 1"):
        load_jsonl(path, 1, 4)
