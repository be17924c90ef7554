"""``--quantization int8``: a float checkpoint's projections, embeddings and LM head
quantized at load to int8 with one scale per output row, run against int8 activations with
one scale per token (kernel kind c8, ``csrc/gguf_c8.h``).

The kernel equals its torch reference bit for bit at every batch size, with VNNI or
without; through the whole engine the greedy tokens are the reference's; rows do not
depend on the batch; the error against the bf16 model is that of 8-bit codes; what cannot
run quantized is refused at start."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHS,
    MOE_ARCHS,
    gguf_portable,
    greedy,
    make_engine,
    random_prompts,
    run_to_end,
)

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.fused_stack import FusedStack
from kvserve.model.linear import KernelLinear
from kvserve.model.quantized import INT8, GGUFLinear, pack_int8, unpack_rows
from kvserve.testing.models import VOCAB, build_hf_model

COMMON = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
    bos_token_id=0, eos_token_id=1, num_hidden_layers=2,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    assert load_cpu_kernels()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def bf16_dir(request, tmp_path_factory):
    import transformers as t

    if request.param == "llama":  # untied: an LM head of its own
        config = t.LlamaConfig(**COMMON, tie_word_embeddings=False)
    else:  # Q/K/V biases, tied embeddings
        config = t.Qwen2Config(**COMMON, tie_word_embeddings=True)
    root = tmp_path_factory.mktemp(request.param)
    return request.param, build_hf_model(config, root / "hf", dtype=torch.bfloat16)


def _outputs(engine, prompts, tokens=16):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(tokens))
    return run_to_end(engine)


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 40, 96), (5, 16, 32), (64, 200, 256), (300, 640, 512)]
)
def test_kernel_equals_its_torch_reference_bit_for_bit(m, n, k):
    g = torch.Generator().manual_seed(m)
    lin = GGUFLinear([pack_int8(torch.randn(n, k, generator=g))], torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g) * 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = lin(x.to(dtype))
        assert got.dtype == dtype and torch.equal(got, lin.reference(x.to(dtype)))
    with gguf_portable():
        assert torch.equal(lin(x.bfloat16()), lin.reference(x.bfloat16()))


def test_a_row_never_depends_on_the_other_rows():
    g = torch.Generator().manual_seed(3)
    lin = GGUFLinear([pack_int8(torch.randn(1024, 256, generator=g))])
    x = torch.randn(600, 256, generator=g).bfloat16()
    full = lin(x)
    for rows in ([0], [599], [255, 256], list(range(250, 270)), [3, 400]):
        assert torch.equal(lin(x[rows]), full[rows]), rows


def test_codes_and_scales_are_the_rows_rounded():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(37, 64, generator=g)
    w[5] = 0  # an all-zero row: scale 0, codes 0
    p = pack_int8(w)
    got = unpack_rows(p, torch.arange(37))
    scale = w.abs().amax(1, keepdim=True) / 127
    want = torch.round(w / torch.where(scale > 0, scale, 1)).clamp(-127, 127) * scale
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and not got[5].any()
    assert p.nbytes == 48 * (64 + 4)  # a byte a weight, a float32 scale a row; 16-row groups


def test_greedy_output_equals_the_reference_computation(bf16_dir, monkeypatch):
    _, model_dir = bf16_dir
    prompts = random_prompts([5, 30, 41], seed=4)
    kw = dict(dtype="bfloat16", quantization="int8", max_num_batched_tokens=24,
              kv_cache_memory="16MiB")  # fmt: skip
    engine = make_engine(model_dir, **kw)
    model = engine.runner.model
    assert not any(isinstance(m, torch.nn.Linear | KernelLinear) for m in model.modules())
    assert {p.ggml_type for m in model.modules() for p in getattr(m, "parts", [])} == {INT8}
    assert model.fused_stack is not None  # the C++ loop calls the kernel
    got = _outputs(engine, prompts)
    with monkeypatch.context() as m:
        m.setattr(GGUFLinear, "forward", GGUFLinear.reference)
        m.setattr(FusedStack, "build", classmethod(lambda cls, model: None))
        assert got == _outputs(make_engine(model_dir, **kw), prompts)


def test_int8_stays_close_to_the_float_weights(bf16_dir):
    """Every quantized projection (and LM head) against the same module of the model
    loaded with ``--quantization none``: the error of 8-bit weights and activations."""
    _, model_dir = bf16_dir
    dense = dict(make_engine(model_dir, quantization="none").runner.model.named_modules())
    int8 = make_engine(model_dir, quantization="int8").runner.model
    checked = 0
    for name, module in int8.named_modules():
        if not isinstance(module, GGUFLinear) or name not in dense:
            continue
        g = torch.Generator().manual_seed(1)
        x = torch.randn(6, module.in_features, generator=g).bfloat16()
        with torch.no_grad():
            want, got = dense[name](x).float(), module(x).float()
        if got.shape != want.shape:  # the dense gate/up applies SiLU(gate) * up in its kernel
            gate, up = got.chunk(2, dim=-1)
            got = torch.nn.functional.silu(gate) * up
        err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
        # one scale per row of 128-256 Gaussian weights, one per token: 0.92-1.06 % RMS
        # measured; SiLU(gate) * up compounds two (1.41-1.43 %)
        assert err < (0.02 if "gate_up" in name else 0.013), (name, err)
        checked += 1
    assert checked >= 9  # 2 layers x (Q/K/V, O, gate/up, down), and the LM head if untied


def test_a_request_gets_the_same_tokens_alone_and_in_a_batch(bf16_dir):
    _, model_dir = bf16_dir
    prompts = random_prompts([7, 19, 33, 12, 26], seed=3)
    alone = _outputs(make_engine(model_dir, quantization="int8"), prompts[:1], 24)
    batch = _outputs(make_engine(model_dir, quantization="int8"), prompts, 24)
    assert batch["r0"] == alone["r0"]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_serves_int8_and_keeps_batch_invariance(model_dirs, arch):
    """Each model family's projections quantized (MoE routers and stacked experts kept in
    float), and a request's tokens the same alone and among others."""
    prompts = random_prompts([9, 23, 17, 30], seed=11)
    engine = make_engine(model_dirs[arch], quantization="int8")
    modules = dict(engine.runner.model.named_modules())
    assert any(isinstance(m, GGUFLinear) for m in modules.values())
    routers = [m for n, m in modules.items() if n.endswith((".mlp.gate", "shared_expert_gate"))]
    assert len(routers) > 0 if arch in MOE_ARCHS else not routers
    assert not any(isinstance(m, GGUFLinear) for m in routers)
    batch = _outputs(engine, prompts, 12)
    alone = _outputs(make_engine(model_dirs[arch], quantization="int8"), prompts[2:3], 12)
    assert batch["r2"] == alone["r0"]


def test_a_matrix_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvserve.model.loader import WeightLoadError

    model_dir = build_hf_model("llama", tmp_path / "bad")
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"down_proj\.weight' has shape"):
        make_engine(model_dir, quantization="int8")


def test_what_cannot_run_int8_is_refused_at_start(model_dirs):
    """A GPU; tensor parallelism runs int8 (``tests/worker/test_tp_quantized.py``)."""
    with pytest.raises(ValueError, match="int8 runs on the CPU kernels"):
        make_engine(model_dirs["llama"], quantization="int8", device="cuda")
