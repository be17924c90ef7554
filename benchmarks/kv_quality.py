"""KV quality: held-out perplexity of the default model per KV dtype and sliding window.

Every configuration scores the same text through the serving path (``kvserve eval
perplexity``): the default model's held-out standard-library files, windows of 512
tokens, bfloat16 weights. The reference is the 16-bit (bfloat16) KV cache.

    python benchmarks/kv_quality.py --out benchmarks/results/kv_quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.config import EngineArgs
from kvserve.default_model import corpus_files, default_model_path
from kvserve.engine.llm_engine import LLMEngine
from kvserve.evaluation import perplexity

CONFIGS: list[tuple[str, dict]] = [
    ("bfloat16 (reference)", {}),
    ("float32", {"kv_cache_dtype": "float32"}),
    ("int8", {"kv_cache_dtype": "int8"}),
    ("fp8_e4m3 (scale 1.0)", {"kv_cache_dtype": "fp8_e4m3"}),
    ("fp8_e4m3 (calibrated)", {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True}),
    ("fp8_e5m2", {"kv_cache_dtype": "fp8_e5m2"}),
    ("window 256 + 4 sinks", {"sliding_window": 256, "attention_sinks": 4}),
    ("window 128 + 4 sinks", {"sliding_window": 128, "attention_sinks": 4}),
    ("window 128, no sinks", {"sliding_window": 128, "attention_sinks": 0}),
    ("window 64 + 4 sinks", {"sliding_window": 64, "attention_sinks": 4}),
    (
        "int8 + window 128 + 4 sinks",
        {"kv_cache_dtype": "int8", "sliding_window": 128, "attention_sinks": 4},
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/kv_quality.json")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    files = [str(f) for f in corpus_files("heldout")]
    rows = []
    ref = None
    for label, extra in CONFIGS:
        engine = LLMEngine(EngineArgs(model=model, kv_cache_memory="256MiB", **extra))
        r = perplexity(engine, files, args.context)
        ref = ref or r.perplexity
        row = {
            "config": label,
            **extra,
            "perplexity": round(r.perplexity, 4),
            "vs_reference": round(r.perplexity / ref - 1, 5),
            "tokens": r.num_tokens,
            "bytes_per_token": engine.kv_spec.bytes_per_token,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"model": model, "context": args.context, "files": files, "rows": rows}, indent=2
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
