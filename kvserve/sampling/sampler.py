"""The batched, per-request-deterministic sampler (the worker's side of sampling).

Determinism contract: the random draw for a request at sequence position ``p`` depends only
on ``(seed, p)`` — not on the batch it runs in, the device, or the node. Noise is drawn on
the CPU from a generator seeded by a mix of the two, so a standby continuing a stream
samples exactly the token the primary would have. Every logits processor (``processors``)
changes a row from that row's own ``SampleRow`` only, so a row's token never depends on the
other rows either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.cpu_kernels import kernels_loaded
from kvserve.sampling.params import Logprob, SampleRow, position_seed
from kvserve.sampling.processors import needs_processing, process_logits


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
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and kernels_loaded()
    ):
        return torch.ops.kvserve.argmax_rows(logits)
    return logits.argmax(dim=-1)


def argmax_only(rows: list[SampleRow]) -> bool:
    """Whether every row needs only its logits' argmax: greedy, no logprobs, no grammar
    mask and no logits processor. Such logits may stay in the model's dtype: the argmax of
    bf16 values is that of their (exact) float32 conversion."""
    return all(
        r.params.greedy and r.params.logprobs is None and r.mask is None
        and not needs_processing(r)
        for r in rows
    )  # fmt: skip


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Pick one token per row of ``logits`` ``[len(rows), vocab]``: float32 (changed in
    place by the logits processors), or any float dtype when ``argmax_only(rows)``
    (otherwise converted to float32 first)."""
    if logits.dtype != torch.float32 and not argmax_only(rows):
        logits = logits.float()
    process_logits(logits, rows)
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
