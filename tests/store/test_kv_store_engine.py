"""Engines restoring prefixes from the KV store: across a restart (file tier), and what a
corrupted, truncated or foreign stored block does (a miss, counted; the output is still
exactly that of recomputing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import greedy, make_engine, random_prompts, run_counting, run_to_end

from kvserve.request import RequestStatus

PROMPT = random_prompts([100], seed=21)[0]  # 6 full blocks can come from the store


def _store_url(path: Path) -> str:
    return f"file://{path}?capacity=64MiB"


def _run(engine, prompt=PROMPT, rid="r"):
    return run_counting(engine, prompt, rid)


@pytest.fixture(scope="module")
def reference(llama_dir):
    tokens, cached, computed = _run(make_engine(llama_dir))
    assert cached == 0 and computed == 100 + 7
    return tokens


def _blocks(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvb"), key=lambda p: p.stat().st_mtime_ns)


def test_prefix_survives_a_restart_through_the_file_tier(llama_dir, tmp_path, reference):
    first = make_engine(llama_dir, kv_store=(_store_url(tmp_path),))
    assert _run(first)[0] == reference
    first.close()
    assert len(_blocks(tmp_path)) == 6  # the 6 full prompt blocks (+ none of the output)

    second = make_engine(llama_dir, kv_store=(_store_url(tmp_path),))
    tokens, cached, computed = _run(second)
    assert tokens == reference
    assert cached == 96  # 6 blocks restored
    assert computed == 4 + 7  # the prefill computed only the 4 tokens after them
    assert second.offloader.num_loaded_blocks == 6
    second.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "foreign"])
def test_a_damaged_block_is_a_miss_and_the_rest_is_recomputed(
    llama_dir, tmp_path, reference, damage
):
    first = make_engine(llama_dir, kv_store=(_store_url(tmp_path),))
    _run(first)
    first.close()
    files = _blocks(tmp_path)  # in write order: block 0 … 5
    target = files[3]
    data = target.read_bytes()
    if damage == "corrupt":
        target.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:  # another block's bytes under this block's name
        target.write_bytes(files[4].read_bytes())
    damaged = target.read_bytes()

    second = make_engine(llama_dir, kv_store=(_store_url(tmp_path),))
    tokens, cached, computed = _run(second)
    assert tokens == reference
    assert cached == 3 * 16  # blocks 0-2 restored, block 3 refused
    assert computed == 100 - 48 + 7
    assert second.offloader.store.stats[0].corrupt == 1
    second.close()
    assert target.read_bytes() != damaged  # dropped, then replaced by the recomputed block


def test_another_models_blocks_are_never_found(llama_dir, model_dirs, tmp_path):
    first = make_engine(llama_dir, kv_store=(_store_url(tmp_path),))
    _run(first)
    first.close()
    other = make_engine(model_dirs["qwen2"], kv_store=(_store_url(tmp_path),))
    _, cached, _ = _run(other)
    assert cached == 0 and other.offloader.num_loaded_blocks == 0
    other.close()


def test_other_requests_keep_running_while_a_prefix_loads(llama_dir, tmp_path, reference):
    first = make_engine(llama_dir, kv_store=(_store_url(tmp_path),))
    _run(first)
    first.close()
    second = make_engine(llama_dir, kv_store=(_store_url(tmp_path),))
    other = second.add_request("other", random_prompts([20], seed=3)[0], greedy(30))
    second.step()
    req = second.add_request("r", PROMPT, greedy(8))
    second.step()
    assert req.status in (RequestStatus.LOADING, RequestStatus.RUNNING)
    assert other.status is RequestStatus.RUNNING
    done = run_to_end(second)
    assert done["r"] == reference
    second.check_integrity()
    second.close()
