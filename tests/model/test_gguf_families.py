"""GGUF files of every architecture kvserve reads, written from random HF models as
llama.cpp's converter writes them (``tests/gguf_writer.py``, Q8_0 weights): kvserve and
HF transformers' own GGUF loading give the same token ids and the same greedy output
(float32), and the GGUF file gives what its source checkpoint gives.

The shapes follow what transformers can read back from a GGUF file: it takes Qwen3's
head_dim and Qwen3-MoE's expert size from its defaults (128, 768), Qwen2-MoE's expert and
shared expert sizes (1408, 5632), Gemma 3's query scale
from its default (256) and its sliding pattern from its default (every 6th layer global),
Gemma 2's soft-capping from its defaults (50, 30).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf_writer import transformers_from_gguf, write_gguf
from helpers import greedy, hf_greedy, hf_model, make_engine, random_prompts, run_to_end

from kvserve.model.gguf import GGUFError, convert
from kvserve.model.gguf_arch import HF_ARCHITECTURES
from kvserve.model.spec import load_model_spec
from kvserve.model.tokenizer import load_tokenizer
from kvserve.testing.models import VOCAB, build_hf_model

TEXTS = ["Hello, world!", "1234567 + 89 = ?", "  def f(x):\n\treturn x*2  # naïve café"]
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
    bos_token_id=0, eos_token_id=1,
)  # fmt: skip


def _config(arch: str):
    import transformers as t

    if arch == "llama":
        return t.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    if arch == "qwen2":
        return t.Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    if arch == "qwen3":
        return t.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=128)
    if arch == "qwen3moe":
        return t.Qwen3MoeConfig(
            **COMMON, num_hidden_layers=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=768, norm_topk_prob=True,
        )  # fmt: skip
    if arch == "phi3":
        return t.Phi3Config(**COMMON, num_hidden_layers=2, pad_token_id=0)
    if arch == "qwen2moe":
        return t.Qwen2MoeConfig(
            **COMMON, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
            norm_topk_prob=False,
        )  # fmt: skip
    if arch == "gemma2":  # llama.cpp's soft-capping values (transformers' defaults)
        return t.Gemma2Config(
            **COMMON, num_hidden_layers=2, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=12, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        )  # fmt: skip
    return t.Gemma3TextConfig(
        **COMMON, num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=12, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )  # fmt: skip


# (architecture, tokenizer.ggml.pre): Llama 3's and Qwen's pre-tokenizers go through
# transformers' conversion, GPT-2's through kvserve's own
CASES = [
    ("llama", "llama-bpe"),
    ("qwen2", "qwen2"),
    ("qwen3", "default"),
    ("qwen3moe", "qwen2"),
    ("qwen2moe", "qwen2"),
    ("phi3", "default"),
    ("gemma2", "default"),
    ("gemma3", "default"),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path_factory) -> tuple[str, Path, Path]:
    arch, pre = request.param
    root = tmp_path_factory.mktemp(arch)
    model_dir = build_hf_model(_config(arch), root / "hf")
    path = write_gguf(
        model_dir, root / f"{arch}-q8_0.gguf", arch, gguf.GGMLQuantizationType.Q8_0, pre
    )
    return arch, model_dir, path


@pytest.fixture(scope="module")
def hf_from_gguf(case):
    return transformers_from_gguf(case[2])


def test_token_ids_equal_transformers_gguf_loading(case, hf_from_gguf):
    hf_tok, _ = hf_from_gguf
    tok = load_tokenizer(convert(case[2]))
    assert tok is not None
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
            text, add_special_tokens=False
        ), text


def test_greedy_output_equals_transformers_gguf_loading(case, hf_from_gguf):
    """Prompts longer than Gemma's window; chunked prefill and decodes mixed."""
    arch, _, path = case
    _, ref = hf_from_gguf
    converted = convert(path)
    assert load_model_spec(converted).architecture == HF_ARCHITECTURES[arch]
    engine = make_engine(
        converted, dtype="float32", max_num_batched_tokens=24, kv_cache_memory="64MiB",
        quantization="none",  # as transformers reads it: dequantized
    )  # fmt: skip
    prompts = random_prompts([5, 30, 41], seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(12))
    out = run_to_end(engine)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(ref, p, 12), f"{arch} prompt {i}"


def test_the_gguf_file_runs_as_its_source_checkpoint(case):
    """Undoing llama.cpp's changes (permuted Q/K, 1 + w norms, stacked experts) gives the
    source model back: the same greedy text, up to Q8_0's rounding of the weights (the
    comparison is on F32 files, where nothing is rounded)."""
    arch, model_dir, path = case
    f32 = write_gguf(model_dir, path.with_name(f"{arch}-f32.gguf"), arch, pre=case_pre(arch))
    prompt = random_prompts([33], seed=4)[0]
    got = make_engine(convert(f32), dtype="float32", kv_cache_memory="64MiB")
    got.add_request("a", prompt, greedy(16))
    assert run_to_end(got)["a"] == hf_greedy(hf_model(model_dir), prompt, 16)


def case_pre(arch: str) -> str:
    return dict(CASES)[arch]


def test_phi3_longrope_and_window_from_gguf(tmp_path):
    """A Phi-3 file with LongRoPE's factor tensors and a sliding window runs as its source
    checkpoint, past the original context and the window (kvserve on both: the same
    numerics; transformers' GGUF loading reads neither)."""
    import transformers as t

    config = t.Phi3Config(
        **COMMON, num_hidden_layers=2, pad_token_id=0, sliding_window=24,
        original_max_position_embeddings=32,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(8)],
            "long_factor": [1.0 + 2.0 * i for i in range(8)],
        },
    )  # fmt: skip
    model_dir = build_hf_model(config, tmp_path / "hf")
    path = write_gguf(model_dir, tmp_path / "phi3-f32.gguf", "phi3")
    spec = load_model_spec(convert(path))
    assert spec.sliding_window == 24 and spec.rope == load_model_spec(model_dir).rope
    outs = []
    for d in (model_dir, convert(path)):
        engine = make_engine(d, dtype="float32", kv_cache_memory="64MiB")
        for i, p in enumerate(random_prompts([20, 45], seed=6)):
            engine.add_request(f"r{i}", p, greedy(24))
        outs.append(run_to_end(engine))
    assert outs[0] == outs[1]


def test_qwen2_yarn_from_gguf(tmp_path):
    """YaRN in a file's metadata (rope.scaling.type yarn, factor, original context, betas)
    gives the source checkpoint's rotary parameters and greedy text (kvserve on both)."""
    import transformers as t

    config = t.Qwen2Config(
        **COMMON, num_hidden_layers=2, tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0,
        },
    )  # fmt: skip
    model_dir = build_hf_model(config, tmp_path / "hf")
    converted = convert(write_gguf(model_dir, tmp_path / "qwen2-yarn.gguf", "qwen2"))
    got, want = load_model_spec(converted).rope, load_model_spec(model_dir).rope
    assert got == want and got.rope_type == "yarn" and got.beta_fast == 16.0
    outs = []
    for d in (model_dir, converted):
        engine = make_engine(d, dtype="float32", kv_cache_memory="64MiB")
        for i, p in enumerate(random_prompts([20, 45], seed=6)):
            engine.add_request(f"r{i}", p, greedy(16))
        outs.append(run_to_end(engine))
    assert outs[0] == outs[1]


def test_a_tensor_the_architecture_lacks_is_named(tmp_path):
    import numpy as np

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 8)):
        w.add_uint32(f"qwen2.{key}", value)
    w.add_head_count(2)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((24, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_qkv.weight' is not part of a qwen2"):
        convert(path)
