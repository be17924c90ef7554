"""One door to the engine core (engine/core_client.py): the in-process client and the
engine-core process behind the same messages give the same results, refuse the same
requests, and a dead core is an error, never a hang."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.core_client import CoreClient, InprocClient
from kvserve.engine.core_mp import AsyncMPClient, SyncMPClient
from kvserve.engine.messages import (
    AddRequest,
    AddResult,
    CheckIntegrity,
    GetKVStats,
    Outputs,
)
from kvserve.errors import EngineDeadError, EngineError

KW = {"kv_cache_memory": "8MiB", "block_size": 16, "max_model_len": 256}


def _batch() -> tuple[list, list[SamplingParams]]:
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9] * 4, "def f(x):", "hello"]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
    ]
    return prompts, params


def _texts(outs) -> list[list[tuple[list[int], str, str | None]]]:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def test_both_clients_are_the_one_interface():
    for cls in (InprocClient, SyncMPClient, AsyncMPClient):
        assert issubclass(cls, CoreClient)


def test_the_engine_process_gives_the_in_process_results(llama_dir):
    prompts, params = _batch()
    inproc = LLM(str(llama_dir), **KW)
    try:
        want = inproc.generate(prompts, params, use_tqdm=False)
        # a stop string cuts the text on the client's side, which tells the core to stop
        first = want[0].outputs[0].text
        stop = first[len(first) // 2 :][:3]
        cut = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        want_cut = inproc.generate(prompts[0], cut, use_tqdm=False)
        assert inproc.reset_prefix_cache() > 0
        inproc.engine.check_integrity()
    finally:
        inproc.close()
    with LLM(str(llama_dir), engine_process=True, **KW) as mp:
        with pytest.raises(AttributeError, match="its own process"):
            mp.engine  # noqa: B018
        got = mp.generate(prompts, params, use_tqdm=False)
        got_cut = mp.generate(prompts[0], cut, use_tqdm=False)
        assert mp.reset_prefix_cache() > 0
        mp.client.call(CheckIntegrity())  # the core's bookkeeping holds after the stop
        assert mp.client.call(GetKVStats()) is not None
    assert _texts(got) == _texts(want)
    assert _texts(got_cut) == _texts(want_cut)
    assert got_cut[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("engine_process", [False, True], ids=["inproc", "process"])
def test_a_refused_prompt_raises_and_nothing_is_left_running(llama_dir, engine_process):
    with LLM(str(llama_dir), engine_process=engine_process, **KW) as llm:
        ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with pytest.raises(EngineError, match="outside the vocabulary"):
            llm.generate([[1, 2, 3], [10**6]], ok, use_tqdm=False)
        out = llm.generate([[1, 2, 3]], ok, use_tqdm=False)  # the next batch runs alone
        assert len(out[0].outputs[0].token_ids) == 4
        ids = {"prompt_token_ids": np.array([1, 2, 3])}  # numpy integers go as plain ints
        same = llm.generate(ids, ok, use_tqdm=False)[0]
        assert same.prompt_token_ids == [1, 2, 3] and type(same.prompt_token_ids[0]) is int
        assert same.outputs[0].token_ids == out[0].outputs[0].token_ids
        llm.client.call(CheckIntegrity())
        if not engine_process:
            assert not llm.engine.has_unfinished_requests()


def test_a_killed_engine_process_is_an_error_not_a_hang(llama_dir):
    llm = LLM(str(llama_dir), engine_process=True, **KW)
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        llm.client.send(AddRequest("warm", [1, 2, 3], long))
        llm.client.proc.kill()
        with pytest.raises(EngineDeadError):
            llm.generate([[1, 2, 3]], long, use_tqdm=False)
    finally:
        llm.close()
    assert not llm.client.proc.is_alive()


def test_the_in_process_client_answers_then_steps(llama_dir):
    with LLM(str(llama_dir), **KW) as llm:
        client = llm.client
        idle = client.get_output()  # nothing to run: a frame without deltas, at once
        assert isinstance(idle, Outputs) and idle.outputs == []
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        client.send(AddRequest("a", [1, 2, 3], params))
        assert client.get_output() == AddResult("a")
        steps = []
        while client.core.has_work():
            msg = client.get_output()
            assert isinstance(msg, Outputs)
            steps.append([len(o.new_token_ids) for o in msg.outputs])
        assert steps == [[1], [1], [1]]
        assert msg.stats.running == 0 and msg.stats.loop_seconds > 0
