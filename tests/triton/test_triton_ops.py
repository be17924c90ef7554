"""The batch-invariant Triton ops (``--batch-invariant`` on CUDA): RMSNorm (with the
residual add, and over strided heads), SiLU-and-mul, RoPE and the GEMM agree with the
torch reference, and a row computed alone has the bits it has among other rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.ops import TorchOps
from kvserve.model.triton_ops import TritonOps, make_batch_invariant, matmul

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _rand(g, *shape, dt):
    return torch.randn(*shape, generator=g).to(DEV, dt)


@settings(max_examples=6, deadline=None)
@given(dtype=st.sampled_from(sorted(DT)), width=st.sampled_from([64, 100, 576]),
       rows=st.integers(2, 40), seed=st.integers(0, 2**16))  # fmt: skip
def test_elementwise_ops_match_torch_and_are_row_invariant(dtype, width, rows, seed):
    dt, ops, ref = DT[dtype], TritonOps(), TorchOps()
    g = torch.Generator().manual_seed(seed)
    x, res = _rand(g, rows, width, dt=dt), _rand(g, rows, width, dt=dt)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(DEV, dt)
    gate_up = _rand(g, rows, 2 * width, dt=dt)
    tol = TOL[dt]
    norm = ops.rms_norm(x, w, 1e-5)
    assert torch.allclose(norm.float(), ref.rms_norm(x, w, 1e-5).float(), atol=tol, rtol=tol)
    added, new_res = ops.add_rms_norm(x, res.clone(), w, 1e-5)
    want, want_res = ref.add_rms_norm(x, res.clone(), w, 1e-5)
    # the sum rounded once, as torch (the interpreter rounds toward zero: one ulp)
    assert torch.allclose(new_res.float(), want_res.float(), atol=tol, rtol=tol)
    assert torch.allclose(added.float(), want.float(), atol=tol, rtol=tol)
    act = ops.silu_and_mul(gate_up)
    assert torch.allclose(act.float(), ref.silu_and_mul(gate_up).float(), atol=tol, rtol=tol)
    for i in {0, rows // 2, rows - 1}:
        one = slice(i, i + 1)
        assert torch.equal(ops.rms_norm(x[one].clone(), w, 1e-5), norm[one])
        got, got_res = ops.add_rms_norm(x[one].clone(), res[one].clone(), w, 1e-5)
        assert torch.equal(got, added[one]) and torch.equal(got_res, new_res[one])
        assert torch.equal(ops.silu_and_mul(gate_up[one].clone()), act[one])


def test_norm_and_rope_of_strided_heads():
    """q/k views of a fused QKV projection: the per-head norm (Qwen3's q/k norms) and
    RoPE in place, against torch."""
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 9, 6, 2, 32
    qkv = _rand(g, t, (hq + 2 * hkv) * d, dt=torch.bfloat16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DEV, torch.bfloat16)
    got = TritonOps().rms_norm(q, w, 1e-6)
    want = TorchOps().rms_norm(q, w, 1e-6).float()
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)  # (two bf16 roundings)
    pos = torch.randint(0, 100, (t,), generator=g).to(DEV)
    cos, sin = _rand(g, 128, d, dt=torch.bfloat16), _rand(g, 128, d, dt=torch.bfloat16)
    want_q, want_k = TorchOps().rope(pos, q.clone(), k.clone(), cos, sin)
    got_q, got_k = TritonOps().rope(pos, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert torch.allclose(got_q.float(), want_q.float(), atol=6e-2, rtol=2e-2)
    assert torch.allclose(got_k.float(), want_k.float(), atol=6e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(70, 100, 48), (5, 64, 200)])
def test_gemm_matches_torch_and_rows_do_not_depend_on_m(dtype, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(m + n)
    x, w, b = _rand(g, m, k, dt=dtype), _rand(g, n, k, dt=dtype), _rand(g, n, dt=dtype)
    out = matmul(x, w, b)
    want = x.float() @ w.float().T + b.float()
    assert (out.float() - want).abs().max().item() < (0.25 if dtype == torch.bfloat16 else 1e-3)
    for rows in (slice(0, 1), slice(m - 1, m), slice(1, min(m, 33))):
        assert torch.equal(matmul(x[rows], w, b), out[rows])
    assert matmul(x[:0], w).shape == (0, n)


def test_make_batch_invariant_replaces_every_linear(model_dirs):
    from helpers import make_engine

    engine = make_engine(model_dirs["qwen3_moe"], device="cpu", attention_backend="torch")
    model = engine.runner.model
    ids = torch.tensor([3, 5, 7, 11])
    before = model.compute_logits(model.embed_tokens(ids)).clone()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert make_batch_invariant(model) == linears > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    after = model.compute_logits(model.embed_tokens(ids))
    assert torch.allclose(before, after, atol=1e-4)
