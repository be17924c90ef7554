"""A MoE layer's experts in one C++ call (``moe_experts``, ``mlp.ExpertKernel``): the same
bits as the loop over the experts' own kernel modules (SwiGLU, and gpt-oss's clamped
SwiGLU), for decode-sized groups (run expert-parallel) and prefill-sized ones (one expert
after another), with AMX's GEMM and with AVX-512-BF16's; and the engine takes it for
bf16 experts on the CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import amx_switched, expert_modules, experts_looped, make_engine

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.linear import KernelGateUpSilu, kernel_gemm_preferred, prepack_linears
from kvserve.model.mlp import ExpertKernel, SparseMoE
from kvserve.model.ops import CpuKernelOps, TorchOps
from kvserve.model.spec import load_model_spec

HIDDEN, INTER, EXPERTS = 128, 64, 12


@pytest.fixture(scope="module")
def spec(model_dirs):
    return load_model_spec(model_dirs["qwen3_moe"])


def _experts(spec, bias: bool, kind: str = "silu") -> torch.nn.ModuleList:
    """bf16 experts as the engine holds them after ``prepack_linears``: SwiGLU, or
    gpt-oss's clamped one (a limit these weights reach)."""
    experts = expert_modules(spec, HIDDEN, INTER, EXPERTS, bias, kind == "clamped")
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    experts.bfloat16()
    assert prepack_linears(experts) == 2 * EXPERTS
    return experts


@pytest.mark.parametrize(("kind", "bias"), [("silu", False), ("silu", True), ("clamped", True)])
@pytest.mark.parametrize("gemm", ["amx", "avx512"])
@pytest.mark.parametrize("counts", [[1, 0, 3, 2, 1, 0, 4, 1, 1, 2, 0, 1], [0] * 11 + [5],
                                    [70, 3, 0, 128, 9, 1, 0, 0, 2, 64, 65, 1]])  # fmt: skip
def test_one_call_gives_the_loops_bits(spec, kind, bias, gemm, counts):
    if not kernel_gemm_preferred(torch.bfloat16, torch.device("cpu")):
        pytest.fail("this machine's CPU kernels lack AVX-512-BF16: nothing to check")
    experts = _experts(spec, bias, kind)
    fused = isinstance(experts[0].gate_up_proj, KernelGateUpSilu)
    assert fused == (kind == "silu")
    kernel = ExpertKernel.of(experts)
    assert kernel is not None
    x = (torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(1))).bfloat16()
    with amx_switched(torch.ops.kvserve.bf16_gemm_use_amx, gemm):
        got = kernel(x, counts)
        want = experts_looped(experts, x, counts)
    assert torch.equal(got, want)


def test_other_experts_keep_the_loop(spec):
    """Experts not all on the bf16 kernels (one left a float ``nn.Linear`` here, or a
    clamped SwiGLU whose activation runs in torch): no kernel, the loop runs."""
    experts = _experts(spec, False)
    experts[1].down_proj = torch.nn.Linear(INTER, HIDDEN)
    assert ExpertKernel.of(experts) is None
    clamped = _experts(spec, True, "clamped")
    clamped[0].ops = TorchOps()  # its activation in torch: another rounding than the call's
    assert ExpertKernel.of(clamped) is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_engine_routes_bf16_experts_through_one_call(model_dirs, arch, tmp_path):
    from kvserve.testing.models import build_hf_model

    model = model_dirs.get(arch) or build_hf_model(arch, tmp_path / arch)
    spec = load_model_spec(model)
    bf16 = make_engine(model, dtype="bfloat16")
    f32 = make_engine(model, dtype="float32")
    for i in range(spec.num_layers):
        if spec.is_moe_layer(i):
            assert isinstance(bf16.model.layers[i].mlp, SparseMoE)
            assert bf16.model.layers[i].mlp.expert_kernel is not None
            assert f32.model.layers[i].mlp.expert_kernel is None


def test_the_clamped_swiglu_kernel_computes_the_formula():
    """``CpuKernelOps.clamped_swiglu`` (bf16, rounded once) against the float32 formula."""
    assert load_cpu_kernels()
    x = (torch.randn(37, 96, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    got = CpuKernelOps().clamped_swiglu(x, 1.702, 1.5)
    want = TorchOps().clamped_swiglu(x.float(), 1.702, 1.5)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 48)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)
    assert (want - TorchOps().silu_and_mul(x.float())).abs().max() > 0.5  # it clamps
