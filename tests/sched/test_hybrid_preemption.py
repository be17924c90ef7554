"""Preemption in the hybrid KV layout: swapped or recomputed requests of a model with
sliding and global layers finish with the tokens of an unpreempted run."""

from __future__ import annotations

import pytest
from helpers import greedy, make_engine, random_prompts, run_to_end

PROMPTS = random_prompts([60, 45, 38, 50], seed=12)  # several windows (12 tokens) long


def _run(engine) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, greedy(40))
    got = run_to_end(engine)
    engine.check_integrity()
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    return got


@pytest.fixture(scope="module")
def expected(model_dirs) -> dict[str, list[int]]:
    roomy = make_engine(model_dirs["gemma3"])
    assert roomy.kv.hybrid
    out = _run(roomy)
    assert roomy.scheduler.num_preemptions == 0
    return out


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_hybrid_requests_keep_their_tokens(model_dirs, expected, mode):
    probe = make_engine(model_dirs["gemma3"])
    page = probe.kv_spec.bytes_per_block
    # 24 pages: a 100-token sequence holds 7 global + 2 sliding pages, four hold 36
    tight = make_engine(
        model_dirs["gemma3"], preemption_mode=mode, kv_cache_memory=25 * page, max_model_len=128
    )
    assert tight.kv.hybrid and tight.kv.num_blocks == 24
    assert _run(tight) == expected
    modes = {m for (m, _, _) in tight.scheduler.preemptions}
    assert tight.scheduler.num_preemptions > 0 and modes == {mode}
    assert tight.swap is None or tight.swap.used_blocks == 0
