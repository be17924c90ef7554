"""The engine on the Triton backend (``--attention-backend triton``; under Triton's
interpreter here): the greedy text of the C++ CPU kernels for dense, sliding-window,
hybrid-layout and MoE models; the same tokens alone, batched and chunked in bf16 (batch
invariance); an int8 cache and a prefix-cache hit; and a clear refusal where it cannot
run."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, make_engine, random_prompts, run_to_end

from kvserve.errors import EngineError

PROMPTS = random_prompts([5, 23, 40])
CUDA = torch.cuda.is_available()  # scripts/gpu_check.sh runs these on a GPU
DEV = "cuda" if CUDA else "cpu"
REF = "torch" if CUDA else "cpu"  # the other backend the text is compared with


def _generate(model_dir, prompts, max_tokens=6, **kwargs) -> list[list[int]]:
    engine = make_engine(model_dir, **kwargs)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(max_tokens))
    done = run_to_end(engine)
    assert engine.kv.check_integrity() is None
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "qwen3_moe"])
def test_greedy_text_equals_the_cpu_kernels(model_dirs, arch):
    kw = dict(dtype="float32", device=DEV)
    got = _generate(model_dirs[arch], PROMPTS, attention_backend="triton", **kw)
    assert got == _generate(model_dirs[arch], PROMPTS, attention_backend=REF, **kw)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_bf16_tokens_do_not_depend_on_the_batch(model_dirs, arch):
    """Each prompt alone, then all together with prefills chunked 16 tokens a step. (On a
    GPU the GEMMs are cuBLAS's, not batch-invariant yet: there the tokens are float32's.)"""
    dtype = "float32" if CUDA else "bfloat16"
    kw = dict(dtype=dtype, device=DEV, attention_backend="triton", enforce_eager=True)
    alone = [_generate(model_dirs[arch], [p], 8, **kw)[0] for p in PROMPTS]
    assert _generate(model_dirs[arch], PROMPTS, 8, max_num_batched_tokens=16, **kw) == alone


def test_int8_cache_and_a_prefix_hit(model_dirs):
    """An int8 cache written and read by the Triton kernels gives the C++ kernels' text;
    a second request with the same prompt hits the prefix cache and repeats it."""
    kw = dict(dtype="float32", device=DEV, kv_cache_dtype="int8", kv_cache_smooth_k=False)
    prompt = random_prompts([37], seed=5)[0]
    want = _generate(model_dirs["llama"], [prompt], attention_backend=REF, **kw)
    engine = make_engine(model_dirs["llama"], attention_backend="triton", **kw)
    outs = []
    for i in range(2):
        engine.add_request(str(i), prompt, greedy(6))
        req = engine.requests[str(i)]
        outs.append(run_to_end(engine)[str(i)])
    assert outs == want * 2
    assert req.num_cached_tokens == 32  # the second request: two full blocks were hits


def test_refused_on_cpu_without_the_interpreter(model_dirs, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(EngineError, match=r"attention_backend 'triton'.*TRITON_INTERPRET"):
        make_engine(model_dirs["llama"], device="cpu", attention_backend="triton")


@pytest.mark.parametrize("arch", ["qwen3_moe"])  # a dense layer and an MoE layer
def test_batch_invariant_mode_keeps_bf16_tokens_whatever_the_batch(model_dirs, arch):
    """--batch-invariant: the Triton GEMMs and norms replace torch's (on a GPU: cuBLAS's),
    and in bf16 each prompt's tokens alone equal its tokens batched and chunked."""
    kw = dict(dtype="bfloat16", device=DEV, attention_backend="triton", batch_invariant=True)
    kw["enforce_eager"] = True
    engine = make_engine(model_dirs[arch], **kw)
    assert engine.batch_invariant
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.runner.model.modules())
    alone = [_generate(model_dirs[arch], [p], 6, **kw)[0] for p in PROMPTS]
    assert _generate(model_dirs[arch], PROMPTS, 6, max_num_batched_tokens=16, **kw) == alone


def test_batch_invariant_mode_needs_triton_or_the_cpu_kernels(model_dirs):
    with pytest.raises(EngineError, match="batch_invariant needs the Triton"):
        make_engine(model_dirs["llama"], attention_backend="torch", batch_invariant=True)
    engine = make_engine(model_dirs["llama"], device="cpu", batch_invariant=True)  # C++ kernels
    assert engine.batch_invariant
