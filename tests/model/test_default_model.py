"""The bundled default model: loads in kvserve and HF alike, and is really trained."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import hf_greedy, hf_model, make_engine, run_to_end

from kvserve.default_model import HELDOUT_FILES, corpus_files, default_model_path
from kvserve.evaluation import perplexity
from kvserve.sampling import SamplingParams

# measured 2026-11-29 (benchmarks/history/notebook.md); a random model scores about the
# vocab size (8192)
PERPLEXITY_BOUND = 150.0


def test_shipped_checkpoint_is_small_and_documented():
    model = default_model_path()
    size = sum(f.stat().st_size for f in model.iterdir())
    assert size <= 25 * 1024**2
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    training = json.loads((model / "training.json").read_text())
    assert training["heldout_files"] == list(HELDOUT_FILES)
    held = set(corpus_files("heldout"))
    assert held and not held & set(corpus_files("train"))


def test_kvserve_and_transformers_agree_greedily():
    model = default_model_path()
    engine = make_engine(model, dtype="float32", kv_cache_memory="64MiB")
    prompt = engine.tokenize("def fibonacci(n):\n")
    engine.add_request("f", prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    ours = run_to_end(engine)["f"]
    ref = hf_greedy(hf_model(model), prompt, 48)
    assert ours == ref


def test_heldout_perplexity_far_below_random():
    engine = make_engine(default_model_path(), kv_cache_memory="64MiB")
    files = corpus_files("heldout")[:4]
    r = perplexity(engine, files, 256, max_tokens_per_file=1024, use_tqdm=False)
    assert r.num_tokens > 2000
    assert r.perplexity < PERPLEXITY_BOUND, r


def test_cli_generate_and_eval_use_the_default_model():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "generate",
            "--prompt",
            "import os\n",
            "--max-tokens",
            "24",
            "--kv-cache-memory",
            "64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "eval",
            "perplexity",
            "--json",
            "--context",
            "128",
            "--max-tokens-per-file",
            "256",
            "--kv-cache-memory",
            "64MiB",
            "--kv-cache-dtype",
            "int8",
            "--files",
            str(corpus_files("heldout")[0]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["perplexity"] < PERPLEXITY_BOUND * 2
    assert result["engine"]["kv_cache_dtype"] == "int8"
