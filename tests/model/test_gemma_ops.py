"""Gemma's fused element-wise kernels (``csrc/gemma_ops.cpp``): the norms and GeGLU agree
with the PyTorch reference (``TorchOps``, HF's arithmetic), a row's bits never depend on
its batch, and the q/k norms read strided views of the qkv output in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.ops import CpuKernelOps, TorchOps

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the reference's own magnitude (relative error)."""
    return ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-3)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [16, 100, 640])
def test_gemma_norms_match_reference(dtype, width):
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(width)
    ref, fused = TorchOps(), CpuKernelOps()
    x = (3 * torch.randn(37, width, generator=g)).to(dtype)
    res = torch.randn(37, width, generator=g).to(dtype)
    w = (0.5 * torch.randn(width, generator=g)).to(dtype)  # scaled by 1 + w: may be < 0
    got, want = fused.gemma_rms_norm(x, w, 1e-6), ref.gemma_rms_norm(x, w, 1e-6)
    if dtype == torch.float32:
        assert _ulps(got, want) < 1e-5
    else:  # float math, one rounding at the end, as HF: at most one ulp off on a tie
        assert _ulps(got, want) <= 2**-7 and (got != want).float().mean() < 0.01
    res_f, res_r = res.clone(), res.clone()
    out_f, res_f = fused.gemma_add_rms_norm(x, res_f, w, 1e-6)
    out_r, res_r = ref.gemma_add_rms_norm(x, res_r, w, 1e-6)
    assert torch.equal(res_f, res_r)  # the residual add rounds exactly as PyTorch's
    assert _ulps(out_f, out_r) <= (1e-5 if dtype == torch.float32 else 2**-7)
    assert not torch.equal(res_f, res)  # the residual is updated in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_qk_norm_reads_strided_views(dtype):
    """q and k are views into the qkv projection's rows; the kernel normalises each head
    in place of a copy, as the reference does on the same views."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d = 4, 2, 64
    qkv = torch.randn(9, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = qkv[:, : heads * d].view(9, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(9, kv_heads, d)
    w = (0.3 * torch.randn(d, generator=g)).to(dtype)
    for view in (q, k):
        got = CpuKernelOps().gemma_rms_norm(view, w, 1e-6)
        want = TorchOps().gemma_rms_norm(view.contiguous(), w, 1e-6)
        assert got.shape == view.shape and got.is_contiguous()
        assert _ulps(got, want) <= (1e-5 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [16, 40, 2048])
def test_gelu_tanh_and_mul_matches_reference(dtype, inter):
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(inter)
    gate_up = (2 * torch.randn(33, 2 * inter, generator=g)).to(dtype)
    got = CpuKernelOps().gelu_tanh_and_mul(gate_up)
    want = TorchOps().gelu_tanh_and_mul(gate_up)
    assert got.shape == (33, inter)
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        assert diff.max().item() < 1e-5 * max(1.0, want.abs().max().item())
    else:  # the activation rounded, then the product: each may differ in a last bit
        assert (diff <= 2**-6 * want.float().abs() + 1e-5).all()  # torch: 0 below -5
        assert (diff > 0).float().mean() < 0.03


@settings(max_examples=15, deadline=None)
@given(
    dtype=st.sampled_from(["bfloat16", "float16"]),
    width=st.sampled_from([64, 100, 640, 1152]),
    rows=st.integers(2, 120),
    seed=st.integers(0, 2**16),
)
def test_gemma_kernels_are_row_invariant(dtype, width, rows, seed):
    assert load_cpu_kernels()
    dt, ops = getattr(torch, dtype), CpuKernelOps()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g).to(dt)
    res = torch.randn(rows, width, generator=g).to(dt)
    w = (0.2 * torch.randn(width, generator=g)).to(dt)
    gate_up = torch.randn(rows, 2 * width, generator=g).to(dt)
    full_norm = ops.gemma_rms_norm(x, w, 1e-6)
    full_add, full_res = ops.gemma_add_rms_norm(x, res.clone(), w, 1e-6)
    full_act = ops.gelu_tanh_and_mul(gate_up)
    for i in {0, rows // 3, rows - 1}:
        one = slice(i, i + 1)
        assert torch.equal(ops.gemma_rms_norm(x[one].clone(), w, 1e-6), full_norm[one])
        got, got_res = ops.gemma_add_rms_norm(x[one].clone(), res[one].clone(), w, 1e-6)
        assert torch.equal(got, full_add[one]) and torch.equal(got_res, full_res[one])
        assert torch.equal(ops.gelu_tanh_and_mul(gate_up[one].clone()), full_act[one])


def test_gemma_ops_refuse_bad_layouts():
    assert load_cpu_kernels()
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="w must be"):
        torch.ops.kvserve.gemma_rms_norm(x, torch.zeros(31), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        torch.ops.kvserve.gemma_rms_norm(x.t(), torch.zeros(4), 1e-6)
    with pytest.raises(RuntimeError, match="one shape"):
        torch.ops.kvserve.gemma_add_rms_norm(x, torch.zeros(4, 16), torch.zeros(32), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* inter"):
        torch.ops.kvserve.gelu_tanh_and_mul(torch.zeros(4, 7))
