"""The plain-data door between the scheduler and the ranks (issue 51, item 1): each
rank's own copy of the requests (``worker.requests``), kept up to date from the deltas of
each ``SchedulerOutput``, equals the scheduler's requests at every step — tokens, block
tables per KV group, computed tokens — through prefix-cache hits, preemption by recompute
and by swap, sliding-window frees, the hybrid layout's groups, aborts and a request id
used again; and the message names no ``Request`` and carries no prompt once sent."""

from __future__ import annotations

import io
import pickle

import pytest
from helpers import make_engine, random_prompts, run_to_end

from kvserve import SamplingParams
from kvserve.model.spec import load_model_spec


class _PlainData(pickle.Unpickler):
    """Unpickles a step message, refusing the engine's live request objects."""

    def find_class(self, module: str, name: str):
        if module == "kvserve.request":
            raise AssertionError(f"the step message carries {module}.{name}")
        return super().find_class(module, name)


def _watch(engine, monkeypatch) -> list[tuple[object, int]]:
    """Check the runner's copies against the scheduler's requests after every step it
    executes (before the update moves them on); returns (output, pickled bytes) per step."""
    runner = engine.runner
    inner = runner.step
    seen: list[tuple[object, int]] = []

    def step(out):
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        _PlainData(io.BytesIO(data)).load()
        seen.append((out, len(data)))
        result = inner(out)
        for rid in out.num_scheduled_tokens:
            req = engine.scheduler.requests[rid]
            copy = runner.requests[rid]
            assert copy.token_ids == req.prompt_token_ids + req.output_token_ids, rid
            assert copy.block_ids == engine.kv.block_tables(rid), rid
            assert copy.num_computed_tokens == req.num_computed_tokens, rid
        engine.check_integrity()  # the runner keeps exactly the ids the scheduler says
        return result

    monkeypatch.setattr(runner, "step", step)
    return seen


def _block_bytes(model) -> int:
    spec = load_model_spec(model)
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4 * 16


CASES = {
    "prefix-cache": dict(),
    "recompute": dict(preemption_mode="recompute", enable_prefix_caching=False, blocks=14),
    "swap": dict(preemption_mode="swap", enable_prefix_caching=False, blocks=14),
    "window": dict(sliding_window=32, attention_sinks=4),
}


@pytest.mark.parametrize("case", [*CASES, "hybrid"])
def test_rank_copies_follow_the_scheduler(model_dirs, monkeypatch, case):
    arch = "gemma3" if case == "hybrid" else "llama"
    kw = dict(CASES.get(case, {}))
    blocks = kw.pop("blocks", None)
    if blocks is not None:
        kw["kv_cache_memory"] = blocks * _block_bytes(model_dirs[arch])
        kw["max_model_len"] = 128
    engine = make_engine(model_dirs[arch], **kw)
    seen = _watch(engine, monkeypatch)
    shared = random_prompts([40], seed=3)[0]
    prompts = [shared + p for p in random_prompts([9, 23, 30, 5], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(6):
        engine.step()
    engine.abort_request("r1")
    engine.add_request("r1", random_prompts([17], seed=5)[0], params)  # the id again
    engine.finish_request("r2", 2)  # a stop string: its tokens cut, then finished
    done = run_to_end(engine)
    assert sorted(done) == ["r0", "r1", "r3"]
    assert engine.runner.requests.ids() == engine.scheduler.ranks.held_ids()
    if case in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions > 0
    if case == "window":
        assert any(out.cached.tables for out, _ in seen)  # a freed block resent the table
    if case == "hybrid":
        assert len(engine.kv.windows) > 1


def test_a_decode_step_carries_deltas_only(model_dirs, monkeypatch):
    """With a repetition penalty (whose sampler rows need the whole history), a decode
    step's message is its tokens and ids: tens of bytes per request, not the prompts."""
    engine = make_engine(model_dirs["llama"])
    seen = _watch(engine, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3)
    for i, p in enumerate(random_prompts([200] * 8, seed=6)):
        engine.add_request(f"r{i}", p, params)
    run_to_end(engine)
    decodes = [
        size
        for out, size in seen
        if not out.new_requests and set(out.num_scheduled_tokens.values()) == {1}
    ]
    assert len(decodes) >= 20
    first = seen[0][1]
    assert first > 8 * 200  # the prompts went out once, whole
    assert max(decodes) < 700  # 8 requests x (id, token, computed count) + the frame


def test_rank_copies_of_prefixes_loaded_from_the_kv_store(model_dirs, monkeypatch, tmp_path):
    """A second engine takes the prompts' prefixes from a file tier (requests LOADING, then
    running with their loaded blocks computed): the copies still follow."""
    url = f"file://{tmp_path}?capacity=64MiB"
    prompts = random_prompts([70, 50, 90], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = make_engine(model_dirs["llama"], kv_store=(url,))
    for i, p in enumerate(prompts):
        first.add_request(f"a{i}", p, params)
    want = run_to_end(first)
    first.close()
    engine = make_engine(model_dirs["llama"], kv_store=(url,))
    seen = _watch(engine, monkeypatch)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params)
    assert run_to_end(engine) == want
    assert any(out.kv_loads for out, _ in seen)  # the prefixes came from the store
    assert all(n.num_computed_tokens > 0 for out, _ in seen for n in out.new_requests)
