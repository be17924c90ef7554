"""Tiled 8-bit caches (int8, fp8 with per-token scales; ``csrc/kv_tiles.h``): ``quantize_kv``
writes the same codes and scales as into rows, in the tiles' order; the tiled kernel reads
them in place, converting codes in registers and scaling per key lane, to the rows kernel's
result within bf16's precision, batch-invariantly, and never reads a tile's stale lanes."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_reference, paged_batch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.model.attention import CpuPagedAttention
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kv_cache import (
    TILE,
    KVCacheSpec,
    block_tensors,
    rows_from_tiles,
    tiles_from_rows,
)
from kvserve.model.kv_quant import QuantizedKVCache, kv_format

DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _fmt(name: str):
    return kv_format(name, torch.bfloat16, "token")


def _pair(name: str, slots: int, h: int, d: int, shift: torch.Tensor | None = None):
    """The same format as rows and as tiles."""
    caches = [QuantizedKVCache(_fmt(name), slots, h, d, torch.device("cpu"), t) for t in (0, 1)]
    if shift is not None:
        for c in caches:
            c.set_k_shift(shift)
    return caches


def _scale_tiles(scale: torch.Tensor) -> torch.Tensor:
    """Per-token scales ``[2, slots, H]`` in the tiled order ``[2, slots / 16, H, 16]``."""
    two, slots, h = scale.shape
    return scale.view(two, slots // TILE, TILE, h).permute(0, 1, 3, 2).contiguous()


def _attend(q, cache: QuantizedKVCache, bs, tables, lens, starts, window=0, sinks=0):
    """The engine's CPU backend over ``cache``, rows or tiles alike."""
    backend = CpuPagedAttention(bs, window, sinks, cache.tiled)
    return backend._attend(q, cache, tables, lens, starts, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("name", DTYPES)
def test_quantize_kv_writes_the_rows_codes_in_tile_order(name):
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(1)
    t, h, d, slots = 37, 3, 64, 64
    shift = torch.randn(h, d, generator=g) * 0.1
    rows, tiles = _pair(name, slots, h, d, shift)
    assert tiles.data.shape == (2, slots // TILE, h, TILE, d)
    assert tiles.scale.shape == (2, slots // TILE, h, TILE)
    kv = torch.randn(t, 2 * h * d + 8, generator=g).bfloat16()  # strided rows, as QKV views
    k, v = kv[:, : h * d].view(t, h, d), kv[:, h * d : 2 * h * d].view(t, h, d)
    slot_ids = torch.randperm(slots, generator=g)[:t]
    rows.write_cpu(slot_ids, k, v)
    tiles.write_cpu(slot_ids, k, v)
    want = tiles_from_rows(rows.data.view(torch.uint8))
    assert torch.equal(tiles.data.view(torch.uint8), want)
    assert torch.equal(tiles.scale, _scale_tiles(rows.scale))
    with pytest.raises(RuntimeError, match="tiled"):
        tiles.write(slot_ids, k, v)  # the Python path writes rows only
    with pytest.raises(RuntimeError, match="tiled"):
        tiles.read_slots(0, slot_ids, torch.bfloat16)


@settings(max_examples=15, deadline=None)
@given(
    name=st.sampled_from(DTYPES),
    bs=st.sampled_from([16, 32]),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1)]),
    d=st.sampled_from([32, 64, 128]),
    window=st.sampled_from([(0, 0), (20, 4), (70, 5)]),
    seqs=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 149)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
# found by a random run: with reassociation on, the decode row's bits differed
@example(name="int8", bs=16, heads=(4, 4), d=32, window=(0, 0), seqs=[(48, 1)], seed=0)
def test_tiled_8bit_attention_matches_rows_and_is_invariant(name, bs, heads, d, window, seqs, seed):
    """Decode and prefill rows over 8-bit tiles: within bf16's precision of float32
    attention over the dequantized cache and of the rows kernel, and bit for bit the same
    for a row computed alone as a decode token or beside other sequences."""
    assert load_cpu_kernels() and torch.ops.kvserve.tiled_kv_supported(64)
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    seqs, nb, tables, lens, starts = paged_batch(seqs, bs, g)
    rows, tiles = _pair(name, nb * bs, hkv, d)
    k = torch.randn(nb * bs, hkv, d, generator=g).bfloat16()
    v = torch.randn(nb * bs, hkv, d, generator=g).bfloat16()
    every = torch.arange(nb * bs)
    rows.write_cpu(every, k, v)
    tiles.write_cpu(every, k, v)
    q = torch.randn(int(starts[-1]), hq, d, generator=g).bfloat16()
    out = _attend(q, tiles, bs, tables, lens, starts, *window)
    by_rows = _attend(q, rows, bs, tables, lens, starts, *window)
    assert (out.float() - by_rows.float()).abs().max().item() < 3e-2
    kd = rows.read_slots(0, every, torch.float32).view(nb, bs, hkv, d)
    vd = rows.read_slots(1, every, torch.float32).view(nb, bs, hkv, d)
    for s, (ctx, n) in enumerate(seqs):
        qs, got = q[starts[s] : starts[s + 1]], out[starts[s] : starts[s + 1]]
        ref = attention_reference(qs, kd, vd, tables[s].tolist(), ctx, n, bs, *window, d**-0.5)
        assert (got.float() - ref).abs().max().item() < 3e-2
        j = n - 1  # the last row alone, as a decode token
        one = torch.tensor([0, 1])
        alone = _attend(qs[j:], tiles, bs, tables[s : s + 1], torch.tensor([ctx]), one, *window)
        assert torch.equal(alone[0], got[j])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_decode_kernels_fp8_lookup_gives_every_codes_value(dtype):
    """The conversion decode rows read fp8 codes with (a byte lookup, 64 at a time, where
    the CPU has AVX-512-VBMI): every finite code, in four positions of 64-code groups, is
    PyTorch's value of it, exactly (bits compared, so -0 is not 0)."""
    assert load_cpu_kernels()
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.cat([codes, codes.roll(17), codes.flip(0), codes.roll(40)]).view(dtype)
    got = torch.ops.kvserve.fp8_lookup_bf16(codes)
    want = codes.to(torch.bfloat16)
    finite = torch.isfinite(want)
    assert finite.sum() >= 4 * 248
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_reads_the_same_in_decode_and_prefill(name):
    """Decode rows convert fp8 codes by a byte lookup, 64 at a time; prefill rows by bit
    arithmetic, 32 at a time. A cache holding every finite code (subnormals, zeros of both
    signs, the largest) gives a decode token the prefill row's result bit for bit."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, ctx = 9, 3, 64, 64
    _, cache = _pair(name, ctx, hkv, d)
    probe = torch.arange(256, dtype=torch.uint8).view(cache.data.dtype).float()
    finite = torch.arange(256)[torch.isfinite(probe)].to(torch.uint8)
    per_part = cache.data[0].numel()
    for part in (0, 1):  # every finite code in each part, in a random order
        order = torch.randperm(per_part, generator=g) % finite.numel()
        cache.data.view(torch.uint8)[part].view(-1).copy_(finite[order])
    cache.scale.copy_(torch.rand(cache.scale.shape, generator=g).half() + 0.5)
    q = (torch.randn(2, hq, d, generator=g) / 64).bfloat16()  # scores stay finite
    table, lens = torch.tensor([[0, 1, 2, 3]]), torch.tensor([ctx])
    both = _attend(q, cache, 16, table, lens, torch.tensor([0, 2]))
    alone = _attend(q[1:], cache, 16, table, lens, torch.tensor([0, 1]))
    assert torch.isfinite(both.float()).all()
    assert torch.equal(alone[0], both[1])


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_stale_codes_and_scales_in_a_tile_are_never_read(name):
    """Lanes past a sequence's end may hold another sequence's codes and scales, even a
    NaN code or scale: the result is the one with zeros there."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ctx = 9, 3, 64, 37
    clean, dirty = (_pair(name, 48, hkv, d)[1] for _ in range(2))
    k = torch.randn(ctx, hkv, d, generator=g).bfloat16()
    v = torch.randn(ctx, hkv, d, generator=g).bfloat16()
    for c in (clean, dirty):
        c.write_cpu(torch.arange(ctx), k, v)
    stale = torch.arange(ctx, 48)
    codes = rows_from_tiles(dirty.data.view(torch.uint8))
    codes[:, stale] = 0x7F  # an fp8 NaN; int8 127
    dirty.data.view(torch.uint8).copy_(tiles_from_rows(codes))
    dirty.scale[:, 2, :, stale - 32] = float("nan")
    q = torch.randn(4, hq, d, generator=g).bfloat16()
    table, lens, starts = torch.tensor([[0, 1, 2]]), torch.tensor([ctx]), torch.tensor([0, 4])
    want = _attend(q, clean, 16, table, lens, starts)
    got = _attend(q, dirty, 16, table, lens, starts)
    assert torch.isfinite(got.float()).all() and torch.equal(got, want)


def test_spec_tiles_token_scaled_caches_and_refuses_head_scales():
    spec = KVCacheSpec.for_format(2, 3, 64, _fmt("int8"), 32, tiled=True)
    caches = spec.allocate(5, torch.device("cpu"), _fmt("int8"))
    assert caches[0].tiled and caches[0].data.shape == (2, 5 * 32 // TILE, 3, TILE, 64)
    codes, scales = block_tensors(caches, 32)[:2]
    assert codes.shape == (2, 5, 32 // TILE, 3, TILE, 64)
    assert scales.shape == (2, 5, 32 // TILE, 3, TILE)
    assert (codes[:, 0].numel() + 2 * scales[:, 0].numel()) * 2 == spec.bytes_per_block
    head = kv_format("fp8_e4m3", torch.bfloat16, "head")
    assert head.scale == "head"
    with pytest.raises(ValueError, match="per-token scales"):
        KVCacheSpec.for_format(2, 3, 64, head, 32, tiled=True)
    with pytest.raises(ValueError, match="per-token scales"):
        QuantizedKVCache(head, 32, 3, 64, torch.device("cpu"), tiled=True)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_an_engine_serves_from_tiled_8bit_caches(model_dirs, name):
    """A bf16 model with an 8-bit cache (qwen3: head_dim 32) gets tiles; each prompt's
    greedy tokens are the same alone and in a batch, and start as an engine of rows
    (block size 8, the rows kernel) has them."""
    from helpers import greedy, make_engine, random_prompts, run_to_end

    kw = dict(dtype="bfloat16", kv_cache_dtype=name, max_num_batched_tokens=64)
    tiled = make_engine(model_dirs["qwen3"], block_size=16, **kw)
    assert tiled.runner.kv_caches[0].tiled
    prompts = random_prompts([7, 40, 23, 61], seed=9)
    for i, p in enumerate(prompts):
        tiled.add_request(str(i), p, greedy(12))
    batched = run_to_end(tiled)
    tiled.add_request("alone", prompts[2], greedy(12))
    assert run_to_end(tiled)["alone"] == batched["2"]
    rows = make_engine(model_dirs["qwen3"], block_size=8, **kw)
    assert not rows.runner.kv_caches[0].tiled
    for i, p in enumerate(prompts):
        rows.add_request(str(i), p, greedy(12))
    by_rows = run_to_end(rows)
    # a random model's near-ties make greedy paths part after a while: compare their starts
    assert all(batched[i][:6] == by_rows[i][:6] for i in batched), (batched, by_rows)
