"""kvserve: an on-premises LLM serving engine built around KV-cache management."""

from kvserve.config import EngineArgs
from kvserve.llm import LLM
from kvserve.request import CompletionOutput, RequestOutput
from kvserve.sampling import Logprob, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
