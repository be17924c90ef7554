"""Row i of a batched result equals the row computed alone, bit for bit, for every
element-wise kernel of the CPU path and for the sampler (random shapes, bf16 and fp16).
The attention kernel and the GEMMs have their own property tests (test_paged_attention,
test_linear); together they make the engine's bf16 output batch-invariant."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.ops import CpuKernelOps
from kvserve.sampling import SampleRow, SamplingParams, sample

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DT)),
    width=st.sampled_from([64, 100, 576, 960, 2000]),
    rows=st.integers(2, 200),
    seed=st.integers(0, 2**16),
)
def test_elementwise_kernels_are_row_invariant(dtype, width, rows, seed):
    assert load_cpu_kernels()
    dt, ops = DT[dtype], CpuKernelOps()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g).to(dt)
    res = torch.randn(rows, width, generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(dt)
    gate_up = torch.randn(rows, 2 * width, generator=g).to(dt)
    full_norm = ops.rms_norm(x, w, 1e-5)
    full_add, full_res = ops.add_rms_norm(x, res.clone(), w, 1e-5)
    full_act = ops.silu_and_mul(gate_up)
    for i in {0, rows // 3, rows - 1}:
        one = slice(i, i + 1)
        assert torch.equal(ops.rms_norm(x[one].clone(), w, 1e-5), full_norm[one])
        got, got_res = ops.add_rms_norm(x[one].clone(), res[one].clone(), w, 1e-5)
        assert torch.equal(got, full_add[one]) and torch.equal(got_res, full_res[one])
        assert torch.equal(ops.silu_and_mul(gate_up[one].clone()), full_act[one])


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(sorted(DT)), rows=st.integers(2, 100), seed=st.integers(0, 2**16))
def test_rope_is_row_invariant(dtype, rows, seed):
    assert load_cpu_kernels()
    dt, ops = DT[dtype], CpuKernelOps()
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(dt)
    pos = torch.randint(0, 500, (rows,), generator=g)
    cos = torch.randn(512, d, generator=g).to(dt)
    sin = torch.randn(512, d, generator=g).to(dt)
    q, k = qkv[:, : hq * d].view(rows, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    full_q, full_k = (t.clone() for t in ops.rope(pos, q.clone(), k.clone(), cos, sin))
    i = rows // 2
    one_q, one_k = ops.rope(pos[i : i + 1], q[i : i + 1].clone(), k[i : i + 1].clone(), cos, sin)
    assert torch.equal(one_q, full_q[i : i + 1]) and torch.equal(one_k, full_k[i : i + 1])


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_sampler_rows_do_not_depend_on_the_batch(rows, seed):
    """Greedy, temperature, top-k, top-p and min-p rows, with logprobs: each row's token and
    logprobs are those it gets alone."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 4096, generator=g) * 4
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.8},
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.9, "min_p": 0.1},
    ]
    specs = [
        SampleRow(SamplingParams(logprobs=2, **kinds[i % 5]), seed + i, 10 + i) for i in range(rows)
    ]
    full = sample(logits.clone(), specs)
    for i in range(rows):
        alone = sample(logits[i : i + 1].clone(), [specs[i]])
        assert alone.token_ids[0] == full.token_ids[i]
        assert alone.logprobs[0] == full.logprobs[i]
