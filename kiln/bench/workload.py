"""Benchmark workloads: seeded, and expressible as token ids so any engine can replay them.

``fixed``: every prompt has ``input_len`` random token ids and asks for ``output_len`` tokens.
``random``: lengths drawn uniformly from ``[len * (1 - r), len * (1 + r)]`` (vLLM's
``--random-range-ratio``). Either may open every prompt with the same ``prefix_len`` random
tokens (vLLM's ``--random-prefix-len``: a shared system prompt, which the prefix cache serves
after the first request). ``jsonl``: one JSON object per line with ``prompt`` (text or token
ids) or ``prompt_token_ids``, and optionally ``output_len`` (or ``max_tokens``).

Token ids are drawn with ``numpy.random.default_rng(seed)`` from ``[10, 120000)``, clipped to
the model's vocabulary, as in shared/GPU.md's peer measurements.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASET_NAMES = ("fixed", "random", "jsonl")
TOKEN_ID_LOW, TOKEN_ID_HIGH = 10, 120000
# fields that only the generated workloads (fixed, random) read
_GENERATED_ONLY = ("input_len", "random_range_ratio", "prefix_len", "token_id_low", "token_id_high")
_INT_FIELDS = ("num_prompts", "input_len", "output_len", "prefix_len", "seed", "token_id_low",
               "token_id_high")


def _is_int(value: Any) -> bool:
    """An integer as JSON means one: true and false are Python ints too, but not counts."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class WorkloadSpec:
    dataset_name: str = "fixed"
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    random_range_ratio: float = 0.0
    prefix_len: int = 0  # tokens every prompt opens with, before its own input_len
    seed: int = 0
    dataset_path: str | None = None
    token_id_low: int = TOKEN_ID_LOW
    token_id_high: int = TOKEN_ID_HIGH

    def __post_init__(self) -> None:
        # a workload file's "16" or 2.5 would otherwise fail deep in numpy, as a TypeError
        for name in _INT_FIELDS:
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not (_is_int(self.random_range_ratio) or isinstance(self.random_range_ratio, float)):
            raise ValueError(f"random_range_ratio must be a number, got "
                             f"{self.random_range_ratio!r}")
        if self.dataset_name not in DATASET_NAMES:
            raise ValueError(f"dataset_name={self.dataset_name!r}; choose one of "
                             f"{', '.join(DATASET_NAMES)}")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got "
                             f"{self.random_range_ratio}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if self.dataset_name == "jsonl" and self.prefix_len:
            raise ValueError("prefix_len applies to the generated workloads (fixed, random), "
                             "not to a JSONL dataset's own prompts")
        if self.dataset_name == "jsonl" and not self.dataset_path:
            raise ValueError("dataset_name='jsonl' needs --dataset-path FILE.jsonl")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise ValueError(f"token id range [{self.token_id_low}, {self.token_id_high}) is "
                             f"empty")

    def to_dict(self) -> dict[str, Any]:
        """The fields that shaped the requests: a JSONL dataset brings its own prompts, so the
        generated workloads' lengths and token range are left out (output_len stays: it is the
        default of lines without one)."""
        fields = dataclasses.asdict(self)
        if self.dataset_name == "jsonl":
            for name in _GENERATED_ONLY:
                del fields[name]
        return fields

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> WorkloadSpec:
        """A canonical workload (benchmarks/workloads/*.json); ``overrides`` win."""
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a workload is one JSON object of fields, not a "
                             f"{type(data).__name__}")
        unknown = sorted(set(data) - fields - {"description"})
        if unknown:
            raise ValueError(f"{path}: unknown workload field(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(fields))}")
        data = {k: v for k, v in data.items() if k in fields}
        try:
            return cls(**{**data, **overrides})
        except ValueError as exc:  # (flags are checked by the CLI: a bad value is the file's)
            raise ValueError(f"{path}: {exc}") from None


@dataclass
class BenchRequest:
    prompt: list[int] | str  # token ids, or text for jsonl workloads
    output_len: int

    @property
    def prompt_len(self) -> int | None:
        """Known for token-id prompts; text is counted by whoever tokenizes it."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


def _lengths(rng: np.random.Generator, n: int, center: int, ratio: float) -> np.ndarray:
    if ratio == 0.0:
        return np.full(n, center, dtype=np.int64)
    low = max(1, int(center * (1 - ratio)))
    high = max(low, int(center * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def build_requests(spec: WorkloadSpec, vocab_size: int | None = None) -> list[BenchRequest]:
    """The workload's requests; the same spec always gives the same requests."""
    if spec.dataset_name == "jsonl":
        return load_jsonl(Path(str(spec.dataset_path)), spec.num_prompts, spec.output_len,
                          vocab_size)
    high = min(spec.token_id_high, vocab_size) if vocab_size else spec.token_id_high
    if high <= spec.token_id_low:
        raise ValueError(f"vocabulary of {vocab_size} leaves no token ids above "
                         f"{spec.token_id_low}")
    rng = np.random.default_rng(spec.seed)
    ratio = spec.random_range_ratio if spec.dataset_name == "random" else 0.0
    input_lens = _lengths(rng, spec.num_prompts, spec.input_len, ratio)
    output_lens = _lengths(rng, spec.num_prompts, spec.output_len, ratio)
    # drawn only when asked for, so that a workload without one keeps its prompts
    prefix = rng.integers(spec.token_id_low, high, size=spec.prefix_len).tolist() \
        if spec.prefix_len else []
    return [BenchRequest(prefix + rng.integers(spec.token_id_low, high, size=int(n)).tolist(),
                         int(m)) for n, m in zip(input_lens, output_lens, strict=True)]


WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts come from a stream no measured request uses


def derived_requests(spec: WorkloadSpec, vocab_size: int | None, seed_offset: int,
                     num_prompts: int | None = None, output_len: int | None = None
                     ) -> list[BenchRequest]:
    """Requests like ``spec``'s but from another seed (fresh prompts: no prefix-cache hits
    between warm-up and measurement, or between the rates of a sweep). A JSONL dataset has
    only its own prompts, so it is replayed as is."""
    n = num_prompts or spec.num_prompts
    if spec.dataset_name == "jsonl":
        reqs = build_requests(dataclasses.replace(spec, num_prompts=n), vocab_size)
    else:
        reqs = build_requests(dataclasses.replace(spec, num_prompts=n,
                                                  seed=spec.seed + seed_offset), vocab_size)
    if output_len is not None:
        reqs = [BenchRequest(r.prompt, min(r.output_len, output_len)) for r in reqs]
    return reqs


def _parse_line(obj: Any, where: str, default_output_len: int) -> BenchRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prompt = obj.get("prompt_token_ids", obj.get("prompt"))
    is_ids = isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)
    if not (is_ids or (isinstance(prompt, str) and prompt)):
        raise ValueError(f"{where}: needs 'prompt' (non-empty text or token ids) or "
                         f"'prompt_token_ids'")
    if is_ids and min(prompt) < 0:
        raise ValueError(f"{where}: token id {min(prompt)} is negative; ids start at 0")
    output_len = obj.get("output_len", obj.get("max_tokens", default_output_len))
    if not _is_int(output_len) or output_len < 1:
        raise ValueError(f"{where}: output_len must be an integer >= 1, got {output_len!r}")
    return BenchRequest(list(prompt) if is_ids else prompt, output_len)


def load_jsonl(path: Path, num_prompts: int, default_output_len: int,
               vocab_size: int | None = None) -> list[BenchRequest]:
    """The first ``num_prompts`` requests of a JSONL file (blank lines skipped); token ids
    checked against ``vocab_size`` where given (the model's), naming the line."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    requests: list[BenchRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if len(requests) == num_prompts:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            request = _parse_line(obj, f"{path}:{lineno}", default_output_len)
            top = max(request.prompt, default=0) if isinstance(request.prompt, list) else 0
            if vocab_size and top >= vocab_size:
                raise ValueError(
                    f"{path}:{lineno}: token id {top} is outside the model's vocabulary of "
                    f"{vocab_size} ids; write the workload for this model with kiln bench "
                    f"workload --vocab-size {vocab_size}")
            requests.append(request)
    if len(requests) < num_prompts:
        raise ValueError(f"{path} holds {len(requests)} prompts but --num-prompts asks for "
                         f"{num_prompts}")
    return requests


def write_jsonl(requests: list[BenchRequest], path: Path) -> None:
    """Write requests in the JSONL form ``load_jsonl`` (and peers' scripts) read back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            key = "prompt_token_ids" if isinstance(r.prompt, list) else "prompt"
            f.write(json.dumps({key: r.prompt, "output_len": r.output_len}) + "\n")
