"""The public offline API (LLM, SamplingParams, RequestOutput), config and CLI."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import subprocess
import sys

import pytest

from kvserve import LLM, EngineArgs, SamplingParams
from kvserve.utils import parse_size


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), kv_cache_memory="8MiB", block_size=16)


def test_generate_text_and_token_prompts_agree(llm):
    tok = llm.get_tokenizer()
    text = "def fibonacci(n):"
    ids = tok.encode(text)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a, b, c = llm.generate([text, ids, {"prompt_token_ids": ids}], params)
    assert a.prompt == text and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids)
    assert a.outputs[0].finish_reason == "length"
    llm.engine.check_integrity()


def test_outputs_keep_prompt_order_and_n(llm):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 2, 5)]
    outs = llm.generate(["a", "bb", "ccc"], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 2, 5]
    multi = llm.generate("x", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12))
    assert [c.index for c in multi[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in multi[0].outputs}) > 1


def test_stop_string_truncates_text(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("import json", params)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate("import json", dataclasses.replace(params, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    kept = llm.generate(
        "import json", dataclasses.replace(params, stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_logprobs_returned_per_token(llm):
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tok, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert entry[tok].rank == 1 and entry[tok].logprob <= 0


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "hi there"}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.chat(msgs, params)[0]
    tok = llm.get_tokenizer()
    expected = tok.encode("<s><|user|>hi there<|end|><|assistant|>", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    direct = llm.generate([expected], params)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_bad_arguments_raise(llm, llama_dir):
    with pytest.raises(TypeError, match="unknown LLM argument"):
        LLM(model=str(llama_dir), gpu_memory=3)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate("a", SamplingParams(max_tokens=10**6))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "text, expected",
    [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5Ki", 1536), ("100", 100), (7, 7)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("lots")


def test_cli_flags_map_one_to_one_to_engine_args():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, serve=True)  # every field
    ns = parser.parse_args(
        [
            "--model",
            "m",
            "--kv-cache-memory",
            "1GiB",
            "--max-num-seqs",
            "7",
            "--no-enable-chunked-prefill",
            "--block-size",
            "32",
        ]
    )
    args = EngineArgs.from_cli(ns)
    assert args.cache_config().kv_cache_memory == 2**30
    assert args.scheduler_config().max_num_seqs == 7
    assert not args.scheduler_config().enable_chunked_prefill
    assert args.cache_config().block_size == 32
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert fields == set(vars(ns))


def test_cli_generate_matches_offline_api(llm, llama_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "generate",
            "--model",
            str(llama_dir),
            "--kv-cache-memory",
            "8MiB",
            "--prompt",
            "class Foo:",
            "--max-tokens",
            "7",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    expected = (
        llm.generate("class Foo:", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert proc.stdout == expected + "\n"
    assert "bytes/token" in proc.stderr and "max concurrency" in proc.stderr


def test_cli_reports_bad_model_dir_cleanly(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "generate",
            "--model",
            str(tmp_path),
            "--prompt",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "config.json: not found" in proc.stderr and "Traceback" not in proc.stderr


def test_startup_heap_is_frozen_until_close(llama_dir):
    """The objects an LLM builds are kept out of full collections (``gc.freeze``) and
    handed back to the collector by ``close``."""
    with LLM(model=str(llama_dir), kv_cache_memory="8MiB") as llm:
        assert gc.get_freeze_count() > 1000
        assert llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert gc.get_freeze_count() == 0
