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

import numpy as np
import torch

from kvserve.sampling.params import SampleRow

_NEG_INF = float("-inf")
_BAN = -100.0  # a logit_bias at or below this bans the token, as OpenAI documents


def unpack_bitmask(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 bitmasks ``[R, W]`` (or one ``[W]``) → bool ``[R, vocab]`` (``[vocab]``),
    True = allowed; tokens past the masks' last word are forbidden."""
    packed = masks.to(torch.int32).contiguous().numpy()
    bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[-1] < vocab:
        pad = [(0, 0)] * (bits.ndim - 1) + [(0, vocab - bits.shape[-1])]
        bits = np.pad(bits, pad)
    return torch.from_numpy(np.ascontiguousarray(bits[..., :vocab]).view(np.bool_))


def _may_empty(row: SampleRow) -> bool:
    """Can this row's processors forbid every token? Only a grammar mask together with
    other bans can (allowed ids are in the vocabulary; penalties never forbid)."""
    p = row.params
    banned = bool(p.logit_bias) and min(p.logit_bias.values()) <= _BAN
    return row.mask is not None and bool(row.suppress or p.allowed_token_ids or banned)


def needs_processing(row: SampleRow) -> bool:
    """Whether ``row``'s logits change before sampling, grammar masks aside."""
    p = row.params
    return bool(
        row.suppress or p.allowed_token_ids is not None or p.logit_bias or p.penalized
    )


def process_logits(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Apply every row's processors to ``logits`` ``[len(rows), vocab]`` in place."""
    vocab = logits.shape[1]
    guided = [i for i, r in enumerate(rows) if r.mask is not None]
    fragile = [i for i in guided if _may_empty(rows[i])]
    raw = logits[fragile].clone() if fragile else None
    for i, row in enumerate(rows):
        if needs_processing(row):
            _process_row(logits[i], row)
    if guided:  # every grammar mask at once: one unpack, one fill
        allowed = unpack_bitmask(torch.stack([rows[i].mask for i in guided]), vocab)
        idx = torch.tensor(guided, dtype=torch.long)
        logits[idx] = logits[idx].masked_fill_(~allowed, _NEG_INF)
    if raw is not None:  # nothing left: only the grammar's rule
        dead = (logits[fragile].amax(dim=1) == _NEG_INF).tolist()
        for k, i in enumerate(fragile):
            if dead[k]:
                keep = unpack_bitmask(rows[i].mask, vocab)  # type: ignore[arg-type]
                logits[i] = raw[k].masked_fill(~keep, _NEG_INF)


def _ids(ids: list[int] | tuple[int, ...], vocab: int) -> list[int]:
    return [t for t in ids if 0 <= t < vocab]


def _process_row(x: torch.Tensor, row: SampleRow) -> None:
    """Everything but the grammar mask, in ``SamplingParams``' order (the mask forbids
    and the penalties only lower or scale: applying the mask after them is the same)."""
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
