"""Sliding windows: blocks outside the window are freed, outputs stay exact, sinks work."""

from __future__ import annotations

import math

import pytest
from helpers import greedy, hf_greedy, hf_model, make_engine, random_prompts, run_to_end


def _max_live_blocks(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[int, list]:
    req = engine.add_request(rid, prompt, greedy(max_tokens))
    peak = 0
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if rid in {r.request_id for r in engine.scheduler.running}:
            peak = max(peak, engine.kv.num_live_blocks(rid))
        engine.check_integrity()
    return peak, req.output_token_ids


def test_mistral_blocks_bounded_and_outputs_match_hf(model_dirs):
    """A prompt several windows long, decoded well past it: at most
    ceil(window / block_size) + 1 live blocks per sequence, tokens identical to HF."""
    engine = make_engine(model_dirs["mistral"], max_num_batched_tokens=16)
    window = engine.window
    prompt = random_prompts([5 * window + 3], seed=8)[0]
    peak, out = _max_live_blocks(engine, "m", prompt, 60)
    assert peak <= math.ceil(window / engine.kv.block_size) + 1
    assert out == hf_greedy(hf_model(model_dirs["mistral"]), prompt, 60)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_user_window_with_sinks_bounds_blocks(llama_dir, backend):
    """--sliding-window on a model without one: sink block + window blocks only."""
    engine = make_engine(
        llama_dir,
        sliding_window=32,
        attention_sinks=4,
        attention_backend=backend,
        device="cpu" if backend == "cpu" else "auto",
        max_num_batched_tokens=16,
    )
    assert engine.window == 32 and engine.attention_sinks == 4
    prompt = random_prompts([150], seed=9)[0]
    peak, out = _max_live_blocks(engine, "w", prompt, 80)
    assert peak <= math.ceil(32 / 16) + 1 + 1  # + the block holding the sinks
    assert len(out) == 80


def test_sinks_kernel_and_mask_paths_agree(llama_dir):
    prompt = random_prompts([120], seed=10)[0]
    outs = []
    for backend in ("torch", "cpu"):
        engine = make_engine(
            llama_dir,
            sliding_window=24,
            attention_sinks=4,
            attention_backend=backend,
            device="cpu",  # the C++ kernel vs the mask path, on the same device
        )
        engine.add_request("s", prompt, greedy(40))
        outs.append(run_to_end(engine)["s"])
    assert outs[0] == outs[1]
    # and the window really changes the computation compared with full attention
    full = make_engine(llama_dir, device="cpu")
    full.add_request("s", prompt, greedy(40))
    assert run_to_end(full)["s"] != outs[0]


def test_default_sinks():
    """4 sinks with a user window; none for a model's own window."""
    from kvserve.config import CacheConfig

    assert CacheConfig(sliding_window=8).attention_sinks is None  # resolved by the engine
    with pytest.raises(ValueError, match="sliding_window"):
        CacheConfig(sliding_window=0)
