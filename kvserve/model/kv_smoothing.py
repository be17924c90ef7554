"""K smoothing for 8-bit KV caches: store each key less its layer's mean key.

A real model's keys carry large offsets in a few channels (after RoPE, in the slowly
rotating ones), shared by every token. With per-token scales those channels set the scale
of every vector, and the other channels get few of the 8 bits. Attention does not need
them: a query's scores ``q · k_j`` all move by the same ``q · μ`` when every key moves by
``μ``, and softmax ignores a shift common to all of a query's scores, sliding window and
sinks included. So an int8 or token-scale fp8 cache stores ``k - μ`` (``QuantizedKVCache
.set_k_shift``), the attention kernels read it as they read any key, and nothing adds
``μ`` back (V is stored as it is: its mean would not cancel).

``μ`` (per layer, ``[KV heads, head_dim]`` float32) is the mean post-RoPE key of the
model over a fixed text shipped with kvserve (``calibration.txt``), computed at start by
one forward pass into a scratch 16-bit cache (``key_means``): the same on every node
with the same model, kvserve and device type. Blocks written under another ``μ`` are
foreign: the KV store's block format carries a digest of it (``worker/offload.py``).

On SmolLM2-135M-Instruct (benchmarks/history/notebook.md, ninth round) it cut the mean
per-token change of log-likelihood against a bf16 cache by 12 % for int8 and for fp8_e4m3.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.model.attention import AttentionMetadata, PrefillChunk
from kvserve.model.tokenizer import Tokenizer

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
_WINDOW = 512  # tokens per calibration sequence (at most max_model_len)
_FALLBACK_TOKENS = 1024  # a model without a tokenizer: this many seeded random ids


def calibration_ids(tokenizer: Tokenizer | None, vocab_size: int) -> tuple[int, ...]:
    """The calibration text's token ids, or (no tokenizer) seeded random ids below
    ``vocab_size``: the same for every engine of a model."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))
        if len(ids) >= 2:
            return tuple(ids)
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, vocab_size, (_FALLBACK_TOKENS,), generator=gen).tolist())


def key_means(
    model: torch.nn.Module,
    ids: tuple[int, ...],
    block_size: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int,
    head_dim: int,
) -> list[torch.Tensor]:
    """Per layer, the mean key ``[num_kv_heads, head_dim]`` float32 of ``ids`` run as
    sequences of up to 512 tokens (``max_model_len`` if less) in one forward pass of
    ``model`` (a ``LlamaForCausalLM``: under tensor parallelism every rank must call this
    together, a collective). Writes nothing but a scratch cache, freed on return."""
    window = max(2, min(_WINDOW, max_model_len))
    seqs = [ids[i : i + window] for i in range(0, len(ids), window)]
    seqs = [s for s in seqs if len(s) >= 2] or [ids[:window]]
    blocks = [-(-len(s) // block_size) for s in seqs]
    n = sum(len(s) for s in seqs)
    layers = len(model.layers)
    scratch = torch.zeros(
        layers, 2, sum(blocks) * block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.long)
    slots, positions, starts, chunks = [], [], [0], []
    first = 0
    for i, (s, nb) in enumerate(zip(seqs, blocks, strict=True)):
        tables[i, :nb] = torch.arange(first, first + nb)
        slots += range(first * block_size, first * block_size + len(s))
        positions += range(len(s))
        chunks.append(PrefillChunk(starts[-1], starts[-1] + len(s), len(s), None, None))
        starts.append(starts[-1] + len(s))
        first += nb
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        max_position=max(positions),
        prefills=chunks,
        seq_block_tables=tables.to(device),
        seq_lens=torch.tensor([len(s) for s in seqs], device=device),
        query_start=torch.tensor(starts, device=device),
    )
    flat = torch.tensor([t for s in seqs for t in s], device=device)
    with torch.inference_mode():
        model(flat, torch.tensor(positions, device=device), list(scratch.unbind(0)), meta)
    idx = meta.slot_mapping
    means = [scratch[i, 0].index_select(0, idx).float().sum(0) / n for i in range(layers)]
    del scratch
    return [m.contiguous() for m in means]
