"""The paged attention kernel (decode and prefill rows in one call): correct against a
float32 reference, and batch-invariant bit for bit — a row's output is the same computed
alone as a decode token, inside a prefill chunk of any split, or beside other sequences."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_reference, quantized_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.cpu_kernels import load_cpu_kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attend(q, k, v, tables, lens, starts, window, sinks, scale, scales=(None, None)):
    return torch.ops.kvserve.paged_attention(
        q, k, v, tables, lens, starts, scale, window, sinks, *scales
    )


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    bs=st.sampled_from([8, 16, 32]),
    heads=st.sampled_from([(4, 4), (6, 2), (9, 3), (3, 1)]),
    d=st.sampled_from([32, 64]),
    window=st.sampled_from([(0, 0), (7, 0), (20, 4), (33, 17)]),
    seqs=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 89)), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_rows_are_invariant_and_correct(dtype, bs, heads, d, window, seqs, seed):
    assert load_cpu_kernels()
    dt = DTYPES[dtype]
    hq, hkv = heads
    win, sinks = window
    g = torch.Generator().manual_seed(seed)
    # (context length, rows): the rows are the last ones of the context
    seqs = [(ctx, 1 + r % ctx) for ctx, r in seqs]
    max_blocks = -(-max(c for c, _ in seqs) // bs)
    num_blocks = max_blocks * len(seqs) + 3
    k = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dt)
    v = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dt)
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: max_blocks * len(seqs)].view(len(seqs), max_blocks).contiguous()
    lens = torch.tensor([c for c, _ in seqs])
    starts = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()])
    q = torch.randn(int(starts[-1]), hq, d, generator=g).to(dt)
    scale = d**-0.5
    out = _attend(q, k, v, tables, lens, starts, win, sinks, scale)
    tol = 2e-5 if dt == torch.float32 else 3e-2
    for s, (ctx, n) in enumerate(seqs):
        rows = out[starts[s] : starts[s + 1]]
        ref = attention_reference(
            q[starts[s] : starts[s + 1]], k, v, tables[s].tolist(), ctx, n, bs, win, sinks, scale
        )
        assert (rows.float() - ref).abs().max().item() < tol
        table = tables[s : s + 1]
        for j in {0, n // 2, n - 1}:  # the row alone, as a decode token
            alone = _attend(
                q[starts[s] + j : starts[s] + j + 1],
                k,
                v,
                table,
                torch.tensor([ctx - n + j + 1]),
                torch.tensor([0, 1]),
                win,
                sinks,
                scale,
            )
            assert torch.equal(alone[0], rows[j]), (s, j)
        if n > 1:  # the same rows as two chunks of a chunked prefill
            cut = n // 2
            first = _attend(
                q[starts[s] : starts[s] + cut],
                k,
                v,
                table,
                torch.tensor([ctx - n + cut]),
                torch.tensor([0, cut]),
                win,
                sinks,
                scale,
            )
            second = _attend(
                q[starts[s] + cut : starts[s + 1]],
                k,
                v,
                table,
                torch.tensor([ctx]),
                torch.tensor([0, n - cut]),
                win,
                sinks,
                scale,
            )
            assert torch.equal(torch.cat([first, second]), rows)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 2), (5, 5)])
def test_bf16_rows_alone_equal_the_rows_of_a_shared_tile(d, heads):
    """The bf16 path (bf16 dot products on the cache's own K): a row alone in its tile (a
    decode token) gives the bits it gets among the rows of a prefill tile, for every head
    grouping (1-4 heads a pass), head size and partial cell."""
    assert load_cpu_kernels()
    hq, hkv = heads
    g = torch.Generator().manual_seed(d * 31 + hq)
    bs, ctx, n = 16, 77, 40  # 77: a partial last cell; the 40 rows share tiles
    nb = -(-ctx // bs) + 2
    k = (torch.randn(nb, bs, hkv, d, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(nb, generator=g)[: -(-ctx // bs)].view(1, -1).contiguous()
    q = (torch.randn(n, hq, d, generator=g) * 2).to(torch.bfloat16)
    rows = _attend(q, k, v, table, torch.tensor([ctx]), torch.tensor([0, n]), 0, 0, d**-0.5)
    for j in range(n):
        alone = _attend(
            q[j : j + 1], k, v, table, torch.tensor([ctx - n + j + 1]), torch.tensor([0, 1]),
            0, 0, d**-0.5,
        )  # fmt: skip
        assert torch.equal(alone[0], rows[j]), j
    ref = attention_reference(q, k, v, table[0].tolist(), ctx, n, bs, 0, 0, d**-0.5)
    assert (rows.float() - ref).abs().max().item() < 3e-2


@settings(max_examples=12, deadline=None)
@given(
    fmt=st.sampled_from(["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3@head", "fp8_e5m2@head"]),
    qdtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**16),
)
def test_quantized_cache_rows_are_invariant_and_match_dequantized(fmt, qdtype, seed):
    """8-bit K/V read in place (scales in registers) equal the dequantized cache's result
    and stay invariant. A float query takes the float path (to 1e-4); a bf16 one the bf16
    dot products over the codes, its weights rounded to bf16 (to bf16's precision)."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(seed)
    bs, nb, hq, d = 16, 12, 6, 64
    kq, vq, scales, kf, vf = quantized_blocks(fmt, nb, bs, g)
    tables = torch.randperm(nb, generator=g)[:12].view(2, 6).contiguous()
    lens, starts = torch.tensor([70, 41]), torch.tensor([0, 30, 31])
    q = torch.randn(31, hq, d, generator=g).to(DTYPES[qdtype])
    got = _attend(q, kq, vq, tables, lens, starts, 0, 0, 0.125, scales)
    want = _attend(q.float(), kf, vf, tables, lens, starts, 0, 0, 0.125)
    # bf16: the weights and the output are each rounded to bf16 (8 significant bits), so
    # the bound grows with the value (an output near 1.2 was 0.0203 off)
    tol = 1e-4 if qdtype == "float32" else 2e-2
    err = (got.float() - want).abs() - tol * want.abs()
    assert err.max().item() < tol
    alone = _attend(
        q[29:30], kq, vq, tables[:1], torch.tensor([70]), torch.tensor([0, 1]), 0, 0, 0.125, scales
    )
    assert torch.equal(alone[0], got[29])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_8bit_code_is_read_exactly_by_the_bf16_path(dtype):
    """A bf16 query reads 8-bit codes as bf16 (exact for every finite code): with one key
    per sequence, scale 1 and V rows holding one code, the output is that code's value."""
    assert load_cpu_kernels()
    if dtype == torch.int8:
        codes = torch.arange(-128, 128, dtype=torch.int8)
        ones = torch.ones(256, 1, dtype=torch.float16)
        scales = (ones, ones)
    else:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        codes = codes[codes.float().isfinite()]
        scales = (torch.ones(1), torch.ones(1))
    n, d = codes.numel(), 64
    v = codes.view(n, 1, 1, 1).expand(n, 1, 1, d).contiguous()
    k = torch.zeros(n, 1, 1, d, dtype=torch.int8).view(dtype)
    q = torch.zeros(n, 1, d, dtype=torch.bfloat16)
    tables, lens = torch.arange(n).view(n, 1), torch.ones(n, dtype=torch.long)
    out = _attend(q, k, v, tables, lens, torch.arange(n + 1), 0, 0, 1.0, scales)
    assert torch.equal(out[:, 0, :].float(), codes.float().view(n, 1).expand(n, d))


def test_bad_metadata_is_refused():
    assert load_cpu_kernels()
    k = torch.zeros(2, 16, 1, 32)
    q = torch.zeros(3, 1, 32)
    tables = torch.zeros(1, 2, dtype=torch.long)
    import pytest

    with pytest.raises(RuntimeError, match="query rows"):  # 3 rows for a context of 2
        _attend(q, k, k, tables, torch.tensor([2]), torch.tensor([0, 3]), 0, 0, 1.0)
    with pytest.raises(RuntimeError, match="more blocks"):
        _attend(q, k, k, tables, torch.tensor([40]), torch.tensor([0, 3]), 0, 0, 1.0)
    with pytest.raises(RuntimeError, match="span"):
        _attend(q, k, k, tables, torch.tensor([20]), torch.tensor([0, 2]), 0, 0, 1.0)


def test_strided_query_rows_give_the_contiguous_result():
    """q as a view of a fused QKV output (strided rows) is read in place, bit for bit."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    bs, nb, hq, hkv, d = 16, 8, 6, 2, 64
    k = torch.randn(nb, bs, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(torch.bfloat16)
    tables = torch.randperm(nb, generator=g).view(2, 4).contiguous()
    lens, starts = torch.tensor([50, 9]), torch.tensor([0, 5, 6])
    qkv = torch.randn(6, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q = qkv[:, : hq * d].view(6, hq, d)
    assert not q.is_contiguous()
    out = _attend(q, k, v, tables, lens, starts, 0, 0, d**-0.5)
    assert out.is_contiguous()
    assert torch.equal(out, _attend(q.contiguous(), k, v, tables, lens, starts, 0, 0, d**-0.5))


def test_write_kv_stores_like_index_copy_and_refuses_bad_input():
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(4)
    t, h, d, slots_n = 7, 3, 64, 40
    kv = torch.randn(t, 2 * h * d + 32, generator=g).to(torch.bfloat16)
    k, v = kv[:, : h * d].view(t, h, d), kv[:, h * d : 2 * h * d].view(t, h, d)
    slots = torch.randperm(slots_n, generator=g)[:t]
    cache = torch.zeros(2, slots_n, h, d, dtype=torch.bfloat16)
    expect = cache.clone()
    expect[0].index_copy_(0, slots, k)
    expect[1].index_copy_(0, slots, v)
    torch.ops.kvserve.write_kv(k, v, slots, cache)
    assert torch.equal(cache, expect)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kvserve.write_kv(k, v, torch.full((t,), slots_n), cache)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.kvserve.write_kv(k.float(), v.float(), slots, cache)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvserve.write_kv(k, v, slots, cache.transpose(2, 3))
