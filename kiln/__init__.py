"""Kiln: make large language models fast and serve them on NVIDIA GPUs."""

from kiln.llm import LLM
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling.params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "__version__"]
