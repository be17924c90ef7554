"""A MoE layer's experts in one C++ call (``moe_experts``, ``mlp.ExpertKernel``): the same
bits as the loop over the experts' own kernel modules, for decode-sized groups (run
expert-parallel) and prefill-sized ones (one expert after another), with AMX's GEMM and
with AVX-512-BF16's; and the engine takes it for bf16 experts on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import amx_switched, make_engine

from kvserve.model.linear import KernelGateUpSilu, kernel_gemm_preferred, prepack_linears
from kvserve.model.mlp import MLP, ExpertKernel, SparseMoE
from kvserve.model.ops import TorchOps
from kvserve.model.spec import load_model_spec

HIDDEN, INTER, EXPERTS = 128, 64, 12


@pytest.fixture(scope="module")
def spec(model_dirs):
    return load_model_spec(model_dirs["qwen3_moe"])


def _experts(spec, bias: bool) -> torch.nn.ModuleList:
    """bf16 experts as the engine holds them after ``prepack_linears``."""
    torch.manual_seed(0)
    shape = dataclasses.replace(spec, hidden_size=HIDDEN, intermediate_size=INTER, mlp_bias=bias)
    experts = torch.nn.ModuleList(MLP(shape, TorchOps(), None) for _ in range(EXPERTS))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    experts.bfloat16()
    assert prepack_linears(experts) == 2 * EXPERTS
    return experts


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gemm", ["amx", "avx512"])
@pytest.mark.parametrize("counts", [[1, 0, 3, 2, 1, 0, 4, 1, 1, 2, 0, 1], [0] * 11 + [5],
                                    [70, 3, 0, 128, 9, 1, 0, 0, 2, 64, 65, 1]])  # fmt: skip
def test_one_call_gives_the_loops_bits(spec, bias, gemm, counts):
    if not kernel_gemm_preferred(torch.bfloat16, torch.device("cpu")):
        pytest.fail("this machine's CPU kernels lack AVX-512-BF16: nothing to check")
    experts = _experts(spec, bias)
    assert isinstance(experts[0].gate_up_proj, KernelGateUpSilu)
    kernel = ExpertKernel.of(experts)
    assert kernel is not None
    x = (torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(1))).bfloat16()
    with amx_switched(torch.ops.kvserve.bf16_gemm_use_amx, gemm):
        got = kernel(x, counts)
        parts, start = [], 0
        for e, n in zip(experts, counts, strict=True):
            if n:
                parts.append(e(x[start : start + n]))
                start += n
    assert torch.equal(got, torch.cat(parts))


def test_other_experts_keep_the_loop(spec):
    """Experts not all on the bf16 kernels (one left a float ``nn.Linear`` here, or
    gpt-oss's clamped SwiGLU): no kernel, the loop runs."""
    experts = _experts(spec, False)
    experts[1].down_proj = torch.nn.Linear(INTER, HIDDEN)
    assert ExpertKernel.of(experts) is None


def test_the_engine_routes_bf16_experts_through_one_call(model_dirs):
    spec = load_model_spec(model_dirs["qwen3_moe"])
    bf16 = make_engine(model_dirs["qwen3_moe"], dtype="bfloat16")
    f32 = make_engine(model_dirs["qwen3_moe"], dtype="float32")
    for i in range(spec.num_layers):
        if spec.is_moe_layer(i):
            assert isinstance(bf16.model.layers[i].mlp, SparseMoE)
            assert bf16.model.layers[i].mlp.expert_kernel is not None
            assert f32.model.layers[i].mlp.expert_kernel is None
