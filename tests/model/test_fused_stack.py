"""The decoder stack in one C++ call (``model.fused_stack``) equals the Python layer loop bit
for bit, on every step an engine runs (prefill chunks, decodes, prefix-cache hits), for
plain, int8 and fp8 caches, with QKV bias and a sliding window, and with GGUF weights kept
quantized; models and caches it cannot run take the Python loop."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_writer import write_gguf
from helpers import (
    check_every_forward,
    greedy,
    make_engine,
    random_prompts,
    run_checked,
    run_to_end,
)

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.fused_stack import FusedStack
from kvserve.model.gguf import convert
from kvserve.model.linear import kernel_gemm_preferred
from kvserve.testing.models import build_hf_model

BF16 = torch.bfloat16
OWN_GEMM = kernel_gemm_preferred(BF16, torch.device("cpu"))  # else oneDNN: nothing to fuse


@pytest.mark.parametrize(
    ("kind", "kv"),
    [
        ("llama", "auto"),
        ("llama", "int8"),
        ("mistral", "fp8_e4m3"),
        ("qwen2", "auto"),
        ("qwen3", "auto"),
        ("qwen3", "int8"),
    ],
)
def test_fused_stack_equals_the_python_loop_on_every_step(model_dirs, kind, kv):
    """Chunked prefills beside decodes (16-token budget), then prompts that share a cached
    prefix; mistral has a sliding window of 12 and one KV head, qwen2 has QKV biases,
    qwen3 q/k norms and its own LM head."""
    engine = make_engine(
        model_dirs[kind], dtype="bfloat16", kv_cache_dtype=kv, max_num_batched_tokens=16
    )
    model = engine.runner.model
    if not OWN_GEMM:  # oneDNN's linears: the stack stays in Python
        assert model.fused_stack is None
        return
    assert model.fused_stack is not None
    steps = run_checked(engine, seed=3)
    assert len(steps) > 10 and max(steps) == 16 and min(steps) < 16


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gguf_weights_kept_quantized_run_in_the_stack(model_dirs, tmp_path, ggml_type, dtype):
    """Qwen2 (QKV biases, tied embeddings) from a GGUF file: every linear a GGUFLinear,
    the gate/up one followed by SiLU-and-mul; the stack equals the loop on every step."""
    qt = gguf.GGMLQuantizationType[ggml_type]
    path = write_gguf(model_dirs["qwen2"], tmp_path / f"qwen2-{ggml_type}.gguf", "qwen2", qt)
    engine = make_engine(convert(path), dtype=dtype, max_num_batched_tokens=16)
    model = engine.runner.model
    assert model.fused_stack is not None and min(model.fused_stack.kinds) >= 0
    steps = check_every_forward(model)
    for i, p in enumerate(random_prompts([5, 30, 17], seed=4)):
        engine.add_request(f"q{i}", p, greedy(6))
    assert all(len(v) == 6 for v in run_to_end(engine).values())
    assert len(steps) > 8


def test_a_quantized_linear_of_two_types_runs_in_the_stack(tmp_path):
    """A Q4_K_M-like file (Q/K and the rest Q4_K, V and down Q6_K): the fused Q/K/V has
    two parts, the second a tail of the C++ loop's linear; the stack equals the loop."""
    import transformers as t

    cfg = t.Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
        initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
    )  # fmt: skip
    model_dir = build_hf_model(cfg, tmp_path / "hf")
    q = gguf.GGMLQuantizationType
    six = {"attn_v": q.Q6_K, "ffn_down": q.Q6_K}
    path = write_gguf(model_dir, tmp_path / "q4_k_m.gguf", "qwen2", q.Q4_K, overrides=six)
    engine = make_engine(convert(path), dtype="bfloat16", max_num_batched_tokens=16)
    model = engine.runner.model
    stack = model.fused_stack
    assert stack is not None
    assert stack.kinds[:4] == [3, 3, 3, 4] and stack.tail_kinds[:4] == [4, -1, -1, -1]
    assert stack.tail_rows[0] == 128  # V: 2 KV heads of 64
    steps = check_every_forward(model)
    for i, p in enumerate(random_prompts([5, 30, 17], seed=5)):
        engine.add_request(f"k{i}", p, greedy(6))
    assert all(len(v) == 6 for v in run_to_end(engine).values())
    assert len(steps) > 8


def test_models_and_caches_it_cannot_run_take_the_python_loop(model_dirs):
    assert load_cpu_kernels()
    qwen3 = make_engine(model_dirs["qwen3"], dtype="bfloat16")
    model = qwen3.runner.model
    assert (model.fused_stack is not None) == OWN_GEMM
    if OWN_GEMM:  # q/k norms of another eps than the layer's norms: not one call's constant
        model.layers[1].self_attn.k_norm.eps = 1e-3
        assert FusedStack.build(model) is None
        model.layers[1].self_attn.k_norm.eps = model.layers[1].input_layernorm.eps
        stack = FusedStack.build(model)
        assert stack is not None and stack.qk_norms[2] is model.layers[1].self_attn.q_norm.weight
    fp32 = make_engine(model_dirs["llama"], dtype="float32")  # no packed GEMM
    assert fp32.runner.model.fused_stack is None
    head = make_engine(
        model_dirs["llama"], dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kv_cache_scales="head"
    )
    stack = head.runner.model.fused_stack
    assert (stack is not None) == OWN_GEMM
    if stack is not None:  # head scales are written by Python: the step falls back
        assert stack.cache_args(head.runner.kv_caches) is None
    for e in (qwen3, fp32, head):
        e.add_request("r", list(range(3, 20)), greedy(3))
        assert len(run_to_end(e)["r"]) == 3


def test_bad_arguments_are_refused_with_a_clear_error():
    assert load_cpu_kernels()
    x = torch.zeros(2, 64, dtype=BF16)
    cache = torch.zeros(2, 16, 2, 16, dtype=BF16)
    idx = torch.zeros(2, dtype=torch.long)
    args = [x, idx, x, x, [x] * 5, [None] * 4, [cache], [None], [None], idx]
    rest = [torch.zeros(1, 1, dtype=torch.long), idx[:1], torch.tensor([0, 2])]
    dims = [4, 2, 16, 64, 96, 16]
    tails = ([None] * 12, [-1] * 4, [0] * 4)  # no linear has a second part
    qk = [None] * 2  # no q/k norms
    plain = ([None] * 8, [-1] * 4, *tails, qk)  # every linear bf16
    with pytest.raises(RuntimeError, match="decoder_stack: 1 caches need 6 weights"):
        torch.ops.kvserve.decoder_stack(*args, *rest, dims, 1e-5, 0.25, 0, 0, -1, 1, *plain)
    args[4] = [x] * 6
    with pytest.raises(RuntimeError, match="decoder_stack: dims must be"):
        torch.ops.kvserve.decoder_stack(*args, *rest, [4, 2, 16], 1e-5, 0.25, 0, 0, -1, 1, *plain)
    with pytest.raises(RuntimeError, match="kv_kind"):
        torch.ops.kvserve.decoder_stack(*args, *rest, dims, 1e-5, 0.25, 0, 0, 5, 1, *plain)
    with pytest.raises(RuntimeError, match="4 linear kinds and 8 quantization scales"):
        torch.ops.kvserve.decoder_stack(
            *args, *rest, dims, 1e-5, 0.25, 0, 0, -1, 1, [], [-1], *tails, qk
        )
    with pytest.raises(RuntimeError, match="a quantized linear needs its scales"):
        torch.ops.kvserve.decoder_stack(
            *args, *rest, dims, 1e-5, 0.25, 0, 0, -1, 1, [None] * 8, [0, -1, -1, -1], *tails, qk
        )
    with pytest.raises(RuntimeError, match="4 tail kinds and rows and 12 tail tensors"):
        torch.ops.kvserve.decoder_stack(
            *args, *rest, dims, 1e-5, 0.25, 0, 0, -1, 1, *plain[:2], [None] * 3, [-1] * 4,
            [0] * 4, qk,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="a tail needs a quantized linear"):
        torch.ops.kvserve.decoder_stack(
            *args, *rest, dims, 1e-5, 0.25, 0, 0, -1, 1, *plain[:2], [None] * 12,
            [1, -1, -1, -1], [8, 0, 0, 0], qk,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="decoder_stack: q and k norms come together"):
        torch.ops.kvserve.decoder_stack(
            *args, *rest, dims, 1e-5, 0.25, 0, 0, -1, 1, *plain[:-1], [x[0, :16], None]
        )
    assert FusedStack.build(torch.nn.Linear(2, 2)) is None
