"""A MoE layer's quantized experts in one C++ call (``moe_experts_quantized``,
``mlp.QuantizedExpertKernel``): experts kept quantized (GGUF blocks, ``--quantization
int8``) give the same bits through the call as through the loop over their
``GGUFLinear`` modules, gate/up in one part or two, with and without biases, SwiGLU and
gpt-oss's clamped SwiGLU, decode-sized groups and prefill-sized ones; and the engine takes
the call for ``--quantization int8``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from helpers import expert_modules, experts_looped, make_engine

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.mlp import ExpertKernel, QuantizedExpertKernel, SparseMoE
from kvserve.model.ops import TorchOps
from kvserve.model.quantized import GGUFLinear, pack, pack_int8
from kvserve.model.spec import load_model_spec

HIDDEN, INTER, EXPERTS = 128, 64, 12


@pytest.fixture(scope="module")
def spec(model_dirs):
    return load_model_spec(model_dirs["qwen3_moe"])


def _gguf(w: torch.Tensor, kind: str) -> object:
    """``w`` ``[n, k]`` as a part of GGML type ``kind`` (the gguf package quantizes)."""
    qtype = GGMLQuantizationType[kind]
    raw = quants.quantize(w.float().numpy(), qtype)
    return pack(np.ascontiguousarray(raw), kind, w.shape[1])


def _experts(spec, bias: bool, layout: str, kind: str = "silu") -> torch.nn.ModuleList:
    """Experts as the engine holds them with quantized weights: gate/up one int8 part
    (``int8``), or gate in Q8_0 and up in Q4_0 (``two``), down int8."""
    experts = expert_modules(spec, HIDDEN, INTER, EXPERTS, bias, kind == "clamped")
    with torch.no_grad():
        for e in experts:
            up, down = e.gate_up_proj, e.down_proj
            w = torch.randn(up.weight.shape) * 0.1
            if layout == "int8":
                parts = [pack_int8(w)]
            else:
                parts = [_gguf(w[:INTER], "Q8_0"), _gguf(w[INTER:], "Q4_0")]
            up_bias = torch.randn(2 * INTER) * 0.01 if bias else None
            e.gate_up_proj = GGUFLinear(parts, up_bias)
            down_bias = torch.randn(HIDDEN) * 0.01 if bias else None
            e.down_proj = GGUFLinear([pack_int8(torch.randn(down.weight.shape) * 0.1)], down_bias)
    return experts


@pytest.mark.parametrize(
    ("layout", "bias", "kind"),
    [("int8", False, "silu"), ("two", True, "silu"), ("int8", True, "clamped")],
)
@pytest.mark.parametrize("counts", [[1, 0, 3, 2, 1, 0, 4, 1, 1, 2, 0, 1], [0] * 11 + [5],
                                    [70, 3, 0, 128, 9, 1, 0, 0, 2, 64, 65, 1]])  # fmt: skip
def test_one_call_gives_the_loops_bits(spec, layout, bias, kind, counts):
    assert load_cpu_kernels()
    experts = _experts(spec, bias, layout, kind)
    assert ExpertKernel.of(experts) is None  # not bf16 GEMM weights
    kernel = QuantizedExpertKernel.of(experts)
    assert kernel is not None and len(kernel.gate_up_ns) == (2 if layout == "two" else 1)
    x = (torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(1))).bfloat16()
    got = kernel(x, counts)
    want = experts_looped(experts, x, counts)
    assert got is not None and torch.equal(got, want)
    assert want.abs().max() > 0  # the experts compute something


def test_mixed_or_torch_experts_keep_the_loop(spec):
    """Experts of different part layouts, or whose activation runs in torch (another
    rounding than the call's): no kernel. gpt-oss's activation in float32: the call
    declines and the caller loops."""
    experts = _experts(spec, False, "int8")
    experts[3] = _experts(spec, False, "two")[3]
    assert QuantizedExpertKernel.of(experts) is None
    torch_ops = _experts(spec, False, "int8")
    torch_ops[0].ops = TorchOps()
    assert QuantizedExpertKernel.of(torch_ops) is None
    clamped = QuantizedExpertKernel.of(_experts(spec, True, "int8", "clamped"))
    assert clamped is not None and clamped(torch.zeros(2, HIDDEN), [2] + [0] * 11) is None


def test_the_engine_routes_int8_experts_through_one_call(model_dirs):
    model = model_dirs["qwen3_moe"]
    spec = load_model_spec(model)
    engine = make_engine(model, dtype="bfloat16", quantization="int8")
    moe = [engine.model.layers[i].mlp for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    assert moe and all(isinstance(m, SparseMoE) for m in moe)
    assert all(isinstance(m.expert_kernel, QuantizedExpertKernel) for m in moe)
