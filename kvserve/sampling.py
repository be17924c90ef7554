"""Sampling parameters and the batched, per-request-deterministic sampler.

Determinism contract: the random draw for a request at sequence position ``p`` depends only
on ``(seed, p)`` — not on the batch it runs in, the device, or the node. Noise is drawn on
the CPU from a generator seeded by a mix of the two, so a standby continuing a stream
samples exactly the token the primary would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.model.cpu_kernels import kernels_loaded

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    """Per-request sampling options, named as in vLLM / the OpenAI API.

    ``temperature`` 0 means greedy. ``top_k`` 0 or -1 disables top-k. ``seed`` None gets a
    random seed when the request is created (kept with the request, so preemption and
    failover reproduce the same tokens). ``logprobs`` N returns the sampled token's
    log-probability plus the top N, computed from the raw model logits; ``prompt_logprobs``
    N does the same for every prompt token after the first (it disables prefix-cache hits
    for the request, since cached positions are not recomputed).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = tuple(stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (integers in [0, 2**31))")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token, its rank (1 = most likely) and decoded text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of output ``index`` of an ``n > 1`` request: the request's own seed for the
    first, a derived one for the others (None stays None: random seeds)."""
    return None if seed is None or index == 0 else position_seed(seed, -1 - index)


def position_seed(seed: int, position: int) -> int:
    """Mix (seed, position) into a 63-bit generator seed (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    seed: int
    position: int  # index in the sequence of the token being sampled
    suppress: tuple[int, ...] = ()  # token ids forbidden here (EOS under min_tokens)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


def _filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to ``logits`` (rows all non-greedy)."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    logits = logits / temps.to(logits.device).unsqueeze(1)
    vocab = logits.shape[1]
    top_ks = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    top_ps = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
        drop = ranks >= k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        p = torch.tensor(top_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
        drop = drop | (cum >= p)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    min_ps = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_ps):
        probs = logits.softmax(dim=-1)
        m = torch.tensor(min_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
        threshold = probs.max(dim=-1, keepdim=True).values * m
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``; on the CPU, with the kernels loaded, a vectorized kernel
    over rows in parallel (the same indices: first maximum, NaN counts as the maximum)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and kernels_loaded()
    ):
        return torch.ops.kvserve.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Pick one token per row of ``logits`` ``[len(rows), vocab]`` (float32)."""
    for i, r in enumerate(rows):
        if r.suppress:
            logits[i, list(r.suppress)] = float("-inf")
    tokens = _argmax(logits)
    random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_idx:
        sub_rows = [rows[i] for i in random_idx]
        probs = _filter(logits[random_idx], sub_rows).softmax(dim=-1)
        noise = torch.empty(len(sub_rows), logits.shape[1], dtype=torch.float32)
        for j, r in enumerate(sub_rows):
            g = torch.Generator().manual_seed(position_seed(r.seed, r.position))
            noise[j].exponential_(generator=g)
        picked = (probs / noise.to(probs.device)).argmax(dim=-1)
        tokens[random_idx] = picked
    token_list = tokens.tolist()
    logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        lp = logits[want].log_softmax(dim=-1)
        n_top = max(rows[i].params.logprobs or 0 for i in want)
        top_vals, top_ids = lp.topk(max(n_top, 1), dim=-1)
        for j, i in enumerate(want):
            tok = token_list[i]
            tok_lp = lp[j, tok].item()
            rank = int((lp[j] > tok_lp).sum().item()) + 1
            entry = {tok: Logprob(tok_lp, rank)}
            for r, (v, t) in enumerate(zip(top_vals[j].tolist(), top_ids[j].tolist(), strict=True)):
                if r >= (rows[i].params.logprobs or 0):
                    break
                entry.setdefault(t, Logprob(v, r + 1))
            logprobs[i] = entry
    return SampleResult(token_list, logprobs)


def token_logprobs(
    logits: torch.Tensor, targets: list[int], n_top: int
) -> list[dict[int, Logprob]]:
    """For each row of ``logits`` ``[T, vocab]``: the target token's log-probability and
    rank, plus the ``n_top`` most likely tokens (prompt logprobs)."""
    lp = logits.float().log_softmax(dim=-1)
    tgt = torch.tensor(targets, device=lp.device).unsqueeze(1)
    tgt_lp = lp.gather(1, tgt)
    ranks = ((lp > tgt_lp).sum(dim=-1) + 1).tolist()
    tgt_list = tgt_lp.squeeze(1).tolist()
    top_vals, top_ids = lp.topk(n_top, dim=-1) if n_top else (None, None)
    out = []
    for i, t in enumerate(targets):
        entry = {t: Logprob(tgt_list[i], ranks[i])}
        if top_vals is not None:
            for r, (v, tid) in enumerate(
                zip(top_vals[i].tolist(), top_ids[i].tolist(), strict=True)
            ):
                entry.setdefault(tid, Logprob(v, r + 1))
        out.append(entry)
    return out
