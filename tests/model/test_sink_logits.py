"""gpt-oss's attention sinks (a learned logit per head: one more softmax column whose
weight is dropped, so a row's weights sum to less than 1) in every attention kernel: the
C++ kernel over caches of rows (float scores, bf16 dot products), over bf16 tiles (AMX
switched on where the CPU has it) and int8 tiles, the torch (SDPA) backend and the Triton
kernel under its interpreter, whole and split-KV. Each against float32 attention with the
sinks, and batch-invariant: a row computed alone gives the bits it has in the batch."""

from __future__ import annotations

import pytest
import torch
from helpers import amx_switched, attention_reference, paged_batch, quantized_blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from test_softcap import _tiles

from kvserve.model.attention import _sdpa
from kvserve.model.cpu_kernels import load_cpu_kernels


def _sinks(heads: int, g: torch.Generator) -> torch.Tensor:
    """Logits at the top of the scores' own range (their largest are ~8-10 here): the
    sinks take a good part of every row's weight, more in some heads than in others."""
    return torch.randn(heads, generator=g) * 2 + 8


def _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, sinks, tol) -> None:
    """``attend(q, tables, lens, starts)`` against the float32 reference with ``sinks``,
    and each sequence's last row alone equal to its row in the batch."""
    d = q.shape[-1]
    out = attend(q, tables, lens, starts)
    for s, (ctx, n) in enumerate(seqs):
        qs, rows = q[starts[s] : starts[s + 1]], out[starts[s] : starts[s + 1]]
        args = (qs, k, v, tables[s].tolist(), ctx, n, bs, *window, d**-0.5)
        ref = attention_reference(*args, sink_logits=sinks)
        plain = attention_reference(*args)
        assert (rows.float() - ref).abs().max().item() < tol
        assert (plain - ref).abs().max().item() > 10 * tol  # the sinks changed the result
        one = torch.tensor([0, 1])
        alone = attend(qs[n - 1 :], tables[s : s + 1], torch.tensor([ctx]), one)
        assert torch.equal(alone[0].float(), rows[n - 1].float()), s


SEQS = st.lists(st.tuples(st.integers(8, 90), st.integers(0, 89)), min_size=1, max_size=4)


@settings(max_examples=10, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "bfloat16"]),
    heads=st.sampled_from([(4, 4), (6, 2), (8, 1)]),
    d=st.sampled_from([32, 64]),
    window=st.sampled_from([(0, 0), (20, 4)]),
    layout=st.sampled_from(["rows", "tiles"]),
    seqs=SEQS,
    seed=st.integers(0, 2**16),
)
def test_cpu_kernel_applies_sinks_and_stays_invariant(dtype, heads, d, window, layout, seqs, seed):
    assert load_cpu_kernels()
    dt = torch.bfloat16 if layout == "tiles" else getattr(torch, dtype)
    hq, hkv = heads
    bs = 16
    g = torch.Generator().manual_seed(seed)
    seqs, nb, tables, lens, starts = paged_batch(seqs, bs, g)
    k = (torch.randn(nb, bs, hkv, d, generator=g) * 2).to(dt)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(dt)
    q = (torch.randn(int(starts[-1]), hq, d, generator=g) * 2).to(dt)
    sinks = _sinks(hq, g)
    kc, vc = _tiles(k, v) if layout == "tiles" else (k, v)

    def attend(q_, t, lens_, starts_):
        return torch.ops.kvserve.paged_attention(
            q_, kc, vc, t, lens_, starts_, d**-0.5, *window, None, None, 0.0, sinks
        )

    tol = 2e-5 if dt == torch.float32 else 3e-2
    with amx_switched(torch.ops.kvserve.attention_use_amx, "amx"):
        _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, sinks, tol)


def test_cpu_kernel_applies_sinks_over_int8_caches():
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    seqs, nb, tables, lens, starts = paged_batch([(40, 5), (70, 0), (17, 16)], 16, g)
    kq, vq, scales, kf, vf = quantized_blocks("int8", nb, 16, g)
    q = (torch.randn(int(starts[-1]), 4, 64, generator=g) * 2).bfloat16()
    sinks = _sinks(4, g)

    def attend(q_, t, lens_, starts_):
        return torch.ops.kvserve.paged_attention(
            q_, kq, vq, t, lens_, starts_, 64**-0.5, 0, 0, *scales, 0.0, sinks
        )

    _check(attend, q, kf, vf, seqs, tables, lens, starts, 16, (0, 0), sinks, 3e-2)


def test_cpu_kernel_refuses_sinks_of_the_wrong_shape():
    assert load_cpu_kernels()
    q = torch.randn(1, 4, 32)
    k = torch.randn(1, 16, 2, 32)
    one = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="sink_logits must be contiguous float32"):
        torch.ops.kvserve.paged_attention(
            q, k, k, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), one, 1.0, 0, 0,
            None, None, 0.0, torch.zeros(2),
        )  # fmt: skip


def test_sdpa_backend_applies_sinks():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 32, generator=g) * 2
    k = torch.randn(2, 2, 9, 32, generator=g) * 2
    v = torch.randn(2, 2, 9, 32, generator=g)
    sinks = _sinks(4, g)
    mask = torch.ones(3, 9, dtype=torch.bool).tril(6)
    got = _sdpa(q, k, v, mask, False, 32**-0.5, 0.0, sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-1, -2) * 32**-0.5).masked_fill(~mask, float("-inf"))
    col = sinks.view(1, 4, 1, 1).expand(2, 4, 3, 1)
    want = torch.cat([s, col], -1).softmax(-1)[..., :-1] @ vv
    assert (got - want).abs().max().item() < 1e-5
    plain = _sdpa(q, k, v, mask, False, 32**-0.5, 0.0)
    assert (plain - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("split_kv", [False, True])
def test_triton_kernel_applies_sinks(split_kv):
    """Whole and split-KV (the merge kernel adds the sinks after every split)."""
    from kvserve.model import triton_attention as ta

    g = torch.Generator().manual_seed(11)
    bs = 16
    lengths = [(600, 1), (70, 1), (17, 1)] if split_kv else [(40, 5), (70, 0), (17, 16)]
    seqs, nb, tables, lens, starts = paged_batch(lengths, bs, g)
    k = torch.randn(nb, bs, 2, 32, generator=g) * 2
    v = torch.randn(nb, bs, 2, 32, generator=g)
    q = torch.randn(int(starts[-1]), 4, 32, generator=g) * 2
    sinks = _sinks(4, g)

    def attend(q_, t, lens_, starts_):
        kk, vv = k.reshape(-1, 2, 32), v.reshape(-1, 2, 32)
        return ta.paged_attention(
            q_, kk, vv, t, lens_, starts_, 32**-0.5, block_size=bs, split_kv=split_kv,
            sink_logits=sinks,
        )  # fmt: skip

    _check(attend, q, k, v, seqs, tables, lens, starts, bs, (0, 0), sinks, 2e-5)
