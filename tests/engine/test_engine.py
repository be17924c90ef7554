"""Engine behaviour: scheduling limits, preemption, rejection, aborts, determinism."""

from __future__ import annotations

import pytest
from helpers import greedy, make_engine, random_prompts, run_to_end

from kvserve.engine.llm_engine import EngineError
from kvserve.sampling import SamplingParams


def test_token_budget_and_max_num_seqs_are_respected(llama_dir):
    engine = make_engine(llama_dir, max_num_batched_tokens=20, max_num_seqs=3)
    prompts = random_prompts([30, 7, 12, 5, 9])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(4))
    seen: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # wraps the real scheduler; records what each step got
        out = schedule()
        seen.append((out.num_tokens, len(engine.scheduler.running)))
        return out

    engine.scheduler.schedule = recording_schedule
    done = run_to_end(engine)
    assert len(done) == 5
    assert max(t for t, _ in seen) == 20  # the budget is used fully, never exceeded
    assert max(r for _, r in seen) == 3
    assert sum(t for t, _ in seen) == sum(map(len, prompts)) + 5 * 3  # each token once
    engine.check_integrity()


def test_without_chunked_prefill_whole_prompts_are_scheduled(llama_dir):
    engine = make_engine(llama_dir, max_num_batched_tokens=64, enable_chunked_prefill=False)
    prompts = random_prompts([40, 40])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(2))
    first = engine.scheduler.schedule()
    assert list(first.num_scheduled_tokens.values()) == [40]  # second waits for budget


def test_preemption_by_recompute_gives_identical_tokens(llama_dir):
    prompts = random_prompts([30, 25, 20, 18], seed=11)
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)
    roomy = make_engine(llama_dir)
    for i, p in enumerate(prompts):
        roomy.add_request(f"r{i}", p, params)
    expected = run_to_end(roomy)
    # 16 blocks × 16 tokens: four requests of ~65 tokens cannot all stay resident
    tight = make_engine(llama_dir, kv_cache_memory=16 * 16 * 512, max_model_len=128)
    assert tight.kv.num_blocks == 16
    for i, p in enumerate(prompts):
        tight.add_request(f"r{i}", p, params)
    got = run_to_end(tight)
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    tight.check_integrity()
    assert tight.kv.pool.num_free == tight.kv.num_blocks


def test_request_that_can_never_fit_is_rejected(llama_dir):
    engine = make_engine(llama_dir, kv_cache_memory=4 * 16 * 512, max_model_len=64)
    with pytest.raises(EngineError, match="maximum context length is 64"):
        engine.add_request("big", list(range(2, 60)), greedy(10))
    with pytest.raises(EngineError, match="empty"):
        engine.add_request("empty", [], greedy(1))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request("oov", [10**6], greedy(1))
    assert not engine.has_unfinished_requests()


def test_kv_smaller_than_max_model_len_is_refused_at_start(llama_dir):
    with pytest.raises(EngineError, match="fewer than max_model_len"):
        make_engine(llama_dir, kv_cache_memory=4 * 16 * 512, max_model_len=512)


def test_abort_frees_blocks_at_once(llama_dir):
    engine = make_engine(llama_dir)
    for i, p in enumerate(random_prompts([40, 20, 5])):
        engine.add_request(f"r{i}", p, greedy(50))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free < engine.kv.num_blocks
    for i in range(3):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_same_seed_same_tokens_whatever_the_batch(llama_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    target = random_prompts([13], seed=99)[0]
    alone = make_engine(llama_dir)
    alone.add_request("t", target, params)
    solo = run_to_end(alone)["t"]
    busy = make_engine(llama_dir, max_num_batched_tokens=16)
    others = random_prompts([3, 30, 17, 8], seed=1)
    for i, p in enumerate(others[:2]):
        busy.add_request(f"o{i}", p, SamplingParams(temperature=0.7, max_tokens=30))
    busy.step()
    busy.add_request("t", target, params)
    for i, p in enumerate(others[2:]):
        busy.add_request(f"p{i}", p, SamplingParams(temperature=1.2, max_tokens=5))
    assert run_to_end(busy)["t"] == solo
    other_seed = make_engine(llama_dir)
    other_seed.add_request(
        "t",
        target,
        SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=24, ignore_eos=True),
    )
    assert run_to_end(other_seed)["t"] != solo


def test_stop_token_ids_eos_and_min_tokens(llama_dir):
    engine = make_engine(llama_dir)
    prompt = random_prompts([10], seed=2)[0]
    engine.add_request("free", prompt, greedy(12))
    free_run = run_to_end(engine)["free"]
    stop_tok = free_run[4]
    engine.add_request(
        "stop", prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok])
    )
    engine.add_request(
        "min",
        prompt,
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], min_tokens=8),
    )
    stop, low = engine.requests["stop"], engine.requests["min"]
    run_to_end(engine)
    first = free_run.index(stop_tok)
    assert stop.output_token_ids == free_run[: first + 1]
    assert stop.status.value == "stop" and stop.stop_reason == stop_tok
    assert len(low.output_token_ids) >= 8
    assert stop_tok not in low.output_token_ids[:8]
