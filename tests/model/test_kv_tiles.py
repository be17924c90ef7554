"""The tiled layout of plain bf16 caches (``csrc/kv_tiles.h``, ``model/kv_cache.py``): written by
``write_kv`` as ``tiles_from_rows`` permutes, read by its own attention kernels (spans of
four cells per softmax update, on AVX-512 or on AMX tiles) correctly and batch-invariantly,
never a source of another sequence's stale values, and a different stored format from
rows."""

from __future__ import annotations

from contextlib import AbstractContextManager

import pytest
import torch
from helpers import amx_switched, attention_reference, paged_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kv_cache import (
    TILE,
    KVCacheSpec,
    block_tensors,
    rows_from_tiles,
    tiles_from_rows,
)

AMX = load_cpu_kernels() and bool(torch.ops.kvserve.attention_amx())
# bf16 tiles have two kernels: AVX-512-BF16 spans, and AMX tiles where the CPU has them; on
# an AMX machine the tests run both.
KERNELS = ["avx512", "amx"] if AMX else ["avx512"]


def kernel(name: str) -> AbstractContextManager[None]:
    """Within the block bf16 tiles are read by the kernel ``name`` ("amx" or "avx512")."""
    return amx_switched(torch.ops.kvserve.attention_use_amx, name)


def _attend(q, k, v, tables, lens, starts, window, sinks):
    d = q.shape[-1]
    return torch.ops.kvserve.paged_attention(
        q, k, v, tables, lens, starts, d**-0.5, window, sinks, None, None
    )


def _as_tiles(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block caches ``[blocks, bs, H, D]`` of rows as ``[blocks, bs / 16, H, 16, D]`` tiles."""
    nb, bs, h, d = k.shape
    t = tiles_from_rows(torch.stack([k.reshape(-1, h, d), v.reshape(-1, h, d)]))
    return t[0].view(nb, bs // TILE, h, TILE, d), t[1].view(nb, bs // TILE, h, TILE, d)


@settings(max_examples=20, deadline=None)
@given(
    tiles=st.integers(1, 4),
    h=st.integers(1, 4),
    d=st.sampled_from([2, 8, 64]),
    seed=st.integers(0, 2**16),
)
def test_tiles_and_rows_are_inverse_permutations(tiles, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(2, tiles * TILE, h, d, generator=g)
    t = tiles_from_rows(rows)
    assert t.shape == (2, tiles, h, TILE, d)
    assert torch.equal(rows_from_tiles(t), rows)
    # the documented order: K [D / 2][TILE][2], V [TILE / 2][D][2] per (tile, head)
    s, hh, dd = tiles * TILE - 3, h - 1, d - 1
    kt = t[0].reshape(tiles, h, d // 2, TILE, 2)[s // TILE, hh, dd // 2, s % TILE, dd % 2]
    vt = t[1].reshape(tiles, h, TILE // 2, d, 2)[s // TILE, hh, s % TILE // 2, dd, s % 2]
    assert kt == rows[0, s, hh, dd] and vt == rows[1, s, hh, dd]


@pytest.mark.parametrize("name", KERNELS)
@settings(max_examples=50, deadline=None)
@given(
    bs=st.sampled_from([16, 32]),
    heads=st.sampled_from([(9, 3), (4, 4), (6, 2), (8, 1), (12, 3), (24, 1)]),
    d=st.sampled_from([32, 64, 96, 128, 256]),
    window=st.sampled_from([(0, 0), (7, 0), (20, 4), (33, 17), (70, 5)]),
    seqs=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 149)), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_tiled_rows_are_correct_and_invariant(name, bs, heads, d, window, seqs, seed):
    """Decode and prefill rows over tiles (spans of 4 cells, partial cells, windows, sinks):
    within bf16's precision of float32 attention, and bit for bit the same whether a row is
    computed alone as a decode token, in a prefill chunk of either split, or beside other
    sequences."""
    assert load_cpu_kernels() and torch.ops.kvserve.tiled_kv_supported(64)
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    seqs, nb, tables, lens, starts = paged_batch(seqs, bs, g)
    k = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    v = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    kt, vt = _as_tiles(k, v)
    q = torch.randn(int(starts[-1]), hq, d, generator=g).bfloat16()
    with kernel(name):
        _check_rows(q, k, v, kt, vt, seqs, tables, lens, starts, bs, window)


def _check_rows(q, k, v, kt, vt, seqs, tables, lens, starts, bs, window) -> None:
    d = q.shape[-1]
    out = _attend(q, kt, vt, tables, lens, starts, *window)

    def alone(rows: torch.Tensor, s: int, ctx: int) -> torch.Tensor:
        n = torch.tensor([0, rows.shape[0]])
        return _attend(rows, kt, vt, tables[s : s + 1], torch.tensor([ctx]), n, *window)

    for s, (ctx, n) in enumerate(seqs):
        qs, rows = q[starts[s] : starts[s + 1]], out[starts[s] : starts[s + 1]]
        ref = attention_reference(qs, k, v, tables[s].tolist(), ctx, n, bs, *window, d**-0.5)
        assert (rows.float() - ref).abs().max().item() < 3e-2
        for j in {0, n // 2, n - 1}:  # the row alone, as a decode token
            assert _same_bits(alone(qs[j : j + 1], s, ctx - n + j + 1)[0], rows[j]), (s, j)
        if n > 1:  # the same rows as two chunks of a chunked prefill
            cut = n // 2
            chunks = [alone(qs[:cut], s, ctx - n + cut), alone(qs[cut:], s, ctx)]
            assert _same_bits(torch.cat(chunks), rows)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (``torch.equal`` would take -0 for +0)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", KERNELS)
def test_stale_values_in_a_tile_are_never_read(name):
    """A tile's lanes past a sequence's end, and before its window, may hold another
    sequence's values, even NaN: the result is the one with zeros there."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ctx = 9, 3, 64, 37  # 37: lanes 5..15 of the third tile are not this sequence's
    k = torch.randn(3, 16, hkv, d, generator=g).bfloat16()
    v = torch.randn(3, 16, hkv, d, generator=g).bfloat16()
    q = torch.randn(4, hq, d, generator=g).bfloat16()
    table, lens, starts = torch.tensor([[0, 1, 2]]), torch.tensor([ctx]), torch.tensor([0, 4])
    # a window starts mid-pair in some rows; positions [3, 24) no row of (10, 3) sees
    for window, hidden in [((0, 0), []), ((10, 0), []), ((10, 3), [(3, 24)])]:
        clean_k, clean_v, bad_k, bad_v = k.clone(), v.clone(), k.clone(), v.clone()
        for a, b in [(ctx, 48), *hidden]:
            for t, value in [(clean_k, 0.0), (clean_v, 0.0), (bad_k, "nan"), (bad_v, "nan")]:
                t.view(-1, hkv, d)[a:b] = float(value)
        with kernel(name):
            want = _attend(q, *_as_tiles(clean_k, clean_v), table, lens, starts, *window)
            got = _attend(q, *_as_tiles(bad_k, bad_v), table, lens, starts, *window)
        assert torch.isfinite(got.float()).all() and _same_bits(got, want)


def test_write_kv_scatters_slots_into_tiles_and_refuses_bad_input():
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(5)
    t, h, d, slots_n = 21, 3, 64, 64
    kv = torch.randn(t, 2 * h * d + 8, generator=g).bfloat16()  # strided rows, as QKV views
    k, v = kv[:, : h * d].view(t, h, d), kv[:, h * d : 2 * h * d].view(t, h, d)
    slots = torch.randperm(slots_n, generator=g)[:t]
    rows = torch.zeros(2, slots_n, h, d, dtype=torch.bfloat16)
    torch.ops.kvserve.write_kv(k, v, slots, rows)
    tiles = torch.zeros(2, slots_n // TILE, h, TILE, d, dtype=torch.bfloat16)
    torch.ops.kvserve.write_kv(k, v, slots, tiles)
    assert torch.equal(tiles, tiles_from_rows(rows))
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kvserve.write_kv(k, v, torch.full((t,), slots_n), tiles)
    with pytest.raises(RuntimeError, match="tiles"):
        torch.ops.kvserve.write_kv(k, v, slots, torch.zeros(2, 4, h, 8, d, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="tiles"):
        torch.ops.kvserve.write_kv(k.float(), v.float(), slots, tiles.float())


def test_attention_refuses_tiles_it_cannot_read():
    assert load_cpu_kernels()
    q = torch.randn(1, 3, 64)
    tiles = torch.zeros(2, 1, 3, TILE, 64)
    one = torch.tensor([[0]]), torch.tensor([5]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="tiled cache needs a bf16"):
        _attend(q, tiles[0:1], tiles[1:2], *one, 0, 0)  # float32 query and cache
    with pytest.raises(RuntimeError, match="a tile holds 16"):
        _attend(q.bfloat16(), *torch.zeros(2, 1, 1, 3, 8, 64).bfloat16(), *one, 0, 0)


def test_spec_allocates_tiles_whose_blocks_move_like_rows():
    spec = KVCacheSpec(2, 3, 64, torch.bfloat16, 32, tiled=True)
    caches = spec.allocate(5, torch.device("cpu"))
    assert caches[0].shape == (2, 5 * 32 // TILE, 3, TILE, 64)
    views = block_tensors(caches, 32)
    assert views[0].shape == (2, 5, 32 // TILE, 3, TILE, 64)
    assert views[0][:, 0].numel() * 2 == spec.bytes_per_block // 2  # one layer's K+V block
    with pytest.raises(ValueError, match="multiple of 16"):
        KVCacheSpec(2, 3, 64, torch.bfloat16, 8, tiled=True)


def test_a_stored_block_of_tiles_is_a_miss_for_an_engine_of_rows():
    """The KV store's block format names the parts' shapes, so a block saved from tiles is
    a format mismatch (a miss) where the engine reads rows, and the other way round."""
    from kvserve.store import serde
    from kvserve.worker.offload import KVTransfer

    rows_spec = KVCacheSpec(2, 3, 64, torch.bfloat16, 16)
    tiles_spec = KVCacheSpec(2, 3, 64, torch.bfloat16, 16, tiled=True)
    cpu = torch.device("cpu")
    rows = KVTransfer(rows_spec.allocate(4, cpu), 16, "model", "bfloat16")
    tiles = KVTransfer(tiles_spec.allocate(4, cpu), 16, "model", "bfloat16")
    assert rows.block_format().payload_bytes == tiles.block_format().payload_bytes
    key, tokens = b"k" * 16, list(range(16))
    blob = serde.encode(tiles.block_format(), key, tiles.rows([(1,)])[0], tokens)
    assert not isinstance(serde.check(tiles.block_format(), key, blob, tokens), str)
    assert serde.check(rows.block_format(), key, blob, tokens) == "mismatch: parts"
