"""gpt-oss GGUF files, written from a random HF gpt-oss model as llama.cpp's converter
writes them (``tests/gguf_writer.py``: gate/up split, experts ``[experts, out, in]``, sinks
as ``attn_sinks.weight``, YaRN in the metadata, the ``gpt-4o`` pre-tokenizer), float32 and
with MXFP4 experts as OpenAI's files ship them. transformers' own GGUF loading does not
read these files (its gpt-oss metadata reading fails on them, tokenizer included), so the
reference is transformers on the source checkpoint, or on the source with its experts
rounded through MXFP4 the way the file stores them.

The file cannot carry the clamped SwiGLU's limit (llama.cpp fixes it at 7), so the
source model here uses that limit rather than the tiny one ``tests/model/test_gpt_oss.py``
runs into.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import write_gguf
from helpers import greedy, hf_greedy, hf_model, make_engine, random_prompts, run_to_end
from safetensors.torch import load_file, save_file

from kvserve.model.gguf import convert
from kvserve.model.spec import load_model_spec
from kvserve.testing.models import build_hf_model, tiny_configs

MXFP4 = gguf.GGMLQuantizationType.MXFP4
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
LENGTHS = [5, 30, 41]  # past the 12-token window of the sliding layers


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_configs()["gpt_oss"]
    config.swiglu_limit = 7.0  # what llama.cpp assumes for every gpt-oss file
    return build_hf_model(config, tmp_path_factory.mktemp("gpt_oss_gguf") / "hf")


def _write(source: Path, path: Path, **kw) -> Path:
    return write_gguf(source, path, "gpt-oss", pre="gpt-4o", **kw)


def _kvserve_greedy(model: Path, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    engine = make_engine(model, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=24)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(n))
    return run_to_end(engine)


def test_the_config_is_the_source_checkpoints(source, tmp_path):
    path = _write(source, tmp_path / "gpt-oss-f32.gguf")
    got, want = load_model_spec(convert(path)), load_model_spec(source)
    assert got.architecture == "GptOssForCausalLM"
    for field in (
        "layer_windows", "sliding_window", "rope", "num_experts", "num_experts_per_tok",
        "swiglu_limit", "swiglu_alpha", "attention_sinks", "attention_bias", "mlp_bias",
        "head_dim", "intermediate_size",
    ):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope.rope_type == "yarn" and not got.rope.truncate


def test_the_gguf_file_runs_as_its_source_checkpoint(source, tmp_path):
    """Float32 tensors: nothing rounded, so the greedy text is transformers' on the source."""
    converted = convert(_write(source, tmp_path / "gpt-oss-f32.gguf"))
    prompts = random_prompts(LENGTHS, seed=9)
    out = _kvserve_greedy(converted, prompts, 12)
    ref = hf_model(source)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(ref, p, 12), f"prompt {i}"


def _mxfp4_rounded(source: Path, out: Path) -> Path:
    """``source`` with each expert weight rounded through MXFP4 along its input, as the
    GGUF writer stores it (the gguf package's quantizer and dequantizer)."""
    state = load_file(source / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = state[name].transpose(1, 2).float().numpy()  # [experts, out, in]
        codes = gguf.quants.quantize(np.ascontiguousarray(rows), MXFP4)
        back = gguf.quants.dequantize(codes, MXFP4)
        rounded = torch.from_numpy(np.asarray(back, np.float32).reshape(rows.shape))
        assert not torch.equal(rounded, torch.from_numpy(rows))
        state[name] = rounded.transpose(1, 2).contiguous()
    out.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_mxfp4_experts_give_the_source_with_those_experts(source, tmp_path):
    """OpenAI's GGUF files keep the experts in MXFP4: kvserve reads them as the gguf
    package dequantizes them, and gives transformers' greedy text on the source model
    whose experts went through the same rounding."""
    path = _write(source, tmp_path / "gpt-oss-mxfp4.gguf", overrides=dict.fromkeys(EXPERTS, MXFP4))
    reader = gguf.GGUFReader(str(path))
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == MXFP4
    assert kinds["blk.0.ffn_gate_exps.bias"] == gguf.GGMLQuantizationType.F32
    prompts = random_prompts(LENGTHS, seed=4)
    out = _kvserve_greedy(convert(path), prompts, 12)
    ref = hf_model(_mxfp4_rounded(source, tmp_path / "rounded"))
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(ref, p, 12), f"prompt {i}"


def test_the_gpt_4o_pre_tokenizer_splits_as_o200k(source, tmp_path):
    """gpt-oss files name the ``gpt-4o`` pre-tokenizer (tiktoken's o200k split), which
    transformers' GGUF loading cannot read: kvserve converts it itself. The pieces differ
    from GPT-2's split where o200k differs: case changes, 3-digit groups, contractions
    kept on their word, punctuation taking the letters after it, newline runs."""
    from tokenizers import Tokenizer

    converted = convert(_write(source, tmp_path / "gpt-oss-f32.gguf"))
    backend = Tokenizer.from_file(str(converted / "tokenizer.json"))
    text = "HelloWorld don't 1234567 foo/bar\n\n/x  café NAÏVE's  "
    pieces = [text[a:b] for _, (a, b) in backend.pre_tokenizer.pre_tokenize_str(text)]
    assert pieces == [
        "Hello", "World", " don't", " ", "123", "456", "7", " foo", "/bar", "\n\n", "/x",
        " ", " café", " NAÏVE's", "  ",
    ]  # fmt: skip
    spec = json.loads((converted / "tokenizer.json").read_text())["pre_tokenizer"]
    split, byte_level = spec["pretokenizers"]  # as HF's own gpt-oss tokenizer.json has it
    assert (split["type"], split["behavior"]) == ("Split", "Isolated")
    assert byte_level["type"] == "ByteLevel"
    assert byte_level["add_prefix_space"] is False and byte_level["use_regex"] is False
