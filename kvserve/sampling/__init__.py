"""Sampling: request options (``params``), logits processors (``processors``), the batched
deterministic sampler (``sampler``) and structured outputs' grammars (``guided``, engine
core side). ``from kvserve.sampling import X`` names every public part."""

from kvserve.sampling.params import (
    Logprob,
    SampleRow,
    SamplingParams,
    StructuredSpec,
    child_seed,
    position_seed,
)
from kvserve.sampling.sampler import SampleResult, argmax_only, sample, token_logprobs

__all__ = [
    "Logprob",
    "SampleResult",
    "SampleRow",
    "SamplingParams",
    "StructuredSpec",
    "argmax_only",
    "child_seed",
    "position_seed",
    "sample",
    "token_logprobs",
]
