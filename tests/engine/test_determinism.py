"""Deterministic by construction in bfloat16 (the serving default): 32 seeded sampled
requests give identical tokens whether they run one by one, 4 or 32 at a time, with a
64-token step budget (chunked prefill) or the default 2048, with the prefix cache cold or
warm, with prefixes restored from the KV store (file tier, Redis), and when forced through
recompute and swap preemption. Both the bundled model and the real SmolLM2-135M-Instruct
checkpoint, a Gemma-3-shaped one (sliding and global layers, GeGLU, its norms), a
Gemma-2-shaped one (the same, with soft-capped attention scores and logits) and a
Qwen3-MoE-shaped one (routed experts); the reference is always the one-by-one run."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from helpers import make_engine, run_to_end

from kvserve.default_model import DEFAULT_MODEL_DIR
from kvserve.model.gguf import convert
from kvserve.model.spec import load_model_spec
from kvserve.sampling import SamplingParams
from kvserve.testing.redis_procs import redis_server

N = 32
MAX_TOKENS = 24
ROOMY = "256MiB"


@pytest.fixture(scope="module", params=["bundled", "smollm2", "gemma2", "gemma3", "qwen3_moe"])
def model(request, gguf_file, model_dirs) -> Path:
    if request.param in model_dirs:
        return model_dirs[request.param]
    return DEFAULT_MODEL_DIR if request.param == "bundled" else convert(gguf_file)


def _prompts(model_dir: Path) -> list[list[int]]:
    """Four groups sharing a 48-token prefix (three blocks), each with its own tail."""
    vocab = min(load_model_spec(model_dir).vocab_size, 4000)
    g = torch.Generator().manual_seed(7)
    prefixes = [torch.randint(3, vocab, (48,), generator=g).tolist() for _ in range(4)]
    return [
        prefixes[i % 4] + torch.randint(3, vocab, (3 + (i * 11) % 40,), generator=g).tolist()
        for i in range(N)
    ]


def _params(i: int) -> SamplingParams:
    extra = [{}, {"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}][i % 4]
    return SamplingParams(
        temperature=0.8, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True, **extra
    )


def _generate(engine, prompts: list[list[int]], group: int) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for start in range(0, N, group):
        for i in range(start, min(N, start + group)):
            engine.add_request(str(i), prompts[i], _params(i))
        out.update({int(k): v for k, v in run_to_end(engine).items()})
    return [out[i] for i in range(N)]


def _engine(model_dir: Path, **kw):
    kw.setdefault("kv_cache_memory", ROOMY)
    return make_engine(model_dir, dtype="bfloat16", max_model_len=256, **kw)


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """One request at a time, no prefix cache: nothing shares a step or a block."""
    return _generate(_engine(model, enable_prefix_caching=False), _prompts(model), 1)


def _differ(got: list[list[int]], want: list[list[int]]) -> list[int]:
    return [i for i in range(N) if got[i] != want[i]]


def test_batch_size_does_not_change_the_text(model, reference):
    engine = _engine(model, enable_prefix_caching=False)
    for group in (4, N):
        assert _differ(_generate(engine, _prompts(model), group), reference) == [], group


def test_chunked_prefill_budget_does_not_change_the_text(model, reference):
    engine = _engine(model, enable_prefix_caching=False, max_num_batched_tokens=64)
    assert _differ(_generate(engine, _prompts(model), N), reference) == []


def test_prefix_cache_cold_and_warm_does_not_change_the_text(model, reference):
    engine = _engine(model)
    cold = _generate(engine, _prompts(model), 1)  # later prompts hit earlier ones' blocks
    hits = engine.kv.stats.hits
    assert hits >= (N - 4) * 48
    warm = _generate(engine, _prompts(model), N)
    assert engine.kv.stats.hits > hits
    assert _differ(cold, reference) == [] and _differ(warm, reference) == []


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_does_not_change_the_text(model, reference, mode):
    spec = load_model_spec(model)
    block = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2 * 16
    engine = _engine(
        model, kv_cache_memory=24 * block, preemption_mode=mode, enable_prefix_caching=False
    )
    got = _generate(engine, _prompts(model), N)
    assert engine.scheduler.num_preemptions > 0
    assert {m for (m, _, _) in engine.scheduler.preemptions} == {mode}
    assert _differ(got, reference) == []


@pytest.mark.parametrize("tier", ["file", "redis"])
def test_prefixes_restored_from_the_kv_store_do_not_change_the_text(
    model, reference, tmp_path, tier
):
    """A restarted engine takes the shared prefixes from the store (a file tier, a real
    ``redis-server``), not from its own pool."""
    with contextlib.ExitStack() as stack:
        if tier == "file":
            url = f"file://{tmp_path}?capacity=256MiB"
        else:
            server = stack.enter_context(redis_server(tmp_path))
            url = f"redis://127.0.0.1:{server.port}/0"
        first = _engine(model, kv_store=(url,))
        _generate(first, _prompts(model), N)
        first.close()
        second = _engine(model, kv_store=(url,))
        got = _generate(second, _prompts(model), N)
        second.close()
    assert second.offloader.num_loaded_blocks >= 4 * 3
    assert _differ(got, reference) == []
