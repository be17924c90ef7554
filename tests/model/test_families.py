"""Per-layer attention windows and the model families beyond Llama's shape.

The HF parity of each family is ``test_model_vs_hf`` (every architecture in ``ARCHS``);
here: how configs with interleaved sliding and global layers and with experts are read, a
Qwen2 whose upper layers slide (``max_window_layers``) against transformers, the GEMMs the
experts run on, and what is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import greedy, hf_greedy, hf_model, make_engine, random_prompts, run_to_end

from kvserve.errors import EngineError
from kvserve.model.parallel import ShardingError, check_shardable
from kvserve.model.spec import ModelConfigError, load_model_spec
from kvserve.testing.models import build_hf_model


def _config(model_dir: Path, tmp_path: Path, **changes) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    out = tmp_path / "m"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _greedy_equals_transformers(
    model_dir: Path, lengths: list[int], n: int, backend: str, **engine_kw
) -> None:
    """Random prompts of ``lengths`` run together, ``n`` greedy tokens each, equal
    transformers' ``generate`` of each alone."""
    engine = make_engine(model_dir, attention_backend=backend, **engine_kw)
    prompts = random_prompts(lengths, seed=len(lengths) + n)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(n))
    out = run_to_end(engine)
    ref = hf_model(model_dir)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(ref, p, n), f"prompt {i}"


def test_gemma3_layers_slide_as_layer_types_say(model_dirs):
    spec = load_model_spec(model_dirs["gemma3"])
    assert spec.hybrid and spec.layer_windows == (12, 0)
    assert spec.sliding_window is None  # not every layer slides: no block is freed
    assert spec.layer_window(0) == 12 and spec.layer_window(1) is None
    assert spec.rope.theta == 1e6 and spec.rope.rope_type == "linear"
    assert spec.local_rope is not None and spec.local_rope.theta == 1e4
    assert spec.attention_scale == 24**-0.5 and spec.final_logit_softcap == 30.0
    assert spec.hidden_act == "gelu_pytorch_tanh" and spec.gemma_norms and spec.qk_norm


def test_gemma3_configs_of_before_layer_types(model_dirs, tmp_path):
    """Hub configs written before ``layer_types``: every 6th layer is global, the local
    base frequency is ``rope_local_base_freq``."""
    cfg = json.loads((model_dirs["gemma3"] / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        cfg.pop(key)
    cfg.update(num_hidden_layers=12, rope_theta=1e6, rope_local_base_freq=1e4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tmp_path)
    assert [i for i, w in enumerate(spec.layer_windows) if not w] == [5, 11]
    assert spec.rope.theta == 1e6 and spec.local_rope is not None
    assert spec.local_rope.theta == 1e4


def test_gemma2_layers_and_soft_capping_as_the_config_says(model_dirs, tmp_path):
    """Gemma 2: the first layer slides, the second attends globally, one rotary base, no
    q/k norms, both soft-capping values; a Hub config written before ``layer_types``
    slides every other layer and takes transformers' defaults for what it leaves out."""
    spec = load_model_spec(model_dirs["gemma2"])
    assert spec.family == "gemma2" and spec.layer_windows == (12, 0)
    assert spec.local_rope is None and not spec.qk_norm and spec.gemma_norms
    assert spec.attn_logit_softcap == 1.0 and spec.final_logit_softcap == 3.0
    assert spec.attention_scale == 24**-0.5 and spec.hidden_act == "gelu_pytorch_tanh"
    cfg = json.loads((model_dirs["gemma2"] / "config.json").read_text())
    for key in ("layer_types", "attn_logit_softcapping", "query_pre_attn_scalar"):
        cfg.pop(key)
    cfg.update(num_hidden_layers=5)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = load_model_spec(tmp_path)
    assert old.layer_windows == (12, 0, 12, 0, 12)
    assert old.attn_logit_softcap == 50.0 and old.attention_scale == 256**-0.5


def test_attention_soft_capping_outside_gemma_is_refused_by_name(model_dirs, tmp_path):
    with pytest.raises(ModelConfigError, match="'attn_logit_softcapping' is not read for"):
        load_model_spec(_config(model_dirs["llama"], tmp_path, attn_logit_softcapping=30.0))


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"layer_types": ["sliding_attention"]}, "'layer_types' must list 2"),
        ({"layer_types": ["local", "global"]}, "'layer_types' must list 2"),
        ({"sliding_window": None}, "'sliding_window'=None must be a positive int"),
        ({"use_bidirectional_attention": True}, "'use_bidirectional_attention'=True"),
        ({"hidden_activation": "relu"}, "'hidden_activation'='relu' is not supported"),
    ],
)
def test_gemma3_config_refusals_name_the_field(model_dirs, tmp_path, changes, words):
    with pytest.raises(ModelConfigError, match=words):
        load_model_spec(_config(model_dirs["gemma3"], tmp_path, **changes))


def test_a_model_wide_window_is_refused_for_a_model_with_its_own(model_dirs):
    with pytest.raises(EngineError, match="1 of 2 layers slide over 12 tokens"):
        make_engine(model_dirs["gemma3"], sliding_window=8)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_qwen2_upper_layers_slide_like_transformers(tmp_path, backend):
    """``use_sliding_window`` with ``max_window_layers=1``: layer 0 sees everything, layer
    1 the last 12 tokens (transformers' reading of the config); prompts longer than that."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=12, max_window_layers=1,
        bos_token_id=0, eos_token_id=1, initializer_range=0.1,
    )  # fmt: skip
    model_dir = build_hf_model(cfg, tmp_path / "qwen2sw")
    spec = load_model_spec(model_dir)
    assert spec.layer_windows == (0, 12)
    _greedy_equals_transformers(model_dir, [40, 25, 9], 16, backend, max_num_batched_tokens=16)


def test_an_unsupported_architecture_is_one_line_and_exit_code_2(tmp_path):
    """``kvserve serve`` on a checkpoint of an architecture it does not run: exit 2, one
    error line naming the architecture and the supported ones, no traceback."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tmp_path), "--port", "8199"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "'FooForCausalLM'" in errors[0] and "Gemma3ForCausalLM" in errors[0]


def test_moe_specs_say_which_layers_route_to_experts(model_dirs):
    qwen = load_model_spec(model_dirs["qwen3_moe"])
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    assert qwen.norm_topk_prob and qwen.qk_norm and qwen.dense_layers == (1,)
    assert [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mixtral = load_model_spec(model_dirs["mixtral"])
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 48)
    assert mixtral.norm_topk_prob and mixtral.dense_layers == ()
    check_shardable(mixtral, 2)  # experts split by their intermediate size
    with pytest.raises(ShardingError, match="experts' intermediate size 48"):
        check_shardable(mixtral, 64)
    qwen2 = load_model_spec(model_dirs["qwen2_moe"])
    assert qwen2.shared_expert_intermediate_size == 48 and not qwen2.norm_topk_prob
    assert qwen2.attention_bias and not qwen2.o_proj_bias
    assert [qwen2.is_moe_layer(i) for i in range(2)] == [False, True]  # sparse step 2


def test_shared_expert_is_batch_invariant_in_bf16(model_dirs):
    """Qwen2-MoE's shared expert and its gate on kvserve's GEMM: a prompt gives the same
    tokens alone and in a batch with others joining and leaving."""
    from helpers import greedy, random_prompts, run_to_end

    from kvserve.model.linear import KernelGateUpSilu
    from kvserve.model.mlp import SparseMoE

    prompts = random_prompts([23, 40, 9, 31], seed=21)
    alone = {}
    for i, p in enumerate(prompts):
        engine = make_engine(model_dirs["qwen2_moe"], dtype="bfloat16")
        engine.add_request(str(i), p, greedy(24))
        alone.update(run_to_end(engine))
    engine = make_engine(model_dirs["qwen2_moe"], dtype="bfloat16", max_num_batched_tokens=48)
    moe = engine.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and moe.shared_expert is not None
    assert isinstance(moe.shared_expert.gate_up_proj, KernelGateUpSilu)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(24))
    assert run_to_end(engine) == alone


def test_bf16_experts_run_on_the_batch_invariant_gemm(model_dirs):
    """Each expert's projections and the router are kvserve's GEMM layers (one call per
    expert over its tokens), the dense layer of the same model too."""
    from kvserve.model.linear import KernelGateUpSilu, KernelLinear, kernel_gemm_preferred
    from kvserve.model.mlp import MLP, SparseMoE

    engine = make_engine(model_dirs["qwen3_moe"], dtype="bfloat16")
    if not kernel_gemm_preferred(torch.bfloat16, torch.device("cpu")):
        pytest.fail("this machine's CPU kernels lack AVX-512-BF16: nothing to check")
    moe, dense = engine.model.layers[0].mlp, engine.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and type(dense) is MLP
    assert isinstance(moe.gate, KernelLinear)
    for expert in moe.experts:
        assert isinstance(expert.gate_up_proj, KernelGateUpSilu) and expert.gate_up_applies_silu
        assert isinstance(expert.down_proj, KernelLinear)
    assert engine.model.fused_stack is None  # its C++ loop runs dense layers only


def _stepwise_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' model run as a server runs it: the prompt, then one token per call
    on its cache (``generate`` differs for Phi-3 past the original context: it re-encodes
    the whole cache with the long factors at the crossing)."""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(torch.tensor([out[-1:]]), cache=step.past_key_values, use_cache=True)
    return out


def test_longrope_switches_to_the_long_factors_past_the_original_context(model_dirs):
    """Phi-3's LongRoPE: a 50-token prompt decoded 30 tokens past the original 64
    positions; every position from 64 on is rotated with the long factors, as
    transformers' model does when it is called step by step."""
    spec = load_model_spec(model_dirs["phi3"])
    assert spec.rope.rope_type == "longrope" and spec.rope.original_max_position_embeddings == 64
    assert spec.fused_checkpoint and spec.sliding_window is None
    engine = make_engine(model_dirs["phi3"])
    prompt = random_prompts([50], seed=6)[0]
    engine.add_request("long", prompt, greedy(30))
    want = _stepwise_greedy(hf_model(model_dirs["phi3"]), prompt, 30)
    assert run_to_end(engine)["long"] == want
    check_shardable(spec, 2)  # the fused tensors split per part (tests/worker)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_dynamic_ntk_rope_past_max_position_embeddings(tmp_path, backend):
    """Dynamic NTK scaling: a 30-token prompt decoded 40 tokens past the model's 48
    positions, each position from 48 on rotated with the base of its own length, as
    transformers' model computes it called step by step."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
        initializer_range=0.1, bos_token_id=0, eos_token_id=1,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )  # fmt: skip
    model_dir = build_hf_model(cfg, tmp_path / "dynamic")
    spec = load_model_spec(model_dir)
    assert spec.rope.rope_type == "dynamic" and spec.rope.original_max_position_embeddings == 48
    engine = make_engine(model_dir, attention_backend=backend, max_model_len=96)
    prompt = random_prompts([30], seed=8)[0]
    engine.add_request("d", prompt, greedy(40))
    assert run_to_end(engine)["d"] == _stepwise_greedy(hf_model(model_dir), prompt, 40)
    # the tables themselves, position by position as transformers grows them (the tiny
    # model's tokens above barely depend on the base)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvserve.model.rope import RotaryEmbedding

    ours = RotaryEmbedding(spec.rope, spec.head_dim, 96, torch.device("cpu"))
    theirs = LlamaRotaryEmbedding(config=hf_model(model_dir).config)
    x = torch.zeros(1, 1, spec.head_dim)
    for p in range(96):
        cos, sin = theirs(x, torch.tensor([[p]]))
        torch.testing.assert_close(ours.cos[p], cos[0, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.sin[p], sin[0, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours.cos[90], torch.cos(90 * torch.cat([ours.inv_freq] * 2)))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_yarn_scaled_qwen2_like_transformers(tmp_path, backend):
    """YaRN (Qwen long-context configs): interpolated low frequencies, a ramp, and the
    cos/sin scale, against transformers."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, initializer_range=0.1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )  # fmt: skip
    model_dir = build_hf_model(cfg, tmp_path / "qwen2yarn")
    spec = load_model_spec(model_dir)
    assert spec.rope.rope_type == "yarn" and spec.rope.factor == 4.0
    _greedy_equals_transformers(model_dir, [90, 7], 12, backend)


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """``Gemma3ForConditionalGeneration`` (Gemma 3 4B and up): the text_config's model,
    the language model's tensors under either transformers' naming, the vision tower's
    skipped; greedy text equals transformers' text-only generation."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        initializer_range=0.1,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5,
        boi_token_index=3, eoi_token_index=4, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model_dir = build_hf_model(cfg, tmp_path / "gemma3mm")
    spec = load_model_spec(model_dir)
    assert spec.multimodal and spec.architecture == "Gemma3ForConditionalGeneration"
    assert spec.layer_windows == (12, 0) and spec.vocab_size == 512
    _greedy_equals_transformers(model_dir, [30, 9], 12, "cpu")
