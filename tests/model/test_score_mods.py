"""What changes attention scores besides the scale, in every attention kernel: Gemma 2's
soft-capping (``attn_logit_softcapping``: ``cap * tanh(score / cap)`` before the softmax)
and gpt-oss's sinks (a learned logit per head: one more softmax column whose weight is
dropped, so a row's weights sum to less than 1), each alone and both together.

The kernels: the C++ kernel over caches of rows (float scores, and bf16 dot products),
over bf16 tiles (also where AMX would read them: soft-capped calls take the AVX-512
kernel; sinks are merged after the last key in both) and int8 tiles, the torch (SDPA)
backend and the Triton kernel under its interpreter, whole and split-KV. Each against
float32 attention with the same modifications, and batch-invariant: a row computed
alone as a decode token gives the bits it has beside other sequences."""

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
MODS = ("softcap", "sinks", "both")


def _mods(mod: str, heads: int, g: torch.Generator) -> dict:
    """``attention_reference``'s keywords for ``mod``: the cap, and sink logits at the top
    of the scores' range (their largest are ~8-10 here; capped, 2), so the sinks take a
    good part of every row's weight, more in some heads than in others."""
    out: dict = {}
    if mod in ("softcap", "both"):
        out["softcap"] = CAP
    if mod in ("sinks", "both"):
        top = CAP if mod == "both" else 8.0
        out["sink_logits"] = torch.randn(heads, generator=g) * top / 4 + top
    return out


def _cpu(q, k, v, tables, lens, starts, window, mods, scales=(None, None)):
    d = q.shape[-1]
    return torch.ops.kvserve.paged_attention(
        q, k, v, tables, lens, starts, d**-0.5, *window, *scales, mods.get("softcap", 0.0),
        mods.get("sink_logits"),
    )  # fmt: skip


def _tiles(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block caches of rows ``[blocks, bs, H, D]`` as tiles ``[blocks, bs / 16, H, 16, D]``."""
    nb, bs, h, d = k.shape
    t = tiles_from_rows(torch.stack([k.reshape(-1, h, d), v.reshape(-1, h, d)]))
    return t[0].view(nb, bs // TILE, h, TILE, d), t[1].view(nb, bs // TILE, h, TILE, d)


def _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, mods, tol) -> None:
    """``attend(q, tables, lens, starts)`` against the float32 reference with ``mods``
    over k, v (which differs from the unmodified one), and each sequence's last row
    alone equal to its row in the batch."""
    d = q.shape[-1]
    out = attend(q, tables, lens, starts)
    for s, (ctx, n) in enumerate(seqs):
        qs, rows = q[starts[s] : starts[s + 1]], out[starts[s] : starts[s + 1]]
        args = (qs, k, v, tables[s].tolist(), ctx, n, bs, *window, d**-0.5)
        ref = attention_reference(*args, **mods)
        assert (rows.float() - ref).abs().max().item() < tol
        assert (attention_reference(*args) - ref).abs().max().item() > 10 * tol  # it mattered
        one = torch.tensor([0, 1])
        alone = attend(qs[n - 1 :], tables[s : s + 1], torch.tensor([ctx]), one)
        assert torch.equal(alone[0].float(), rows[n - 1].float()), s


SEQS = st.lists(st.tuples(st.integers(8, 90), st.integers(0, 89)), min_size=1, max_size=4)


@settings(max_examples=16, deadline=None)
@given(
    mod=st.sampled_from(MODS),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    heads=st.sampled_from([(4, 4), (6, 2), (8, 1)]),
    d=st.sampled_from([32, 64]),
    window=st.sampled_from([(0, 0), (20, 4)]),
    layout=st.sampled_from(["rows", "tiles"]),
    seqs=SEQS,
    seed=st.integers(0, 2**16),
)
def test_cpu_kernel_modifies_scores_and_stays_invariant(
    mod, dtype, heads, d, window, layout, seqs, seed
):
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
    mods = _mods(mod, hq, g)
    kc, vc = _tiles(k, v) if layout == "tiles" else (k, v)

    def attend(q_, t, lens_, starts_):
        return _cpu(q_, kc, vc, t, lens_, starts_, window, mods)

    tol = 2e-5 if dt == torch.float32 else 3e-2
    with amx_switched(torch.ops.kvserve.attention_use_amx, "amx"):
        _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, mods, tol)


@pytest.mark.parametrize("mod", MODS)
def test_cpu_kernel_over_int8_caches(mod):
    """int8 codes with per-token scales: the dequantized scores are modified."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    seqs, nb, tables, lens, starts = paged_batch([(40, 5), (70, 0), (17, 16)], 16, g)
    kq, vq, scales, kf, vf = quantized_blocks("int8", nb, 16, g)
    q = (torch.randn(int(starts[-1]), 4, 64, generator=g) * 2).bfloat16()
    mods = _mods(mod, 4, g)

    def attend(q_, t, lens_, starts_):
        return _cpu(q_, kq, vq, t, lens_, starts_, (0, 0), mods, scales)

    _check(attend, q, kf, vf, seqs, tables, lens, starts, 16, (0, 0), mods, 3e-2)


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


@pytest.mark.parametrize("mod", MODS)
def test_sdpa_backend(mod):
    """The torch backend computes the modified scores itself (SDPA has no argument for
    either), masked or causal."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 32, generator=g) * 2
    k = torch.randn(2, 2, 9, 32, generator=g) * 2
    v = torch.randn(2, 2, 9, 32, generator=g)
    mods = _mods(mod, 4, g)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)

    def want(mask, n):
        s = q @ kk[:, :, :n].transpose(-1, -2) * 32**-0.5
        if "softcap" in mods:
            s = torch.tanh(s / CAP) * CAP
        s = s.masked_fill(~mask, float("-inf"))
        if "sink_logits" in mods:
            col = mods["sink_logits"].view(1, 4, 1, 1).expand(2, 4, 3, 1)
            return torch.cat([s, col], -1).softmax(-1)[..., :-1] @ vv[:, :, :n]
        return s.softmax(-1) @ vv[:, :, :n]

    args = (mods.get("softcap", 0.0), mods.get("sink_logits"))
    mask = torch.ones(3, 9, dtype=torch.bool).tril(6)
    got = _sdpa(q, k, v, mask, False, 32**-0.5, *args)
    assert (got - want(mask, 9)).abs().max().item() < 1e-5
    assert (_sdpa(q, k, v, mask, False, 32**-0.5, 0.0) - got).abs().max().item() > 1e-2
    causal = _sdpa(q, k[:, :, :3], v[:, :, :3], None, True, 32**-0.5, *args)
    tril = torch.ones(3, 3, dtype=torch.bool).tril()
    assert (causal - want(tril, 3)).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("mod", "window", "split_kv"),
    [("softcap", (0, 0), False), ("softcap", (20, 4), False), ("sinks", (0, 0), False),
     ("sinks", (0, 0), True), ("both", (20, 4), True)],
)  # fmt: skip
def test_triton_kernel(mod, window, split_kv):
    """Whole and split-KV (the merge kernel adds the sinks after every split; 600
    positions are two splits)."""
    from kvserve.model import triton_attention as ta

    g = torch.Generator().manual_seed(11)
    bs = 16
    lengths = [(600, 1), (70, 1), (17, 1)] if split_kv else [(40, 5), (70, 0), (17, 16)]
    seqs, nb, tables, lens, starts = paged_batch(lengths, bs, g)
    k = torch.randn(nb, bs, 2, 32, generator=g) * 2
    v = torch.randn(nb, bs, 2, 32, generator=g)
    q = torch.randn(int(starts[-1]), 4, 32, generator=g) * 2
    mods = _mods(mod, 4, g)

    def attend(q_, t, lens_, starts_):
        kk, vv = k.reshape(-1, 2, 32), v.reshape(-1, 2, 32)
        return ta.paged_attention(
            q_, kk, vv, t, lens_, starts_, 32**-0.5, *window, block_size=bs, split_kv=split_kv,
            softcap=mods.get("softcap", 0.0), sink_logits=mods.get("sink_logits"),
        )  # fmt: skip

    _check(attend, q, k, v, seqs, tables, lens, starts, bs, window, mods, 2e-5)
