"""Sampling: per-request parameters, the batched sampler, structured outputs' grammars, and
streaming text output."""

from kiln.sampling.detokenizer import IncrementalDetokenizer
from kiln.sampling.params import (
    MAX_LOGPROBS,
    SAMPLING_EPS,
    SamplingParams,
    StructuredOutputsParams,
)
from kiln.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    gather_logprobs,
    generator_for,
)
from kiln.sampling.stop import StopChecker

__all__ = [
    "MAX_LOGPROBS",
    "SAMPLING_EPS",
    "IncrementalDetokenizer",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "StopChecker",
    "StructuredOutputsParams",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "generator_for",
]
