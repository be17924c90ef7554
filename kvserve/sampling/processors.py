"""Logits processors: what a request's own options and tokens do to its row of logits.

``process_logits`` changes rows in place, each from its ``SampleRow`` alone (never from
another row, the batch size or the row's index), in the order ``SamplingParams``
documents: allowed ids, suppressed ids (bad words, ``min_tokens``), ``logit_bias``, the
grammar mask, then presence / frequency / repetition penalties. A row that every processor
together forbids entirely (say ``allowed_token_ids`` disjoint from the grammar's tokens)
keeps only what its grammar allows, or its raw logits without a grammar, instead of
sampling from nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.sampling.sampler import SampleRow

_NEG_INF = float("-inf")
_BAN = -100.0  # a logit_bias at or below this bans the token, as OpenAI documents
_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A packed int32 bitmask → a bool tensor ``[vocab]`` (True = allowed); tokens past
    the mask's last word are forbidden."""
    bits = (mask.to(torch.int32).view(-1, 1) >> _SHIFTS) & 1
    allowed = bits.view(-1).bool()
    if allowed.numel() >= vocab:
        return allowed[:vocab]
    return torch.cat([allowed, torch.zeros(vocab - allowed.numel(), dtype=torch.bool)])


def _needs_processing(row: SampleRow) -> bool:
    p = row.params
    return bool(
        row.suppress
        or row.mask is not None
        or p.allowed_token_ids is not None
        or p.logit_bias
        or p.penalized
    )


def process_logits(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Apply every row's processors to ``logits`` ``[len(rows), vocab]`` in place."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if not _needs_processing(row):
            continue
        raw = logits[i].clone()
        grammar = None if row.mask is None else unpack_bitmask(row.mask, vocab)
        _process_row(logits[i], row, grammar)
        if bool(torch.isneginf(logits[i]).all()):  # nothing left: only the grammar's rule
            logits[i] = raw if grammar is None else raw.masked_fill(~grammar, _NEG_INF)


def _ids(ids: list[int] | tuple[int, ...], vocab: int) -> list[int]:
    return [t for t in ids if 0 <= t < vocab]


def _process_row(x: torch.Tensor, row: SampleRow, grammar: torch.Tensor | None) -> None:
    p = row.params
    vocab = x.shape[0]
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[_ids(p.allowed_token_ids, vocab)] = True
        x.masked_fill_(~keep, _NEG_INF)
    if row.suppress:
        x[_ids(row.suppress, vocab)] = _NEG_INF
    if p.logit_bias:
        items = [(t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab]
        banned = [t for t, b in items if b <= _BAN]
        added = [(t, b) for t, b in items if b > _BAN]
        if added:
            ids = torch.tensor([t for t, _ in added], dtype=torch.long)
            x[ids] += torch.tensor([b for _, b in added], dtype=x.dtype)
        if banned:
            x[banned] = _NEG_INF
    if grammar is not None:
        x.masked_fill_(~grammar, _NEG_INF)
    if p.presence_penalty or p.frequency_penalty:
        out = torch.tensor(_ids(row.output_ids or [], vocab), dtype=torch.long)
        if out.numel():
            counts = torch.bincount(out, minlength=vocab).to(x.dtype)
            x -= counts * p.frequency_penalty + (counts > 0).to(x.dtype) * p.presence_penalty
    if p.repetition_penalty != 1.0:
        seen = _ids([*(row.prompt_ids or []), *(row.output_ids or [])], vocab)
        if seen:
            ids = torch.tensor(sorted(set(seen)), dtype=torch.long)
            v = x[ids]
            x[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
