"""Attention over the paged KV cache, behind a small backend interface.

The model code calls ``backend.forward(q, k, v, kv_cache, meta)`` and knows nothing about
blocks. ``AttentionMetadata`` is built once per engine step by the model runner and shared
by all layers. Token order in a batch: all decode tokens first (one per sequence), then the
prefill chunks, each contiguous.

Cache layout per layer: ``kv_cache[0]`` (keys) and ``kv_cache[1]`` (values), each
``[num_slots, num_kv_heads, head_dim]`` where slot = block_id * block_size + offset; or a
``QuantizedKVCache`` (int8/fp8 with scales) that quantizes on write and dequantizes on read.
With a quantized cache even a first prefill chunk attends to the stored (quantized) K/V, so
a token's logits do not depend on whether its context was prefilled or decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve.model.kv_cache import rows_per_block
from kvserve.model.kv_quant import QuantizedKVCache

KVCache = torch.Tensor | QuantizedKVCache  # one layer's cache


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens in a step.

    ``start``/``end`` index the batch's token dimension; ``context_len`` is the sequence
    length after this chunk (cached tokens + new). ``block_table`` lists the blocks holding
    all ``context_len`` tokens, or is None when the chunk is the whole sequence so far
    (then the chunk's own K/V are used directly). ``mask`` ``[1, 1, new, keys]`` is None
    for plain causal attention.
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Per-step description of where each token's K/V goes and what it attends to."""

    slot_mapping: torch.Tensor
    max_position: int = 0  # largest position in the batch (sizes the rope tables)
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], 0-padded
    decode_lens: torch.Tensor | None = None  # [num_decodes] context length incl. new token
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)  # SDPA backend only
    # every sequence of the step (decodes, then prefill chunks), for the paged kernel:
    seq_block_tables: torch.Tensor | None = None  # [seqs, max_blocks], 0-padded
    seq_lens: torch.Tensor | None = None  # [seqs] context length after this step
    query_start: torch.Tensor | None = None  # [seqs + 1] first token row of each sequence
    # masks a backend with its own window built for this step (TorchPagedAttention.for_window)
    window_masks: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    # the hybrid KV layout (model/kv_groups.py): groups 1, 2, …'s metadata, over their own block
    # tables (this object is group 0's); empty when every layer shares one table
    groups: list[AttentionMetadata] = field(default_factory=list)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of the layers of KV group ``group`` (this one when uniform)."""
        return self if group == 0 or not self.groups else self.groups[group - 1]


def kv_tensors(
    kv_cache: KVCache,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A layer's K/V storage (``[2, …]``) and its K and V scales (None for a 16/32-bit
    cache; ``[slots, H]`` float16 per token, ``[slots / 16, H, 16]`` tiled, or ``[H]``
    float32 per head), as the paged kernels take them."""
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.data, kv_cache.scale[0], kv_cache.scale[1]
    return kv_cache, None, None


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sinks: int = 0
) -> torch.Tensor:
    """Which key positions each query position attends to (broadcast ``q_pos`` ``[q, 1]``
    against ``k_pos`` ``[1, k]``): causal, and with a ``window`` only the last ``window``
    positions up to the query plus the first ``sinks``. The one rule of every dense mask."""
    mask = k_pos <= q_pos
    if window:
        mask &= (k_pos > q_pos - window) | (k_pos < sinks)
    return mask


class AttentionBackend(Protocol):
    """Writes new K/V into the cache and returns attention output ``[tokens, heads, dim]``.

    ``for_window(w)`` is the same backend for a layer of its own window (a hybrid model's
    sliding or global layer: ``w`` tokens, 0 for the whole context, no sinks).
    """

    def for_window(self, window: int) -> AttentionBackend: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        softcap: float = 0.0,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the step's K/V ``[tokens, kv_heads, dim]`` into ``kv_cache`` and return
        the attention output of ``q`` ``[tokens, heads, dim]``; scores are ``q·k * scale``,
        soft-capped to ``softcap * tanh(score / softcap)`` when ``softcap`` > 0.
        ``sink_logits`` (float32 ``[heads]``, gpt-oss) adds one softmax column per head
        holding that logit, whose weight is dropped (a row's weights sum to less than 1).
        """
        ...


class TorchPagedAttention:
    """Portable backend (CPU and CUDA) built on ``scaled_dot_product_attention``.

    Not batch-invariant: SDPA's reduction order depends on the shapes of the call.

    Decodes are batched: their context is gathered from the cache block by block
    (``index_select`` of whole blocks, several times faster on CPU than gathering
    tokens) into a padded tensor with a validity mask. Prefill chunks run one sequence at
    a time.
    """

    dense_masks = True  # reads ``decode_mask`` and ``PrefillChunk.mask``
    tiled = False  # reads caches of rows only (model/kv_cache.py)

    def __init__(self, block_size: int, own_window: int | None = None):
        self.block_size = block_size
        # a layer's own window (for_window): its masks are built here, not read from meta
        self.own_window = own_window

    def for_window(self, window: int) -> TorchPagedAttention:
        return TorchPagedAttention(self.block_size, window)

    def _own_masks(self, meta: AttentionMetadata) -> list[torch.Tensor | None]:
        """This layer's masks for ``meta``: the decodes' then each prefill chunk's, built
        once per step and window (kept in ``meta.window_masks``)."""
        w = self.own_window or 0
        if w not in meta.window_masks:
            masks: list[torch.Tensor | None] = []
            if meta.num_decodes:
                assert meta.decode_block_tables is not None and meta.decode_lens is not None
                width = meta.decode_block_tables.shape[1] * self.block_size
                pos = torch.arange(width, device=meta.decode_lens.device).unsqueeze(0)
                mask = visible(meta.decode_lens.unsqueeze(1) - 1, pos, w)
                masks.append(mask.view(-1, 1, 1, width))
            for p in meta.prefills:
                n = p.end - p.start
                q_pos = torch.arange(p.context_len - n, p.context_len).unsqueeze(1)
                mask = visible(q_pos, torch.arange(p.context_len).unsqueeze(0), w)
                masks.append(mask.view(1, 1, n, p.context_len).to(meta.slot_mapping.device))
            meta.window_masks[w] = masks
        return meta.window_masks[w]

    @staticmethod
    def write(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> None:
        """Store the step's new K/V ``[tokens, kv_heads, dim]`` at ``meta.slot_mapping``."""
        if isinstance(kv_cache, QuantizedKVCache):
            kv_cache.write(meta.slot_mapping, k, v)
        else:
            kv_cache[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
            kv_cache[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    def _context(
        self, kv_cache: KVCache, which: int, tables: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``[B, Hkv, nb * block_size, D]`` context (K if ``which`` is 0, else V) of each
        row's blocks, dequantized to ``dtype``."""
        if isinstance(kv_cache, QuantizedKVCache):
            return kv_cache.gather_blocks(which, tables, self.block_size, dtype)
        cache = kv_cache[which]
        _, h, d = cache.shape
        blocks = cache.view(-1, self.block_size, h, d).index_select(0, tables.flatten())
        return blocks.view(tables.shape[0], -1, h, d).transpose(1, 2).to(dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        softcap: float = 0.0,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        quantized = isinstance(kv_cache, QuantizedKVCache)
        self.write(k, v, kv_cache, meta)
        if not meta.prefills:  # pure decode step: no output buffer to assemble
            return self.decode(q, kv_cache, meta, scale, softcap, sink_logits)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self.decode(
                q[: meta.num_decodes], kv_cache, meta, scale, softcap, sink_logits
            )
        own = None
        if self.own_window is not None:  # the prefill chunks' masks follow the decodes'
            own = self._own_masks(meta)[1 if meta.num_decodes else 0 :]
        for i, p in enumerate(meta.prefills):
            mask = p.mask if own is None else own[i]
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.block_table is not None:
                n = p.context_len
                kp = self._context(kv_cache, 0, p.block_table.unsqueeze(0), q.dtype)[:, :, :n]
                vp = self._context(kv_cache, 1, p.block_table.unsqueeze(0), q.dtype)[:, :, :n]
            elif quantized:  # read back what was stored, so prefill sees what decode sees
                slots = meta.slot_mapping[p.start : p.end]
                kp = kv_cache.read_slots(0, slots, q.dtype).transpose(0, 1).unsqueeze(0)
                vp = kv_cache.read_slots(1, slots, q.dtype).transpose(0, 1).unsqueeze(0)
            else:
                kp = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vp = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            o = _sdpa(qp, kp, vp, mask, mask is None, scale, softcap, sink_logits)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        return out

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        softcap: float = 0.0,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one new token per sequence, ``q`` ``[B, Hq, D]`` → ``[B, Hq, D]``."""
        tables = meta.decode_block_tables
        kd = self._context(kv_cache, 0, tables, q.dtype)
        vd = self._context(kv_cache, 1, tables, q.dtype)
        mask = self._own_masks(meta)[0] if self.own_window is not None else meta.decode_mask
        sdpa = _sdpa(q.unsqueeze(2), kd, vd, mask, False, scale, softcap, sink_logits)
        return sdpa.squeeze(2)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``q`` ``[B, Hq, L, D]`` over ``k``/``v``
    ``[B, Hkv, S, D]`` (GQA): ``mask`` boolean (True: visible), or else causal (L = S) when
    ``causal``, everything visible when not. With
    ``softcap`` > 0, which SDPA has no argument for, the scores are soft-capped in float32
    before the mask and the softmax, as transformers' eager attention computes them; with
    ``sink_logits`` ``[Hq]`` the softmax has one more column per head, that logit, whose
    weight is dropped (gpt-oss, as transformers computes it)."""
    if softcap <= 0 and sink_logits is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if mask is None and causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sink_logits is None:
        return torch.matmul(torch.softmax(s, dim=-1), vf).to(q.dtype)
    sink = sink_logits.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, vf).to(q.dtype)


def _heads_dense(*xs: torch.Tensor) -> bool:
    """True when every ``[T, H, D]`` tensor has contiguous heads (its rows may be strided)."""
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in xs)


CPU_KERNEL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # instantiated in paged_attention.cpp


class CpuPagedAttention(TorchPagedAttention):
    """Every token of a step, decode or prefill, through one call of the C++ kernel that
    reads K/V in place from the blocks (no gathered copy, no mask); 16/32-bit, int8 and
    fp8 caches (scales applied in registers).

    Batch-invariant by construction: a row's output depends only on its query, its
    context's K/V and its position, never on the other rows of the step, on how its prompt
    was chunked or on whether its context came from the prefix cache (the kernel's
    determinism rule, ``csrc/paged_attention.cpp``). Needs ``seq_block_tables``,
    ``seq_lens`` and ``query_start`` in the metadata. Construct only after
    ``load_cpu_kernels()`` returned True, for a head dim in ``CPU_KERNEL_HEAD_DIMS``.
    ``tiled``: the engine allocates caches in the tiled layout (``model/kv_cache.py``: bf16, or
    8-bit codes with per-token scales), which the kernel reads without re-laying out a
    cell's K and V on every step; either layout is written and read by shape, so the flag
    only tells the allocator.
    """

    dense_masks = False  # the model runner need not build masks for this backend

    def __init__(
        self, block_size: int, sliding_window: int | None, sinks: int = 0, tiled: bool = False
    ):
        super().__init__(block_size)
        self.window = sliding_window or 0
        self.sinks = sinks
        # caches in the tiled layout (model/kv_cache.py), read in place by the kernel
        self.tiled = tiled

    def for_window(self, window: int) -> CpuPagedAttention:
        return CpuPagedAttention(self.block_size, window or None, 0, self.tiled)

    @staticmethod
    def write(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> None:
        """As ``TorchPagedAttention.write``, in one C++ call: an int8/fp8 cache quantizes
        in the kernel, a plain one of the step's dtype is copied into (``write_kv``)."""
        if isinstance(kv_cache, QuantizedKVCache):
            kv_cache.write_cpu(meta.slot_mapping, k, v)
        elif kv_cache.dim() == 5:  # tiles: only the kernel knows their order
            if not _heads_dense(k, v):
                k, v = k.contiguous(), v.contiguous()
            torch.ops.kvserve.write_kv(k, v, meta.slot_mapping, kv_cache)
        elif k.dtype == kv_cache.dtype and kv_cache.is_contiguous() and _heads_dense(k, v):
            torch.ops.kvserve.write_kv(k, v, meta.slot_mapping, kv_cache)
        else:
            TorchPagedAttention.write(k, v, kv_cache, meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        softcap: float = 0.0,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.write(k, v, kv_cache, meta)
        assert meta.seq_block_tables is not None and meta.seq_lens is not None
        assert meta.query_start is not None
        tables, lens, starts = meta.seq_block_tables, meta.seq_lens, meta.query_start
        return self._attend(q, kv_cache, tables, lens, starts, scale, softcap, sink_logits)

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        softcap: float = 0.0,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query row per sequence (the decode fields of ``meta``), ``[B, Hq, D]``."""
        assert meta.decode_block_tables is not None and meta.decode_lens is not None
        starts = torch.arange(q.shape[0] + 1, dtype=torch.long)
        tables, lens = meta.decode_block_tables, meta.decode_lens
        return self._attend(q, kv_cache, tables, lens, starts, scale, softcap, sink_logits)

    def _attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        tables: torch.Tensor,
        lens: torch.Tensor,
        query_start: torch.Tensor,
        scale: float,
        softcap: float = 0.0,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        data, k_scale, v_scale = kv_tensors(kv_cache)
        blocks = (-1, rows_per_block(self.block_size, data.dim() == 5), *data.shape[2:])
        return torch.ops.kvserve.paged_attention(
            q,
            data[0].view(blocks),
            data[1].view(blocks),
            tables,
            lens,
            query_start,
            scale,
            self.window,
            self.sinks,
            k_scale,
            v_scale,
            softcap,
            sink_logits,
        )
