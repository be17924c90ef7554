"""Perplexity of a model served by the engine, with whatever KV options the engine has.

The text goes through the real serving path — paged cache, the configured KV dtype,
sliding window and sinks — because the point is to measure what those options cost.
Each file is tokenized (with BOS) and cut into non-overlapping windows of ``context``
tokens; every window is one request asking for ``prompt_logprobs``, so all windows are
batched together. Perplexity = exp(mean negative log-likelihood over scored tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood, nats per token
    num_tokens: int  # tokens scored
    num_windows: int
    context: int
    files: tuple[str, ...]
    # each scored token's log-probability, windows in order (for ``logprob_change``)
    token_logprobs: tuple[float, ...] = field(default=(), repr=False)


def logprob_change(a: PerplexityResult, b: PerplexityResult) -> float:
    """Mean absolute change of a scored token's log-probability from ``a`` to ``b``
    (nats): how far one KV option moves each prediction, which perplexity alone hides
    where changes of both signs cancel. ValueError unless both scored the same tokens."""
    if len(a.token_logprobs) != len(b.token_logprobs) or not a.token_logprobs:
        raise ValueError("the two results did not score the same tokens")
    diffs = (abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs, strict=True))
    return sum(diffs) / len(a.token_logprobs)


def windows(token_ids: Sequence[int], context: int) -> list[list[int]]:
    """Non-overlapping windows of ``context`` tokens; a tail shorter than 2 is dropped."""
    out = [list(token_ids[i : i + context]) for i in range(0, len(token_ids), context)]
    return [w for w in out if len(w) >= 2]


def perplexity(
    engine: LLMEngine,
    files: Sequence[str | Path],
    context: int = 512,
    *,
    max_tokens_per_file: int | None = None,
    use_tqdm: bool = True,
) -> PerplexityResult:
    """Score ``files`` with ``engine``. Raises ValueError when there is nothing to score
    or ``context`` exceeds the engine's ``max_model_len`` − 1."""
    if not 2 <= context < engine.max_model_len:
        raise ValueError(
            f"context must be in [2, max_model_len {engine.max_model_len}), got {context}"
        )
    chunks: list[list[int]] = []
    for f in files:
        ids = engine.tokenize(Path(f).read_text(encoding="utf-8", errors="replace"))
        chunks += windows(ids[:max_tokens_per_file], context)
    if not chunks:
        raise ValueError("no text to score")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    ids = [f"ppl-{i}" for i in range(len(chunks))]
    prompts = dict(zip(ids, chunks, strict=True))
    for rid, chunk in prompts.items():
        engine.add_request(rid, chunk, params)
    per_window: dict[str, list[float]] = {}
    bar = tqdm(total=len(chunks), desc="perplexity", unit="window", disable=not use_tqdm)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            targets = prompts[out.request_id][1:]
            per_window[out.request_id] = [
                entry[target].logprob
                for entry, target in zip(out.prompt_logprobs[1:], targets, strict=True)
            ]
            bar.update(1)
    bar.close()
    scored = tuple(x for rid in ids for x in per_window[rid])  # windows in order
    nll = -math.fsum(scored) / len(scored)
    return PerplexityResult(
        math.exp(nll), nll, len(scored), len(chunks), context, tuple(str(f) for f in files), scored
    )
