"""Sampling: per-request parameters, the batched sampler, and streaming text output."""

from kiln.sampling.detokenizer import IncrementalDetokenizer
from kiln.sampling.params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams
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
    "compute_prompt_logprobs",
    "gather_logprobs",
    "generator_for",
]
