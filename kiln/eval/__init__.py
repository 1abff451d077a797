"""Accuracy evaluation: sliding-window perplexity and greedy agreement between models."""

from kiln.eval.perplexity import (
    AgreementResult,
    PerplexityResult,
    encode_documents,
    eval_app,
    greedy_agreement,
    perplexity,
    sliding_windows,
)

__all__ = [
    "AgreementResult",
    "PerplexityResult",
    "encode_documents",
    "eval_app",
    "greedy_agreement",
    "perplexity",
    "sliding_windows",
]
