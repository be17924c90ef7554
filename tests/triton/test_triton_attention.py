"""The Triton paged-attention kernels (under Triton's interpreter without a GPU): correct
against a float32 reference for block tables with holes and shared blocks, GQA, windows
with sinks, 8-bit caches and mixed decode/prefill batches; and batch-invariant bit for
bit — a row alone (a decode token), in a chunk of a chunked prefill, beside other
sequences, or through the split-KV kernels gives the same bits."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_reference, paged_batch, quantized_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model import triton_attention as ta

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attend(q, k, v, tables, lens, starts, window, sinks, scale, bs, scales=(None, None), **kw):
    """The kernel over blocks ``[nb, bs, H, D]`` (viewed as slots)."""
    k = k.reshape(-1, *k.shape[2:])
    v = v.reshape(-1, *v.shape[2:])
    args = (q, k, v, tables, lens, starts)
    return ta.paged_attention(
        *(a.to(DEV) for a in args), scale, window, sinks,
        *(s if s is None else s.to(DEV) for s in scales), block_size=bs, **kw,
    ).cpu()  # fmt: skip


def _one(q, k, v, table, ctx, rows, window, sinks, scale, bs, **kw):
    """``rows`` query rows, the last of a context of ``ctx``, alone in the step."""
    lens, starts = torch.tensor([ctx]), torch.tensor([0, rows])
    return _attend(q, k, v, table, lens, starts, window, sinks, scale, bs, **kw)


@settings(max_examples=15, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    bs=st.sampled_from([8, 16, 32]),
    heads=st.sampled_from([(4, 4), (6, 2), (3, 1)]),
    d=st.sampled_from([32, 80]),
    window=st.sampled_from([(0, 0), (7, 0), (20, 4), (33, 17)]),
    seqs=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 69)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_rows_are_correct_and_invariant(dtype, bs, heads, d, window, seqs, seed):
    dt = DTYPES[dtype]
    hq, hkv = heads
    win, sinks = window
    g = torch.Generator().manual_seed(seed)
    seqs, nb, tables, lens, starts = paged_batch(seqs, bs, g)
    tables[-1, 0] = tables[0, 0]  # a block two sequences share (a prefix-cache hit)
    k = torch.randn(nb, bs, hkv, d, generator=g).to(dt)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(dt)
    q = torch.randn(int(starts[-1]), hq, d, generator=g).to(dt)
    scale = d**-0.5
    out = _attend(q, k, v, tables, lens, starts, win, sinks, scale, bs)
    tol = 2e-5 if dt == torch.float32 else 3e-2
    for s, (ctx, n) in enumerate(seqs):
        rows = out[starts[s] : starts[s + 1]]
        qs = q[starts[s] : starts[s + 1]]
        ref = attention_reference(qs, k, v, tables[s].tolist(), ctx, n, bs, win, sinks, scale)
        assert (rows.float() - ref).abs().max().item() < tol
        table = tables[s : s + 1]
        for j in {0, n // 2, n - 1}:  # the row alone, as a decode token
            alone = _one(qs[j : j + 1], k, v, table, ctx - n + j + 1, 1, win, sinks, scale, bs)
            assert torch.equal(alone[0], rows[j]), (s, j)
        if n > 1:  # the same rows as two chunks of a chunked prefill
            cut = n // 2
            first = _one(qs[:cut], k, v, table, ctx - n + cut, cut, win, sinks, scale, bs)
            second = _one(qs[cut:], k, v, table, ctx, n - cut, win, sinks, scale, bs)
            assert torch.equal(torch.cat([first, second]), rows)


@pytest.mark.parametrize("window", [(0, 0), (700, 4)])
def test_split_kv_gives_the_one_program_bits(window):
    """Decode rows with contexts over one split (512 positions): the split-KV kernels (a
    program per split, then a merge) give the bits the one-program kernel gives, and the
    bits a prefill chunk's rows get; both are correct."""
    g = torch.Generator().manual_seed(7)
    bs, hq, hkv, d = 16, 2, 1, 32
    win, sinks = window
    ctxs = [1300, 530, 9]
    nb = sum(-(-c // bs) for c in ctxs) + 1
    k = torch.randn(nb, bs, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(torch.bfloat16)
    perm, tables, used = torch.randperm(nb, generator=g), [], 0
    for c in ctxs:
        tables.append(perm[used : used + -(-c // bs)])
        used += -(-c // bs)
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    q = torch.randn(len(ctxs), hq, d, generator=g).to(torch.bfloat16)
    lens, starts = torch.tensor(ctxs), torch.arange(len(ctxs) + 1)
    args = (q, k, v, table, lens, starts, win, sinks, 0.2, bs)
    split = _attend(*args, split_kv=True)
    assert torch.equal(split, _attend(*args, split_kv=False))
    assert torch.equal(split, _attend(*args))  # the default picks split-KV here
    for s, c in enumerate(ctxs):
        ref = attention_reference(q[s : s + 1], k, v, tables[s].tolist(), c, 1, bs, win, sinks, 0.2)
        assert (split[s].float() - ref[0]).abs().max().item() < 3e-2
    # the long sequence's last 3 rows as a prefill chunk: its last row is the decode row
    q3 = torch.cat([torch.randn(2, hq, d, generator=g).to(torch.bfloat16), q[:1]])
    chunk = _one(q3, k, v, table[:1], ctxs[0], 3, win, sinks, 0.2, bs)
    assert torch.equal(chunk[2], split[0])


@settings(max_examples=8, deadline=None)
@given(
    fmt=st.sampled_from(["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3@head", "fp8_e5m2@head"]),
    qdtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**16),
)
def test_quantized_cache_rows_match_the_dequantized_cache(fmt, qdtype, seed):
    """8-bit K/V read in place (scales applied in registers) give the dequantized cache's
    result, and a row alone gives the bits it gets in the batch."""
    g = torch.Generator().manual_seed(seed)
    bs, nb, hq, d = 16, 12, 6, 64
    kq, vq, scales, kf, vf = quantized_blocks(fmt, nb, bs, g)
    tables = torch.randperm(nb, generator=g)[:12].view(2, 6).contiguous()
    lens, starts = torch.tensor([70, 41]), torch.tensor([0, 30, 31])
    q = torch.randn(31, hq, d, generator=g).to(DTYPES[qdtype])
    got = _attend(q, kq, vq, tables, lens, starts, 0, 0, 0.125, bs, scales)
    want = _attend(q.float(), kf, vf, tables, lens, starts, 0, 0, 0.125, bs)
    tol = 1e-4 if qdtype == "float32" else 2e-2
    assert ((got.float() - want).abs() - tol * want.abs()).max().item() < tol
    alone = _attend(
        q[29:30], kq, vq, tables[:1], torch.tensor([70]), torch.tensor([0, 1]), 0, 0, 0.125, bs,
        scales,
    )  # fmt: skip
    assert torch.equal(alone[0], got[29])


def test_strided_query_rows_and_an_empty_step():
    """A query that is a view of a fused QKV projection (rows strided) gives the
    contiguous query's result; a step of no rows returns an empty tensor."""
    g = torch.Generator().manual_seed(3)
    bs, hq, hkv, d = 16, 4, 2, 32
    k = torch.randn(4, bs, hkv, d, generator=g)
    v = torch.randn(4, bs, hkv, d, generator=g)
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(5, hq, d)
    table, lens, starts = torch.tensor([[2, 0, 3]]), torch.tensor([40]), torch.tensor([0, 5])
    out = _attend(q, k, v, table, lens, starts, 0, 0, 0.1, bs)
    assert torch.equal(out, _attend(q.contiguous(), k, v, table, lens, starts, 0, 0, 0.1, bs))
    empty = torch.zeros(0, hq, d)
    none = _attend(empty, k, v, table[:0], lens[:0], starts[:1], 0, 0, 0.1, bs, max_context=0)
    assert none.shape == (0, hq, d)
