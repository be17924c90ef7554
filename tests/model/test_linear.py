"""Prepacked linear layers (oneDNN's, and kvserve's own bf16 GEMM): same values as
F.linear, batch-invariant rows, and only where they apply (bf16/fp16 on a CPU with native
kernels)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import pytest
import torch
import torch.nn.functional as F
from helpers import amx_switched, greedy, make_engine, run_to_end
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.linear import (
    KernelGateUpSilu,
    KernelLinear,
    PackedLinear,
    kernel_gemm_preferred,
    prepack_linears,
    prepack_supported,
)

BF16 = torch.bfloat16
CLASSES = [PackedLinear, KernelLinear]
AMX = load_cpu_kernels() and bool(torch.ops.kvserve.bf16_gemm_amx())
# kvserve's GEMM has two kernels: AVX-512-BF16 dot products, and AMX tiles where the CPU
# has them; on an AMX machine the tests run both.
KERNELS = ["avx512", "amx"] if AMX else ["avx512"]
# oneDNN's rows are batch invariant only without AMX: its tile kernels sum K in an order
# that depends on M (measured: a few rows of 33 or 100 differ from the row computed alone)
INVARIANT = [KernelLinear] if AMX else [PackedLinear, KernelLinear]


def kernel(name: str) -> AbstractContextManager[None]:
    """Within the block kvserve's GEMM runs the kernel ``name`` ("amx" or "avx512")."""
    return amx_switched(torch.ops.kvserve.bf16_gemm_use_amx, name)


def test_this_machine_runs_the_packed_path():
    """CI's machines have AVX-512 with bf16 instructions: both packed paths run here, and
    the one the engine picks is the one that is measured."""
    assert prepack_supported(BF16, torch.device("cpu"))
    assert not prepack_supported(torch.float32, torch.device("cpu"))
    assert load_cpu_kernels() and torch.ops.kvserve.bf16_gemm_available()
    assert not kernel_gemm_preferred(torch.float16, torch.device("cpu"))
    assert not kernel_gemm_preferred(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("name", KERNELS)
def test_packed_linear_matches_f_linear_with_and_without_bias(cls, name):
    torch.manual_seed(0)
    for bias in (False, True):
        # 37: a partial last block of 16 columns; K = 96, 70: one tile step and 16 pairs or
        # 3 pairs past it (the AMX kernel's vdpbf16ps tail), 2: no tile step at all
        for n, k in ((160, 96), (37, 96), (37, 70), (48, 2)):
            lin = nn.Linear(k, n, bias=bias).to(BF16)
            packed = cls(lin)
            x = torch.randn(40, k, dtype=BF16)
            want = F.linear(
                x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()
            )
            with kernel(name):
                got = packed(x).float()
            assert got.shape == (40, n)
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_kernel_linear_takes_any_leading_shape_strided_rows_and_no_rows():
    torch.manual_seed(1)
    lin = nn.Linear(64, 48, bias=True).to(BF16)
    packed = KernelLinear(lin)
    x = torch.randn(2, 5, 64, dtype=BF16)
    assert torch.equal(packed(x), packed(x.reshape(10, 64)).view(2, 5, 48))
    wide = torch.randn(6, 128, dtype=BF16)
    strided = wide[:, ::2]  # column stride 2: copied to contiguous rows first
    assert torch.equal(packed(strided), packed(strided.contiguous()))
    padded_rows = wide[:, :64]  # row stride 128, unit column stride: read in place
    assert torch.equal(packed(padded_rows), packed(padded_rows.contiguous()))
    assert packed(torch.empty(0, 64, dtype=BF16)).shape == (0, 48)


def test_kernel_gemm_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="even in_features"):
        KernelLinear(nn.Linear(63, 16).to(BF16))
    wp = torch.ops.kvserve.bf16_pack_weight(torch.randn(16, 64, dtype=BF16))
    with pytest.raises(RuntimeError, match="bf16 with contiguous rows"):
        torch.ops.kvserve.bf16_linear(torch.randn(2, 64), wp, None, 16)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.kvserve.bf16_linear(torch.randn(2, 32, dtype=BF16), wp, None, 16)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvserve.bf16_linear(
            torch.randn(2, 64, dtype=BF16), wp, torch.zeros(16, dtype=BF16), 16
        )


def test_odd_in_features_keep_onednn_when_the_kernel_is_preferred(monkeypatch):
    import kvserve.model.linear as linear

    monkeypatch.setattr(linear, "kernel_gemm_preferred", lambda dtype, device: True)
    model = nn.Sequential(nn.Linear(64, 63), nn.Linear(63, 8)).to(BF16)
    assert prepack_linears(model) == 2
    assert isinstance(model[0], KernelLinear) and isinstance(model[1], PackedLinear)


@settings(max_examples=12, deadline=None)
@given(
    k=st.sampled_from([64, 70, 576, 1536, 2048, 3072]),
    n=st.sampled_from([64, 576, 960, 200]),
    bias=st.booleans(),
    m=st.integers(2, 300),
    seed=st.integers(0, 2**16),
    cls=st.sampled_from(INVARIANT),
    name=st.sampled_from(KERNELS),
)
def test_a_row_does_not_depend_on_the_batch_it_is_in(k, n, bias, m, seed, cls, name):
    """Batch-invariant rows, bit for bit: each row of an M-row batch equals the row computed
    alone (M = 1, which oneDNN runs with another kernel from K = 1536) and within a batch
    of any other size (the engine's determinism rests on this)."""
    torch.manual_seed(seed)
    packed = cls(nn.Linear(k, n, bias=bias).to(BF16))
    x = torch.randn(m, k, dtype=BF16)
    with kernel(name):
        full = packed(x)
        for i in (0, m // 2, m - 1):
            assert torch.equal(packed(x[i : i + 1]), full[i : i + 1]), (k, n, m, i)
        cut = max(1, m // 3)
        assert torch.equal(packed(x[:cut].contiguous()), full[:cut])


@pytest.mark.parametrize("m", [61, 64, 65, 100, 129, 200, 241, 300, 1000])
@pytest.mark.parametrize("name", KERNELS)
def test_every_row_survives_the_products_chunking_and_split(m, name):
    """Products of 2-4 row chunks take near-equal chunks in panel-major order, larger ones
    chunks of 60/64 rows, and either splits its items over the threads by rows; every row
    equals the row computed in a single-chunk batch of 40 rows, for the plain GEMM and the
    fused gate/up + SiLU one."""
    assert load_cpu_kernels()
    torch.manual_seed(m)
    plain = KernelLinear(nn.Linear(576, 960, bias=True).to(BF16))
    fused = KernelGateUpSilu(nn.Linear(576, 2 * 1536, bias=False).to(BF16))
    x = torch.randn(m, 576, dtype=BF16)
    for layer in (plain, fused):
        with kernel(name):
            full = layer(x)
            pieces = torch.cat([layer(x[i : i + 40].contiguous()) for i in range(0, m, 40)])
        assert torch.equal(full, pieces), (type(layer).__name__, m)


@settings(max_examples=12, deadline=None)
@given(
    k=st.sampled_from([64, 70, 576, 1536]),
    inter=st.sampled_from([16, 48, 80, 1536]),
    bias=st.booleans(),
    m=st.integers(1, 150),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(KERNELS),
)
def test_fused_gate_up_silu_is_the_unfused_pair_bit_for_bit(k, inter, bias, m, seed, name):
    """KernelGateUpSilu = silu_and_mul(KernelLinear(gate_up)(x)) exactly, and its rows are
    batch invariant like the plain GEMM's."""
    from kvserve.model.ops import CpuKernelOps

    torch.manual_seed(seed)
    lin = nn.Linear(k, 2 * inter, bias=bias).to(BF16)
    fused, plain = KernelGateUpSilu(lin), KernelLinear(lin)
    assert fused.out_features == inter
    x = torch.randn(m, k, dtype=BF16) * 2
    with kernel(name):
        got = fused(x)
        assert got.shape == (m, inter)
        assert torch.equal(got, CpuKernelOps().silu_and_mul(plain(x)))
        for i in (0, m // 2, m - 1):
            assert torch.equal(fused(x[i : i + 1]), got[i : i + 1]), (k, inter, m, i)
        assert torch.equal(fused(x.view(1, m, k)), got.view(1, m, inter))


def test_fused_gate_up_silu_refuses_shapes_it_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        KernelGateUpSilu(nn.Linear(64, 2 * 40).to(BF16))
    with pytest.raises(ValueError, match="even in_features"):
        KernelGateUpSilu(nn.Linear(63, 64).to(BF16))
    wp = torch.ops.kvserve.bf16_pack_weight(torch.randn(64, 64, dtype=BF16))
    x = torch.randn(2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.kvserve.bf16_linear_silu_mul(x, wp, None, 24)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.kvserve.bf16_linear_silu_mul(x, wp, None, 16)
    with pytest.raises(RuntimeError, match="bias must be \\[64\\] float32"):
        torch.ops.kvserve.bf16_linear_silu_mul(x, wp, torch.zeros(16), 32)


def test_prepack_fuses_only_the_linear_a_module_names(monkeypatch):
    import kvserve.model.linear as linear

    class Block(nn.Module):
        silu_fusable = "up"

        def __init__(self):
            super().__init__()
            self.up, self.other = nn.Linear(64, 64), nn.Linear(64, 64)
            self.gate_up_applies_silu = False

    monkeypatch.setattr(linear, "kernel_gemm_preferred", lambda dtype, device: True)
    block = Block().to(BF16)
    assert prepack_linears(block) == 2
    assert isinstance(block.up, KernelGateUpSilu) and block.gate_up_applies_silu
    assert isinstance(block.other, KernelLinear)
    monkeypatch.setattr(linear, "kernel_gemm_preferred", lambda dtype, device: False)
    onednn = Block().to(BF16)
    prepack_linears(onednn)
    assert isinstance(onednn.up, PackedLinear) and not onednn.gate_up_applies_silu


def test_float32_models_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert prepack_linears(model) == 0
    assert all(isinstance(m, nn.Linear) for m in (model[0], model[2]))


def test_bf16_engine_packs_every_projection_and_the_tied_head(model_dirs):
    engine = make_engine(model_dirs["llama"], dtype="bfloat16")
    model = engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    layer = model.layers[0]
    picked = KernelLinear if kernel_gemm_preferred(BF16, torch.device("cpu")) else PackedLinear
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(lin, picked)
    fused = picked is KernelLinear
    assert isinstance(layer.mlp.gate_up_proj, KernelGateUpSilu if fused else PackedLinear)
    assert layer.mlp.gate_up_applies_silu == fused
    assert model.lm_head is not None or isinstance(model.lm_head_packed, picked)
    assert (model.lm_head is None) == (model.lm_head_packed is not None)
    torch_engine = make_engine(model_dirs["llama"], dtype="bfloat16", attention_backend="torch")
    assert isinstance(torch_engine.runner.model.layers[0].mlp.down_proj, nn.Linear)
    prompt = list(range(3, 40))
    hidden = torch.randn(4, model.spec.hidden_size, dtype=BF16)
    torch.testing.assert_close(
        model.compute_logits(hidden),
        torch_engine.runner.model.compute_logits(hidden),
        atol=0.05,
        rtol=0.02,
    )
    for e in (engine, torch_engine):
        e.add_request("r", prompt, greedy(4))
        assert len(run_to_end(e)["r"]) == 4
