"""Quantized KV vs unquantized: greedy top-1 agreement and KL, teacher-forced.

The default model scores 24 windows of 512 held-out tokens (12,264 positions) with
``prompt_logprobs`` through the engine, once per KV dtype, in float32 and in bfloat16
compute; logits are compared position by position with the unquantized cache's.

    python benchmarks/features/kv_agreement.py --out benchmarks/results/kv_agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvserve.config import EngineArgs
from kvserve.default_model import corpus_files, default_model_path
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling import SamplingParams

FORMATS = (
    ("int8", {}),
    ("fp8_e4m3", {}),
    ("fp8_e4m3", {"calculate_kv_scales": True}),
    ("fp8_e5m2", {}),
)


def prompt_logits(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    engine.runner.keep_logits = True
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    logits = engine.runner.prompt_logits
    return torch.cat([torch.cat(logits[f"p{i}"]) for i in range(len(prompts))])


def make(model: str, dtype: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, kv_cache_memory="256MiB", dtype=dtype, **kw))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kv_agreement.json")
    args = ap.parse_args()
    model = str(default_model_path())
    rows = []
    for dtype in ("float32", "bfloat16"):
        ref_engine = make(model, dtype)
        ids: list[int] = []
        for f in corpus_files("heldout"):
            ids += ref_engine.tokenize(f.read_text())
        prompts = [ids[i : i + 512] for i in range(0, 512 * 24, 512)]
        ref = prompt_logits(ref_engine, prompts)
        for name, extra in FORMATS:
            got = prompt_logits(make(model, dtype, kv_cache_dtype=name, **extra), prompts)
            kl = torch.nn.functional.kl_div(
                got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none"
            ).sum(-1)
            row = {
                "compute": dtype,
                "kv_cache_dtype": name,
                **extra,
                "positions": len(ref),
                "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                "kl_mean": kl.mean().item(),
                "kl_p99": kl.quantile(0.99).item(),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"model": model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
