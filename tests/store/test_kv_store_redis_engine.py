"""Engines sharing real Redis servers: a prompt computed on one engine is restored on
another (single server and a 3-master cluster), and a Redis killed mid-run costs nothing
but recomputation — every request completes with the same tokens, and once Redis is back
the engine writes to it again."""

from __future__ import annotations

import time

import pytest
from helpers import greedy, make_engine, random_prompts, run_counting, run_to_end, step_finished

from kvserve.testing.procs import wait_until
from kvserve.testing.redis_procs import redis_cluster, redis_server

PROMPT = random_prompts([100], seed=21)[0]


def _run(engine, prompt=PROMPT, rid="r"):
    return run_counting(engine, prompt, rid)


@pytest.fixture(scope="module")
def reference(llama_dir):
    return _run(make_engine(llama_dir))[0]


def _share(llama_dir, url: str, reference: list[int]) -> None:
    first = make_engine(llama_dir, kv_store=(url,))
    assert _run(first)[0] == reference
    first.close()  # flushes the queued writes
    second = make_engine(llama_dir, kv_store=(url,))  # its own, empty host tier
    tokens, cached, computed = _run(second)
    assert tokens == reference
    assert cached == 96 and computed == 4 + 7  # only the tokens after the 6 stored blocks
    redis_tier = second.offloader.store.stats[1]
    assert redis_tier.hits == 6 and redis_tier.corrupt == 0
    second.close()


def test_a_prompt_computed_on_one_engine_is_restored_on_another(llama_dir, tmp_path, reference):
    with redis_server(tmp_path) as server:
        _share(llama_dir, f"redis://127.0.0.1:{server.port}/0", reference)
        keys = server.client().keys("*")
        # the default prefix names the model, KV dtype and block size
        assert keys and all(k.startswith(b"kvserve:") and b"-float32-bs16:" in k for k in keys)


def test_the_same_through_a_redis_cluster(llama_dir, tmp_path, reference):
    with redis_cluster(tmp_path) as cluster:
        _share(llama_dir, cluster.url("prefix=t2"), reference)


def test_redis_killed_mid_run_then_restarted(llama_dir, tmp_path):
    prompts = random_prompts([60, 70, 80, 90], seed=8)
    want = {}
    plain = make_engine(llama_dir)
    for i, p in enumerate(prompts):
        plain.add_request(f"r{i}", p, greedy(40))
    want = run_to_end(plain)

    with redis_server(tmp_path) as server:
        url = f"redis://127.0.0.1:{server.port}/0?prefix=t3&timeout=0.5"
        engine = make_engine(llama_dir, kv_store=(url,))
        tiered = engine.offloader.store
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(40))
        done = {}
        for _ in range(3):
            step_finished(engine, done)
        assert tiered.flush(30) and tiered.stats[1].bytes_written > 0
        server.kill()
        done.update(run_to_end(engine))
        assert done == want  # every request completed, same tokens
        tiered.flush(30)
        assert tiered.stats[1].errors >= 1 and tiered.stats[1].dropped_writes > 0

        server.start()  # same port, empty
        written = tiered.stats[1].bytes_written
        deadline = time.monotonic() + 60
        i = 0
        while tiered.stats[1].bytes_written == written:  # new blocks go to Redis again
            assert time.monotonic() < deadline, "offload never resumed"
            engine.add_request(f"after{i}", random_prompts([40], seed=100 + i)[0], greedy(2))
            run_to_end(engine)
            tiered.flush(30)
            i += 1
        wait_until(lambda: server.client().dbsize() > 0, 10, "blocks in the restarted Redis")
        engine.check_integrity()
        engine.close()
