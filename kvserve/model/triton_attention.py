"""Triton paged attention: every row of a step, decode or prefill, read in place from the
KV blocks (no gathered context, no dense mask), for CUDA (and AMD) GPUs; Triton's
interpreter (``TRITON_INTERPRET=1``, set before this module is imported) runs the same
kernels on CPU tensors, which is how the tests check them.

Cache layout: rows (``model/kv_cache.py``): K and V each ``[slots, kv_heads, head_dim]``, slot =
block id * block_size + offset; 16/32-bit, or int8/fp8 codes with per-token scales
``[slots, kv_heads]`` float16 or per-head scales ``[kv_heads]`` float32.

**The determinism rule** (the CPU kernels' rule, ``csrc/paged_attention.cpp``): a row's
output depends only on its query, its context's K/V and its position, never on the other
rows of the step or how its prompt was chunked. So:

- A program takes rows of one sequence: a few tokens × the query heads of one KV head
  (``tile_shape``: fixed by the model's head grouping, whatever the batch), so K/V are
  read once for the group. Rows are independent in every operation; keys a row does
  not see contribute an exact zero (scores -inf, the running max starts finite).
- Keys are visited in ``BLOCK_N``-aligned tiles in position order, grouped in splits of
  ``SPLIT`` positions fixed by position. Each split's softmax state is computed from
  scratch and merged into the row's result in split order (``_merge``). The one-program
  kernel merges as it goes; the split-KV kernel (decode-only steps with long contexts)
  computes splits in parallel programs and ``_merge_kernel`` merges them in the same
  order with the same arithmetic, so both give a row the same bits.
- Floating-point fusion is off (``enable_fp_fusion=False``): the same expression
  compiles to the same roundings in every kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.model.triton_mode import interpreting

BLOCK_M = 16  # rows per program at least (tokens × a KV head's query heads); fixed
BLOCK_N = 32  # keys per tile
SPLIT = 512  # key positions per split, fixed by position (a multiple of BLOCK_N)
# Triton's interpreter multiplies bf16 dot operands wrongly (3.9: as raw bits) and converts
# int8 to bf16 wrongly, so when interpreting, values go through float32 and dot operands
# are widened to float32: exact for bf16 and fp16 values, and
# the products and float32 accumulation are the same as a bf16 dot's.
_WIDEN = tl.constexpr(interpreting())
# the running max's start: finite, so a tile a row does not see is an exact no-op for it
_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq(query_start, num_seqs, pid, BM: tl.constexpr):
    """The sequence whose tiles hold program ``pid``: tiles of sequence s are numbered
    from ``query_start[s] // BM + s`` (an upper bound of the tiles before it)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start + mid).to(tl.int32) // BM + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _merge(m_run, l_run, acc_run, m, den, acc):
    """One split's softmax state merged into the running one (both may be empty)."""
    m_new = tl.maximum(m_run, m)
    a = tl.exp(m_run - m_new)
    b = tl.exp(m - m_new)
    return m_new, l_run * a + den * b, acc_run * a[:, None] + acc * b[:, None]


@triton.jit
def _with_sinks(m_run, l_run, acc_run, SL, heads, row_ok, BM: tl.constexpr, DP: tl.constexpr):
    """The rows' state merged with their heads' sink logits (gpt-oss): one more softmax
    column of weight ``exp(sink)`` and no value."""
    sink = tl.load(SL + heads, mask=row_ok, other=_NEG).to(tl.float32)
    one = tl.full([BM], 1.0, tl.float32)
    return _merge(m_run, l_run, acc_run, sink, one, tl.zeros([BM, DP], tl.float32))


@triton.jit
def _key_tiles(q, pos, row_ok, m, den, acc, lo, hi, table, ctx_len, K, V, KS, VS,
               kvh, sk_slot, sk_head, ss_slot, window, sinks, scale, softcap,
               PAGE: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
               SCALES: tl.constexpr, WINDOW: tl.constexpr):  # fmt: skip
    """The keys of tiles ``[lo, hi)`` (BN-aligned positions) folded into (m, den, acc)."""
    d = tl.arange(0, DP)
    for start in range(lo, hi, BN):
        kpos = start + tl.arange(0, BN)
        k_ok = kpos < ctx_len
        page = tl.load(table + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
        slot = page * PAGE + kpos % PAGE
        off = slot[:, None] * sk_slot + kvh * sk_head + d[None, :]
        ld = k_ok[:, None] & (d[None, :] < D)
        k = tl.load(K + off, mask=ld, other=0.0)
        v = tl.load(V + off, mask=ld, other=0.0)
        # 8-bit codes are exact in the query's type; the scales multiply the scores (K)
        # and the weights (V) in float32, so only the weights are rounded, as for bf16
        ks = scale
        vs = 1.0
        if SCALES == 1:  # per (token, head)
            ks = scale * tl.load(KS + slot * ss_slot + kvh, mask=k_ok, other=0.0).to(tl.float32)
            vs = tl.load(VS + slot * ss_slot + kvh, mask=k_ok, other=0.0).to(tl.float32)
        elif SCALES == 2:  # per head
            ks = scale * tl.load(KS + kvh)
            vs = tl.load(VS + kvh)
        if _WIDEN:  # (the interpreter also converts int8 to bf16 wrongly: via float32)
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if _WIDEN:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        elif q.dtype == tl.float32:  # float32 models: full products, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SCALES == 1:  # noqa: SIM108 - a constexpr branch: only one is compiled
            s = s * ks[None, :]
        else:
            s = s * ks
        if softcap > 0:  # soft-capping (Gemma 2): cap · tanh(s / cap), as the CPU kernel
            x = tl.minimum(tl.maximum(s / softcap, -9.0), 9.0)
            e = tl.exp(x + x)
            s = softcap * ((e - 1.0) / (e + 1.0))
        vis = (kpos[None, :] <= pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if WINDOW:
            vis = vis & ((kpos[None, :] > pos[:, None] - window) | (kpos[None, :] < sinks))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        if SCALES == 1:
            p = p * vs[None, :]
        elif SCALES == 2:
            p = p * vs
        p = p.to(v.dtype)
        if _WIDEN:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32))
        elif v.dtype == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    return m, den, acc


@triton.jit
def _split_state(q, pos, row_ok, pos_min, pos_max, split, table, K, V, KS, VS, kvh,
                 sk_slot, sk_head, ss_slot, window, sinks, scale, softcap,
                 PAGE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, SPL: tl.constexpr, SCALES: tl.constexpr,
                 WINDOW: tl.constexpr):  # fmt: skip
    """Split ``split``'s softmax state (from scratch) for a tile's rows: its sink tiles,
    then the tiles of the tile's window (every tile up to the last row's position)."""
    m = tl.full([BM], _NEG, tl.float32)
    den = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    lo = split * SPL
    ctx_len = pos_max + 1  # keys past the tile's last row are never visible
    hi = tl.minimum(lo + SPL, ctx_len)
    hi = (hi + BN - 1) // BN * BN
    if WINDOW:
        sink_hi = tl.minimum((sinks + BN - 1) // BN * BN, hi)
        m, den, acc = _key_tiles(q, pos, row_ok, m, den, acc, lo, sink_hi, table, ctx_len, K, V,
                               KS, VS, kvh, sk_slot, sk_head, ss_slot, window, sinks, scale,
                               softcap, PAGE, BN, D, DP, SCALES, WINDOW)  # fmt: skip
        first = tl.maximum(pos_min - window + 1, 0) // BN * BN
        lo = tl.maximum(tl.maximum(lo, sink_hi), first)
    m, den, acc = _key_tiles(q, pos, row_ok, m, den, acc, lo, hi, table, ctx_len, K, V, KS, VS,
                           kvh, sk_slot, sk_head, ss_slot, window, sinks, scale, softcap,
                           PAGE, BN, D, DP, SCALES, WINDOW)  # fmt: skip
    return m, den, acc


@triton.jit
def _tile(query_start, seq_lens, num_seqs, pid, kvh, BQ: tl.constexpr, GP: tl.constexpr,
          GROUP: tl.constexpr):  # fmt: skip
    """A program's sequence and rows: ``BQ`` tokens × the ``GP`` query heads of KV head
    ``kvh`` (``GROUP`` real ones). Returns (seq, each row's token and head, positions,
    row mask, the first and last token's positions, whether the program has rows)."""
    seq = _find_seq(query_start, num_seqs, pid, BQ)
    q0 = tl.load(query_start + seq).to(tl.int32)
    q1 = tl.load(query_start + seq + 1).to(tl.int32)
    tok0 = q0 + (pid - (q0 // BQ + seq)) * BQ
    r = tl.arange(0, BQ * GP)
    toks = tok0 + r // GP
    g = r % GP
    row_ok = (toks < q1) & (g < GROUP)
    ctx_len = tl.load(seq_lens + seq).to(tl.int32)
    pos = ctx_len - (q1 - toks)
    pos_max = ctx_len - (q1 - tl.minimum(tok0 + BQ, q1)) - 1
    return seq, toks, kvh * GROUP + g, pos, row_ok, ctx_len - (q1 - tok0), pos_max, tok0 < q1


@triton.jit
def _attention_kernel(Q, K, V, KS, VS, SL, Out, tables, query_start, seq_lens, num_seqs,
                      sq_row, sq_head, so_row, so_head, st_row, sk_slot, sk_head, ss_slot,
                      window, sinks, scale, softcap, GROUP: tl.constexpr, PAGE: tl.constexpr,
                      BM: tl.constexpr, BQ: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr,
                      D: tl.constexpr, DP: tl.constexpr, SPL: tl.constexpr, SCALES: tl.constexpr,
                      WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):  # fmt: skip
    """One program: ``BQ`` tokens of one sequence × the query heads of one KV head (K/V
    read once for the group), every split merged."""
    kvh = tl.program_id(1)
    seq, toks, heads, pos, row_ok, pos_min, pos_max, live = _tile(
        query_start, seq_lens, num_seqs, tl.program_id(0), kvh, BQ, GP, GROUP
    )
    if live:
        d = tl.arange(0, DP)
        q_off = toks[:, None] * sq_row + heads[:, None] * sq_head + d[None, :]
        q_mask = row_ok[:, None] & (d[None, :] < D)
        q = tl.load(Q + q_off, mask=q_mask, other=0.0)
        m_run = tl.full([BM], _NEG, tl.float32)
        l_run = tl.zeros([BM], tl.float32)
        acc_run = tl.zeros([BM, DP], tl.float32)
        for split in range(0, pos_max // SPL + 1):
            m, den, acc = _split_state(q, pos, row_ok, pos_min, pos_max, split,
                                     tables + seq * st_row, K, V, KS, VS, kvh,
                                     sk_slot, sk_head, ss_slot, window, sinks, scale, softcap, PAGE,
                                     BM, BN, D, DP, SPL, SCALES, WINDOW)  # fmt: skip
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m, den, acc)
        if HAS_SINK:
            m_run, l_run, acc_run = _with_sinks(m_run, l_run, acc_run, SL, heads, row_ok, BM, DP)
        out = acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None]
        o_off = toks[:, None] * so_row + heads[:, None] * so_head + d[None, :]
        tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=q_mask)


@triton.jit
def _split_kernel(Q, K, V, KS, VS, PM, PL, PACC, tables, query_start, seq_lens, num_seqs,
                  sq_row, sq_head, st_row, sk_slot, sk_head, ss_slot, window, sinks, scale, softcap,
                  GROUP: tl.constexpr, PAGE: tl.constexpr, BM: tl.constexpr,
                  BQ: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, SPL: tl.constexpr, NSPLIT: tl.constexpr,
                  SCALES: tl.constexpr, WINDOW: tl.constexpr):  # fmt: skip
    """One split of one tile and KV head: its state into the partial buffers
    (``PM``/``PL`` ``[tokens, heads, NSPLIT]``, ``PACC`` ``[tokens, heads, NSPLIT, DP]``)."""
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq, toks, heads, pos, row_ok, pos_min, pos_max, live = _tile(
        query_start, seq_lens, num_seqs, tl.program_id(0), kvh, BQ, GP, GROUP
    )
    if live and split * SPL <= pos_max:
        d = tl.arange(0, DP)
        q_mask = row_ok[:, None] & (d[None, :] < D)
        q_off = toks[:, None] * sq_row + heads[:, None] * sq_head + d[None, :]
        q = tl.load(Q + q_off, mask=q_mask, other=0.0)
        m, den, acc = _split_state(q, pos, row_ok, pos_min, pos_max, split,
                                 tables + seq * st_row, K, V, KS, VS, kvh,
                                 sk_slot, sk_head, ss_slot, window, sinks, scale, softcap, PAGE,
                                 BM, BN, D, DP, SPL, SCALES, WINDOW)  # fmt: skip
        state = (toks * (tl.num_programs(1) * GROUP) + heads) * NSPLIT + split
        tl.store(PM + state, m, mask=row_ok)
        tl.store(PL + state, den, mask=row_ok)
        tl.store(PACC + state[:, None] * DP + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_kernel(PM, PL, PACC, SL, Out, seq_lens, query_start, num_seqs, so_row, so_head,
                  GROUP: tl.constexpr, BM: tl.constexpr, BQ: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, DP: tl.constexpr, SPL: tl.constexpr,
                  NSPLIT: tl.constexpr, HAS_SINK: tl.constexpr):  # fmt: skip
    """A tile's splits merged in split order, as ``_attention_kernel`` merges them."""
    kvh = tl.program_id(1)
    _, toks, heads, _, row_ok, _, pos_max, live = _tile(
        query_start, seq_lens, num_seqs, tl.program_id(0), kvh, BQ, GP, GROUP
    )
    if live:
        d = tl.arange(0, DP)
        m_run = tl.full([BM], _NEG, tl.float32)
        l_run = tl.zeros([BM], tl.float32)
        acc_run = tl.zeros([BM, DP], tl.float32)
        for split in range(0, pos_max // SPL + 1):
            state = (toks * (tl.num_programs(1) * GROUP) + heads) * NSPLIT + split
            m = tl.load(PM + state, mask=row_ok, other=_NEG)
            den = tl.load(PL + state, mask=row_ok, other=0.0)
            acc = tl.load(PACC + state[:, None] * DP + d[None, :], mask=row_ok[:, None],
                          other=0.0)  # fmt: skip
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m, den, acc)
        if HAS_SINK:
            m_run, l_run, acc_run = _with_sinks(m_run, l_run, acc_run, SL, heads, row_ok, BM, DP)
        out = acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None]
        o_mask = row_ok[:, None] & (d[None, :] < D)
        o_off = toks[:, None] * so_row + heads[:, None] * so_head + d[None, :]
        tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=o_mask)


def tile_shape(group: int) -> tuple[int, int, int]:
    """(rows, tokens, padded heads) of a program for ``group`` query heads per KV head:
    the heads padded to a power of two, tokens filling at least ``BLOCK_M`` rows. Fixed
    per model, never by the batch."""
    gp = triton.next_power_of_2(group)
    bm = max(BLOCK_M, gp)
    return bm, bm // gp, gp


def _scale_kind(k_scale: torch.Tensor | None) -> int:
    """0: a 16/32-bit cache; 1: per-token scales ``[slots, H]``; 2: per-head ``[H]``."""
    if k_scale is None:
        return 0
    return 1 if k_scale.dim() == 2 else 2


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_size: int = 16,
    max_context: int | None = None,
    split_kv: bool | None = None,
    softcap: float = 0.0,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``[T, Hq, D]`` of ``q`` ``[T, Hq, D]`` (sequence after sequence,
    rows of sequence s from ``query_start[s]``, its context ``seq_lens[s]`` tokens
    including the rows, the rows being its last ones) over K/V ``[slots, Hkv, D]`` at the
    slots ``tables[s]`` names (``block_size`` slots per block). ``window`` > 0: each row
    sees its last ``window`` positions and the first ``sinks``. ``max_context`` (the
    longest ``seq_lens``; read from the device when None) sizes the split-KV grid;
    ``split_kv`` None takes the split-KV kernels for a decode-only step of more than one
    split. Either way a row gets the same bits (the module's determinism rule).
    ``softcap`` > 0 soft-caps the scaled scores, ``cap * tanh(score / cap)`` (Gemma 2).
    ``sink_logits`` (float32 ``[Hq]``, gpt-oss): one more softmax column per head holding
    that logit, whose weight is dropped; merged after every split, in either kernel."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    seqs = seq_lens.shape[0]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if max_context is None:
        max_context = int(seq_lens.max())
    kind = _scale_kind(k_scale)
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    dp = max(16, triton.next_power_of_2(d))
    nsplit = triton.cdiv(max_context, SPLIT)
    if split_kv is None:
        split_kv = t == seqs and nsplit > 1
    group = hq // hkv
    bm, bq, gp = tile_shape(group)
    grid_m = triton.cdiv(t, bq) + seqs
    common = dict(
        GROUP=group, PAGE=block_size, BM=bm, BQ=bq, GP=gp, BN=BLOCK_N, D=d, DP=dp, SPL=SPLIT,
        SCALES=kind, WINDOW=window > 0, enable_fp_fusion=False,
    )  # fmt: skip
    geometry = (
        tables, query_start, seq_lens, seqs, q.stride(0), q.stride(1),
    )  # fmt: skip
    ss_slot = k_scale.stride(0) if k_scale is not None and kind == 1 else 0
    sl = sink_logits if sink_logits is not None else out  # not read without HAS_SINK
    cache = (tables.stride(0), k_cache.stride(0), k_cache.stride(1), ss_slot)
    if not split_kv:
        _attention_kernel[(grid_m, hkv)](
            q, k_cache, v_cache, ks, vs, sl, out, *geometry[:4], q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), *cache, window, sinks, scale, softcap,
            HAS_SINK=sink_logits is not None, **common,
        )  # fmt: skip
        return out
    pm = torch.empty((t, hq, nsplit), dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pacc = torch.empty((t, hq, nsplit, dp), dtype=torch.float32, device=q.device)
    _split_kernel[(grid_m, hkv, nsplit)](
        q, k_cache, v_cache, ks, vs, pm, pl, pacc, *geometry, *cache, window, sinks, scale, softcap,
        NSPLIT=nsplit, **common,
    )  # fmt: skip
    _merge_kernel[(grid_m, hkv)](
        pm, pl, pacc, sl, out, seq_lens, query_start, seqs, out.stride(0), out.stride(1),
        GROUP=group, BM=bm, BQ=bq, GP=gp, D=d, DP=dp, SPL=SPLIT, NSPLIT=nsplit,
        HAS_SINK=sink_logits is not None, enable_fp_fusion=False,
    )  # fmt: skip
    return out
