"""The hybrid KV layout on a Gemma-3-shaped model at 8k context: a sequence holds its
global layers' every block and its sliding layers' window only, so one KV budget runs
several times the concurrent long sequences of a uniform cache, with the same text."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import greedy, make_engine, random_prompts, step_finished

from kvserve.errors import EngineError
from kvserve.testing.models import VOCAB, build_hf_model
from kvserve.utils import cdiv

WINDOW = 512
PROMPT = 8192
NEW = 8
LONG = 64  # outputs long enough that the next prompts' prefills overlap the decodes
BS = 16


@pytest.fixture(scope="module")
def gemma_8k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 layers, 5 sliding : 1 global as Gemma 3 (groups of 2 layers), 8k positions."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=PROMPT + 64,
        sliding_window=WINDOW,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.1,
    )
    return build_hf_model(config, tmp_path_factory.mktemp("gemma8k") / "m")


def _engine(model: Path, layout: str, memory: int | None = None):
    return make_engine(
        model,
        kv_layout=layout,
        dtype="bfloat16",
        attention_backend="cpu",
        max_model_len=PROMPT + 64,
        max_num_batched_tokens=512,
        kv_cache_memory=memory or 64 * 1024**2,
    )


def test_a_sequence_holds_global_blocks_plus_sliding_windows(gemma_8k):
    engine = _engine(gemma_8k, "hybrid")
    groups = engine.kv_spec.groups
    assert groups is not None and groups.group_size == 2
    assert groups.windows == (None, *[WINDOW] * 5)
    req = engine.add_request("a", random_prompts([PROMPT], VOCAB, seed=3)[0], greedy(NEW))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if req.is_finished:
            break
        c = req.num_computed_tokens
        every = cdiv(c, BS)
        window_blocks = every - max(0, (c - WINDOW + 1) // BS)
        assert window_blocks <= cdiv(WINDOW, BS) + 1
        assert engine.kv.num_live_blocks("a") == every + 5 * window_blocks  # exactly
        engine.check_integrity()
        checked += 1
    assert checked >= PROMPT // 512 and len(req.output_token_ids) == NEW
    assert engine.kv.pool.num_used == 0


def _peak_concurrency(engine, prompts: list[list[int]]) -> tuple[int, dict[str, list[int]]]:
    """Most requests resident at once with all of their prompt computed; the outputs."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(LONG))
    done: dict[str, list[int]] = {}
    peak = 0
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        step_finished(engine, done)
        engine.check_integrity()
        peak = max(peak, sum(r.num_computed_tokens >= PROMPT for r in engine.scheduler.running))
    return peak, done


def test_three_times_the_8k_sequences_of_a_uniform_cache_same_text(gemma_8k):
    probe = _engine(gemma_8k, "uniform")
    # room for one 8k sequence in the uniform layout (two need twice as much)
    memory = (cdiv(PROMPT + LONG, BS) + 4) * probe.kv_spec.bytes_per_block
    del probe
    prompts = random_prompts([PROMPT] * 4, VOCAB, seed=4)
    uniform = _engine(gemma_8k, "uniform", memory)
    peak_uniform, out_uniform = _peak_concurrency(uniform, prompts)
    del uniform
    hybrid = _engine(gemma_8k, "hybrid", memory)
    peak_hybrid, out_hybrid = _peak_concurrency(hybrid, prompts)
    assert peak_uniform == 1
    assert peak_hybrid >= 3 * peak_uniform
    assert out_hybrid == out_uniform and len(out_hybrid) == 4


def test_auto_layout_and_refusals(gemma_8k, llama_dir):
    assert _engine(gemma_8k, "auto").kv.hybrid
    assert not make_engine(llama_dir).kv.hybrid  # every layer alike: one table
    with pytest.raises(EngineError, match="attends alike"):
        make_engine(llama_dir, kv_layout="hybrid")
    stored = make_engine(gemma_8k, kv_store=("host://?capacity=64MiB",), max_model_len=1024)
    assert stored.kv.hybrid  # the store takes a hybrid layout's blocks (test_kv_store_hybrid)
