"""Our model code against HF transformers, the reference implementation (float32)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHS,
    greedy,
    hf_greedy,
    hf_model,
    make_engine,
    random_prompts,
    run_to_end,
    step_finished,
    step_logits,
)

LENGTHS = [1, 15, 16, 17, 40]  # one token, around one block, more than two blocks
ATOL = 1e-4


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf_for_prefill_and_every_decode_step(model_dirs, arch, backend):
    """Chunked prefill is forced (24-token budget): chunks, decodes and mixes all occur."""
    engine = make_engine(model_dirs[arch], max_num_batched_tokens=24, attention_backend=backend)
    prompts = random_prompts(LENGTHS)
    outputs, steps = step_logits(engine, prompts, 6)
    ref_model = hf_model(model_dirs[arch])
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        assert len(steps[rid]) == 6
        with torch.no_grad():
            ref = ref_model(torch.tensor([p + outputs[rid]])).logits[0]
        for k, ours in enumerate(steps[rid]):
            want = ref[len(p) - 1 + k]
            diff = (ours.cpu() - want).abs().max().item()
            assert diff < ATOL, f"{arch} prompt len {len(p)} step {k}: max |Δlogit| {diff}"
    engine.check_integrity()
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_with_joins_and_leaves_matches_hf_generate(model_dirs, arch):
    """Requests of different lengths and max_tokens; two join mid-batch; chunked prefill."""
    engine = make_engine(model_dirs[arch], max_num_batched_tokens=32)
    prompts = random_prompts([*LENGTHS, 33, 9], seed=7)
    max_tokens = [8, 3, 12, 5, 10, 7, 4]
    first, later = list(range(5)), [5, 6]
    for i in first:
        engine.add_request(f"r{i}", prompts[i], greedy(max_tokens[i]))
    done: dict[str, list[int]] = {}
    for _ in range(3):
        step_finished(engine, done)
    for i in later:
        engine.add_request(f"r{i}", prompts[i], greedy(max_tokens[i]))
    done.update(run_to_end(engine))
    ref_model = hf_model(model_dirs[arch])
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(ref_model, p, max_tokens[i]), f"request {i}"
    engine.check_integrity()
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_mistral_prompt_longer_than_sliding_window(model_dirs):
    spec_window = 12
    engine = make_engine(model_dirs["mistral"], max_num_batched_tokens=16)
    assert engine.spec.sliding_window == spec_window
    prompt = random_prompts([3 * spec_window + 5], seed=3)[0]
    engine.add_request("long", prompt, greedy(20))
    out = run_to_end(engine)["long"]
    assert out == hf_greedy(hf_model(model_dirs["mistral"]), prompt, 20)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(llama_dir, dtype):
    """bf16/fp16 weights load and produce logits near the float32 run (loose bound)."""
    prompts = random_prompts([20], seed=5)
    ref = make_engine(llama_dir)
    ref.runner.keep_logits = True
    ref.add_request("a", prompts[0], greedy(1))
    run_to_end(ref)
    half = make_engine(llama_dir, dtype=dtype)
    assert half.dtype == getattr(torch, dtype)
    half.runner.keep_logits = True
    half.add_request("a", prompts[0], greedy(1))
    run_to_end(half)
    diff = (ref.runner.last_logits["a"] - half.runner.last_logits["a"]).abs().max().item()
    assert diff < 0.1
