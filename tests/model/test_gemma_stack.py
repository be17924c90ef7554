"""Gemma's decoder layers in one C++ call (``model.gemma_stack``) equal the Python layer loop
bit for bit on every step an engine runs: chunked prefills beside decodes, prefix-cache
hits, prompts past the sliding window, in the hybrid KV layout (each layer's group its own
block tables) and the uniform one, with plain and 8-bit caches, Gemma 3's q/k norms and
sliding-layer rotary base, Gemma 2's score soft-capping, and GGUF weights kept quantized."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_writer import write_gguf
from helpers import greedy, make_engine, run_checked, run_to_end

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.fused_stack import FusedStack
from kvserve.model.gemma_stack import GemmaStack
from kvserve.model.gguf import convert
from kvserve.model.linear import kernel_gemm_preferred

BF16 = torch.bfloat16
OWN_GEMM = kernel_gemm_preferred(BF16, torch.device("cpu"))  # else oneDNN: nothing to fuse


@pytest.mark.parametrize(
    ("kind", "kv", "layout"),
    [
        ("gemma3", "auto", "hybrid"),
        ("gemma3", "int8", "hybrid"),
        ("gemma3", "auto", "uniform"),
        ("gemma2", "fp8_e4m3", "hybrid"),
    ],
)
def test_gemma_stack_equals_the_python_loop_on_every_step(model_dirs, kind, kv, layout):
    engine = make_engine(
        model_dirs[kind], dtype="bfloat16", kv_cache_dtype=kv, kv_layout=layout,
        max_num_batched_tokens=16,
    )  # fmt: skip
    model = engine.runner.model
    if not OWN_GEMM:  # oneDNN's linears: the stack stays in Python
        assert model.fused_stack is None
        return
    stack = model.fused_stack
    assert isinstance(stack, GemmaStack)
    # a sliding layer then a global one: their KV groups (one table for both when the
    # layout is uniform), rotary tables and windows
    local = 1 if kind == "gemma3" else 0  # Gemma 2's layers share one rotary base
    assert stack.layer_info == [1, local, 12, 0, 0, 0, 0, 0]
    assert (stack.qk_norms[0] is not None) == (kind == "gemma3")
    assert stack.softcap == (1.0 if kind == "gemma2" else 0.0)
    steps = run_checked(engine, seed=3)
    assert len(steps) > 10 and max(steps) == 16 and min(steps) < 16


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1"])
def test_gguf_gemma3_weights_kept_quantized_run_in_the_stack(model_dirs, tmp_path, ggml_type):
    qt = gguf.GGMLQuantizationType[ggml_type]
    path = write_gguf(model_dirs["gemma3"], tmp_path / f"gemma3-{ggml_type}.gguf", "gemma3", qt)
    engine = make_engine(convert(path), dtype="bfloat16", max_num_batched_tokens=16)
    stack = engine.runner.model.fused_stack
    assert isinstance(stack, GemmaStack) and min(stack.kinds) >= 0
    assert len(run_checked(engine, seed=4)) > 10


def test_what_the_gemma_stack_cannot_run_takes_the_python_loop(model_dirs):
    assert load_cpu_kernels()
    fp32 = make_engine(model_dirs["gemma3"], dtype="float32")  # no packed GEMM
    assert fp32.runner.model.fused_stack is None
    bf16 = make_engine(model_dirs["gemma3"], dtype="bfloat16")
    model = bf16.runner.model
    assert (model.fused_stack is not None) == OWN_GEMM
    if OWN_GEMM:
        model.layers[1].post_feedforward_layernorm.eps = 1e-3  # norms of two eps
        assert FusedStack.build(model) is None
        model.layers[1].post_feedforward_layernorm.eps = model.layers[0].input_layernorm.eps
        model.layers[1].self_attn.softcap = 5.0  # layers of two soft-caps
        assert FusedStack.build(model) is None
        model.layers[1].self_attn.softcap = 0.0
        assert isinstance(FusedStack.build(model), GemmaStack)
        model.stack_class = FusedStack  # the Llama order never runs Gemma's layers
        assert FusedStack.build(model) is None
    for e in (fp32, bf16):
        e.add_request("r", list(range(3, 20)), greedy(3))
        assert len(run_to_end(e)["r"]) == 3


def _call(**changes):
    x = torch.zeros(2, 64, dtype=BF16)
    cache = torch.zeros(2, 16, 2, 16, dtype=BF16)
    idx = torch.zeros(2, dtype=torch.long)
    args = {
        "x": x, "positions": idx, "rope": [x] * 4, "weights": [x] * 8, "qk_norms": [None] * 2,
        "biases": [None] * 4, "caches": [cache], "scales": [None], "k_shifts": [None],
        "slots": [idx], "tables": [torch.zeros(1, 1, dtype=torch.long)], "lens": idx[:1],
        "query_start": torch.tensor([0, 2]), "dims": [4, 2, 16, 64, 96, 16],
        "layer_info": [0, 0, 0, 0], "eps": 1e-6, "scale": 0.25, "softcap": 0.0, "kv_kind": -1,
        "candidates": 1, "qscales": [None] * 8, "kinds": [-1] * 4, "tails": [None] * 12,
        "tail_kinds": [-1] * 4, "tail_rows": [0] * 4,
    }  # fmt: skip
    args.update(changes)
    return torch.ops.kvserve.gemma_stack(*args.values())


def test_bad_arguments_are_refused_with_a_clear_error():
    assert load_cpu_kernels()
    x = torch.zeros(2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="gemma_stack: 1 caches need 8 weights"):
        _call(weights=[x] * 6)
    with pytest.raises(RuntimeError, match="gemma_stack: rope must be"):
        _call(rope=[x] * 2)
    with pytest.raises(RuntimeError, match="layer 0's KV group 1 has no block table"):
        _call(layer_info=[1, 0, 0, 0])
    with pytest.raises(RuntimeError, match="one slot mapping and one block table per KV group"):
        _call(slots=[])
    with pytest.raises(RuntimeError, match="q and k norms come together"):
        _call(qk_norms=[x[0, :16], None])
    with pytest.raises(RuntimeError, match="gemma_stack: dims must be"):
        _call(dims=[4, 2, 16])
    with pytest.raises(RuntimeError, match="gemma_stack: kv_kind"):
        _call(kv_kind=7)
    with pytest.raises(RuntimeError, match="gemma_stack: a quantized linear needs its scales"):
        _call(kinds=[0, -1, -1, -1])
