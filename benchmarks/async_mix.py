"""Output tok/s of a batch that mixes plain greedy requests with ones whose sampling reads the
host's outputs (structured outputs, penalties, min_tokens) or returns logprobs, with async
scheduling on and off, one engine each, in the order given.

    PYTHONPATH=. python3 benchmarks/async_mix.py [--model DIR] [--num-requests 64]
        [--input-len 512] [--output-len 256] [--orders on,off,on,off]

Until 4a86381 such a request sent every step it was in through the synchronous path; now a
chained step holding one applies the step in flight between its forward and its sampling. The
structured requests follow a JSON schema (their outputs are checked to parse); dummy weights
of the Llama-3.1-8B architecture by default. Grammars need a tokenizer: a model folder without one
(the workloads' config-only folders) runs with kiln-tiny's beside its config (--tokenizer-from),
whose ids all lie inside the 8B vocabulary; the masks then cost what a real tokenizer's would
per step, as they are built over the model's whole vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from kiln.llm import LLM
from kiln.models.loader import TOKENIZER_FILES, resolve_model_path
from kiln.sampling.params import SamplingParams, StructuredOutputsParams
from kiln.zoo import model_path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}


def mixed_params(num: int, output_len: int) -> list[SamplingParams]:
    """A quarter each: plain greedy, JSON schema, penalties + min_tokens, logprobs."""
    kinds = [dict(temperature=0.0, ignore_eos=True),
             dict(temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
             dict(temperature=0.8, seed=1, repetition_penalty=1.1, presence_penalty=0.3,
                  min_tokens=output_len // 2, ignore_eos=True),
             dict(temperature=0.0, logprobs=5, ignore_eos=True)]
    return [SamplingParams(max_tokens=output_len, **kinds[i % len(kinds)]) for i in range(num)]


def with_tokenizer(model: str, tokenizer_from: str, workdir: str) -> str:
    """``model`` itself when its folder holds a tokenizer, else a folder in ``workdir`` with its
    config.json and the tokenizer files of ``tokenizer_from`` (a folder or zoo name), those the
    loader reads (TOKENIZER_FILES)."""
    path = resolve_model_path(model)
    if any((path / f).exists() for f in TOKENIZER_FILES):
        return model
    source = Path(tokenizer_from) if Path(tokenizer_from).is_dir() else Path(
        model_path(tokenizer_from))
    target = Path(workdir) / "model"
    target.mkdir()
    shutil.copy(path / "config.json", target)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target)
    print(f"{path} has no tokenizer: {source.name}'s beside its config", flush=True)
    return str(target)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """(seconds, output tokens) of one batch, every request submitted at once."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    for out, p in zip(outputs, params, strict=True):
        if p.structured_outputs is not None and out.outputs[0].finish_reason == "stop":
            json.loads(out.outputs[0].text)  # a completed structured answer parses
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="benchmarks/workloads/llama-3.1-8b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--orders", default="on,off,on,off")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--tokenizer-from", default="kiln-tiny",
                        help="tokenizer for a model folder without one (folder or zoo name)")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(args.input_len)]  # within any vocab here
               for _ in range(args.num_requests)]
    params = mixed_params(args.num_requests, args.output_len)
    with tempfile.TemporaryDirectory(prefix="async_mix_") as workdir:
        model = with_tokenizer(args.model, args.tokenizer_from, workdir)
        for order in args.orders.split(","):
            llm = LLM(model, load_format=args.load_format, enable_prefix_caching=False,
                      async_scheduling=order == "on",
                      max_model_len=args.input_len + args.output_len)
            run(llm, prompts[:4], params[:4])  # warm-up: every kind once
            elapsed, tokens = run(llm, prompts, params)
            print(f"async {order}: {tokens} output tokens in {elapsed:.2f} s, "
                  f"{tokens / elapsed:,.1f} tok/s", flush=True)
            del llm


if __name__ == "__main__":
    main()
