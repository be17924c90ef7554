"""Attention score soft-capping (Gemma 2's ``attn_logit_softcapping``:
``cap * tanh(score / cap)`` before the softmax) in every attention kernel: the C++ kernel
over caches of rows (float scores, and bf16 dot products), over bf16 and int8 tiles (also
where AMX would read bf16 tiles: soft-capped calls take the AVX-512 kernel), the torch
(SDPA) backend and the Triton kernel under its interpreter. Each against float32
attention with the cap, and batch-invariant: a row computed alone as a decode token
gives the bits it has beside other sequences."""

from __future__ import annotations

import pytest
import torch
from helpers import amx_switched, attention_reference, paged_batch, quantized_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.attention import _sdpa
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kv_cache import TILE, tiles_from_rows

CAP = 2.0  # scores of these random tensors reach ±8: tanh changes them all


def _cpu(q, k, v, tables, lens, starts, window, sinks, cap, scales=(None, None)):
    d = q.shape[-1]
    return torch.ops.kvserve.paged_attention(
        q, k, v, tables, lens, starts, d**-0.5, window, sinks, *scales, cap
    )


def _tiles(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block caches of rows ``[blocks, bs, H, D]`` as tiles ``[blocks, bs / 16, H, 16, D]``."""
    nb, bs, h, d = k.shape
    t = tiles_from_rows(torch.stack([k.reshape(-1, h, d), v.reshape(-1, h, d)]))
    return t[0].view(nb, bs // TILE, h, TILE, d), t[1].view(nb, bs // TILE, h, TILE, d)


def _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, tol) -> None:
    """``attend(q, tables, lens, starts)`` against the capped float32 reference over k, v,
    and each sequence's last row alone equal to its row in the batch."""
    d = q.shape[-1]
    out = attend(q, tables, lens, starts)
    for s, (ctx, n) in enumerate(seqs):
        qs, rows = q[starts[s] : starts[s + 1]], out[starts[s] : starts[s + 1]]
        ref = attention_reference(
            qs, k, v, tables[s].tolist(), ctx, n, bs, *window, d**-0.5, softcap=CAP
        )
        uncapped = attention_reference(qs, k, v, tables[s].tolist(), ctx, n, bs, *window, d**-0.5)
        assert (rows.float() - ref).abs().max().item() < tol
        assert (uncapped - ref).abs().max().item() > 10 * tol  # the cap changed the result
        one = torch.tensor([0, 1])
        alone = attend(qs[n - 1 :], tables[s : s + 1], torch.tensor([ctx]), one)
        assert torch.equal(alone[0].float(), rows[n - 1].float()), s


SEQS = st.lists(st.tuples(st.integers(8, 90), st.integers(0, 89)), min_size=1, max_size=4)


@settings(max_examples=12, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "bfloat16"]),
    heads=st.sampled_from([(4, 4), (6, 2), (8, 1)]),
    d=st.sampled_from([32, 64]),
    window=st.sampled_from([(0, 0), (20, 4)]),
    layout=st.sampled_from(["rows", "tiles"]),
    seqs=SEQS,
    seed=st.integers(0, 2**16),
)
def test_cpu_kernel_caps_scores_and_stays_invariant(dtype, heads, d, window, layout, seqs, seed):
    assert load_cpu_kernels()
    dt = getattr(torch, dtype)
    if layout == "tiles":  # bf16 tiles only (and, on AMX machines, the AMX switch on)
        dt = torch.bfloat16
    hq, hkv = heads
    bs = 16
    g = torch.Generator().manual_seed(seed)
    seqs, nb, tables, lens, starts = paged_batch(seqs, bs, g)
    k = (torch.randn(nb, bs, hkv, d, generator=g) * 2).to(dt)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(dt)
    q = (torch.randn(int(starts[-1]), hq, d, generator=g) * 2).to(dt)
    kc, vc = _tiles(k, v) if layout == "tiles" else (k, v)

    def attend(q_, t, lens_, starts_):
        return _cpu(q_, kc, vc, t, lens_, starts_, *window, CAP)

    tol = 2e-5 if dt == torch.float32 else 3e-2
    with amx_switched(torch.ops.kvserve.attention_use_amx, "amx"):
        _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, tol)


def test_cpu_kernel_caps_int8_caches():
    """int8 codes with per-token scales: the cap applies to the dequantized scores."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    seqs, nb, tables, lens, starts = paged_batch([(40, 5), (70, 0), (17, 16)], 16, g)
    kq, vq, scales, kf, vf = quantized_blocks("int8", nb, 16, g)
    q = (torch.randn(int(starts[-1]), 4, 64, generator=g) * 2).bfloat16()

    def attend(q_, t, lens_, starts_):
        return _cpu(q_, kq, vq, t, lens_, starts_, 0, 0, CAP, scales)

    _check(attend, q, kf, vf, seqs, tables, lens, starts, 16, (0, 0), 3e-2)


def test_sdpa_backend_caps_scores():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 32, generator=g) * 2
    k = torch.randn(2, 2, 9, 32, generator=g) * 2
    v = torch.randn(2, 2, 9, 32, generator=g)
    mask = torch.ones(3, 9, dtype=torch.bool).tril(6)
    got = _sdpa(q, k, v, mask, False, 32**-0.5, CAP)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.tanh(q @ kk.transpose(-1, -2) * 32**-0.5 / CAP) * CAP
    want = s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv
    assert (got - want).abs().max().item() < 1e-5
    causal = _sdpa(q, k[:, :, :3], v[:, :, :3], None, True, 32**-0.5, CAP)
    s = torch.tanh(q @ kk[:, :, :3].transpose(-1, -2) * 32**-0.5 / CAP) * CAP
    tril = torch.ones(3, 3, dtype=torch.bool).tril()
    want = s.masked_fill(~tril, float("-inf")).softmax(-1) @ vv[:, :, :3]
    assert (causal - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [(0, 0), (20, 4)])
def test_triton_kernel_caps_scores(window):
    from kvserve.model import triton_attention as ta

    g = torch.Generator().manual_seed(11)
    bs = 16
    seqs, nb, tables, lens, starts = paged_batch([(40, 5), (70, 0), (17, 16)], bs, g)
    k = torch.randn(nb, bs, 2, 32, generator=g) * 2
    v = torch.randn(nb, bs, 2, 32, generator=g)
    q = torch.randn(int(starts[-1]), 4, 32, generator=g) * 2

    def attend(q_, t, lens_, starts_):
        kk, vv = k.reshape(-1, 2, 32), v.reshape(-1, 2, 32)
        return ta.paged_attention(
            q_, kk, vv, t, lens_, starts_, 32**-0.5, *window, block_size=bs, softcap=CAP
        )

    _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, 2e-5)
