"""GGUF files served with their Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0 weights kept
quantized: random HF models written by the ``gguf`` writer (``tests/gguf_writer.py``) give,
through the whole engine, the greedy output of the same computation written in torch from
the dequantized codes (``GGUFLinear.reference``: the same activation rounding, the same
float32 steps); rows never depend on the batch; the memory after load is that of the file;
``--quantization none`` dequantizes; and the real SmolLM2 Q4_1 file scores a perplexity
within 1 % of llama.cpp's on the same tokens."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import write_gguf
from helpers import greedy, make_engine, random_prompts, run_to_end
from safetensors import safe_open

from kvserve.evaluation import perplexity, windows
from kvserve.model.fused_stack import FusedStack
from kvserve.model.gguf import convert
from kvserve.model.linear import KernelLinear
from kvserve.model.quantized import GGUFEmbedding, GGUFLinear
from kvserve.testing.models import VOCAB, build_hf_model

TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
COMMON = dict(  # widths of whole Q4_K blocks (256)
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
    bos_token_id=0, eos_token_id=1, num_hidden_layers=2,
)  # fmt: skip


def _config(arch: str):
    import transformers as t

    if arch == "llama":  # untied: a quantized LM head of its own
        return t.LlamaConfig(**COMMON, tie_word_embeddings=False)
    return t.Qwen2Config(**COMMON, tie_word_embeddings=True)  # QKV bias, tied embeddings


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_dir(request, tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    return request.param, build_hf_model(_config(request.param), root / "hf")


def gguf_of(hf_dir: tuple[str, Path], ggml_type: str) -> Path:
    arch, model_dir = hf_dir
    path = model_dir.parent / f"{arch}-{ggml_type}.gguf"
    if not path.exists():
        write_gguf(model_dir, path, arch, gguf.GGMLQuantizationType[ggml_type])
    return path


def greedy_outputs(engine, prompts: list[list[int]], tokens: int = 16) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(tokens))
    return run_to_end(engine)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_converted_directory_keeps_the_blocks(hf_dir, ggml_type):
    path = gguf_of(hf_dir, ggml_type)
    out = convert(path)
    manifest = json.loads((out / "kvserve_quant.json").read_text())
    assert manifest["model.embed_tokens.weight"] == ggml_type
    assert manifest["model.layers.1.mlp.down_proj.weight"] == ggml_type
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "U8"
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"
    # the cache holds the file's blocks (and float32 norms), never float32 matrices
    assert (out / "model.safetensors").stat().st_size < 1.1 * path.stat().st_size


@pytest.mark.parametrize("ggml_type", TYPES)
def test_greedy_output_equals_the_dequantized_weights(hf_dir, ggml_type, monkeypatch):
    """Chunked prefill and decodes mixed, in float32 and in bf16."""
    converted = convert(gguf_of(hf_dir, ggml_type))
    prompts = random_prompts([5, 30, 41], seed=9)
    for dtype in ("float32", "bfloat16"):
        kw = dict(dtype=dtype, max_num_batched_tokens=24, kv_cache_memory="16MiB")
        engine = make_engine(converted, **kw)
        model = engine.runner.model
        kinds = {type(m) for m in model.modules()}
        assert GGUFLinear in kinds and GGUFEmbedding in kinds
        assert not any(isinstance(m, (torch.nn.Linear, KernelLinear)) for m in model.modules())
        got = greedy_outputs(engine, prompts)
        assert model.fused_stack is not None  # the C++ loop calls the kernel
        with monkeypatch.context() as m:
            m.setattr(GGUFLinear, "forward", GGUFLinear.reference)
            m.setattr(FusedStack, "build", classmethod(lambda cls, model: None))
            want = greedy_outputs(make_engine(converted, **kw), prompts)
        assert got == want, dtype


def test_a_request_gets_the_same_tokens_alone_and_in_a_batch(hf_dir):
    converted = convert(gguf_of(hf_dir, "Q4_1"))
    prompts = random_prompts([7, 19, 33, 12, 26], seed=3)
    alone = greedy_outputs(make_engine(converted, dtype="bfloat16"), prompts[:1], 24)
    batch = greedy_outputs(make_engine(converted, dtype="bfloat16"), prompts, 24)
    assert batch["r0"] == alone["r0"]


def test_quantization_none_serves_the_dequantized_weights(hf_dir):
    converted = convert(gguf_of(hf_dir, "Q8_0"))
    engine = make_engine(converted, dtype="bfloat16", quantization="none")
    modules = list(engine.runner.model.modules())
    assert not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in modules)
    assert any(isinstance(m, KernelLinear) for m in modules)
    with pytest.raises(ValueError, match="quantization 'int4' is not one of auto, none"):
        make_engine(converted, quantization="int4")


_RSS_SCRIPT = """
import sys
from kvserve.engine.llm_engine import LLMEngine
from kvserve.config import EngineArgs
from kvserve.model.cpu_kernels import load_cpu_kernels
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def engine(model):
    return LLMEngine(EngineArgs(model=model, kv_cache_memory="16MiB", max_model_len=256))
load_cpu_kernels()
import gguf.quants  # the K-quants' unpacking imports it: ~3 MiB of code, whatever the size
first = engine(sys.argv[2])  # a tiny model first: what every engine imports is loaded
before = rss()
second = engine(sys.argv[1])
print(rss() - before)
"""


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_K"])
def test_memory_after_load_is_the_files(tmp_path, model_dirs, ggml_type):
    """RSS grows by at most 1.25x the file plus the KV cache (bf16 weights: 3.5x)."""
    cfg = dict(COMMON, hidden_size=512, intermediate_size=1536, num_hidden_layers=12)
    cfg.update(num_attention_heads=8, vocab_size=VOCAB)
    import transformers as t

    model_dir = build_hf_model(t.LlamaConfig(**cfg, tie_word_embeddings=False), tmp_path / "hf")
    quant = gguf.GGMLQuantizationType[ggml_type]
    path = write_gguf(model_dir, tmp_path / f"m-{ggml_type}.gguf", "llama", quant)
    converted = convert(path)  # the conversion's memory is not the serving process's
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(converted), str(model_dirs["llama"])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.strip().splitlines()[-1])
    limit = 1.25 * path.stat().st_size + 16 * 2**20
    assert grown <= limit, f"RSS grew {grown / 2**20:.1f} MiB, limit {limit / 2**20:.1f} MiB"


def test_smollm2_q4_1_perplexity_is_within_1_percent_of_llama_cpp(gguf_file):
    """The real model on this repository's architecture notes: kvserve serving the file
    quantized against llama.cpp (``llama-cpp-python``) on the same token ids."""
    from llama_cpp import Llama

    text = Path(__file__).parents[2] / "docs" / "architecture.md"
    engine = make_engine(gguf_file, kv_cache_memory="64MiB", max_model_len=600)
    assert any(isinstance(m, GGUFLinear) for m in engine.runner.model.modules())
    ours = perplexity(engine, [text], 512, max_tokens_per_file=1536, use_tqdm=False)
    ids = engine.tokenize(text.read_text(encoding="utf-8"))[:1536]
    ref = Llama(str(gguf_file), n_ctx=512, n_batch=512, logits_all=True, verbose=False)
    nll: list[float] = []
    for w in windows(ids, 512):
        ref.reset()
        ref.eval(w)
        logits = np.asarray(ref.scores[: len(w)], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll += [lse[i] - logits[i, w[i + 1]] for i in range(len(w) - 1)]
    theirs = math.exp(sum(nll) / len(nll))
    assert len(nll) == ours.num_tokens
    assert abs(ours.perplexity / theirs - 1) <= 0.01, (ours.perplexity, theirs)
