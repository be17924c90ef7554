"""KV capacity: sequences held at once in a fixed KV budget — paged vs contiguous, 16 vs 8 bit.

Length mix ("ShareGPT-like", long-tailed): prompt tokens ~ LogNormal(ln 200, 1.0) clipped
to [8, 1536], output tokens ~ LogNormal(ln 180, 0.9) clipped to [8, 512] (means ≈ 300 and
≈ 240, like ShareGPT conversations under a Llama tokenizer); max_model_len 2048.

1. Allocator count (exact, no model): sequences drawn in order are given blocks for their
   whole final length by the engine's own ``KVCacheManager`` until the pool refuses one;
   a contiguous allocator reserves ``max_model_len`` slots per sequence. Mean of 20 seeds.
   Internal waste = unused slots in allocated blocks / allocated slots.
2. Engine run (the bundled default model): 100 requests of that mix with ``ignore_eos``
   through ``LLMEngine`` with the same budget; peak concurrently running requests, peak
   KV usage and preemptions, for bfloat16, int8 and fp8_e4m3 KV.

    python benchmarks/features/kv_capacity.py --out benchmarks/results/kv_capacity.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvserve.config import EngineArgs
from kvserve.default_model import corpus_files, default_model_path
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kv.manager import KVCacheManager
from kvserve.model.kv_cache import KVCacheSpec
from kvserve.model.kv_quant import kv_format
from kvserve.model.spec import load_model_spec
from kvserve.request import Request
from kvserve.sampling import SamplingParams
from kvserve.utils import parse_size

MAX_LEN = 2048


def length_mix(n: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(200), 1.0, n), 8, 1536).astype(int)
    o = np.clip(rng.lognormal(np.log(180), 0.9, n), 8, 512).astype(int)
    o = np.minimum(o, MAX_LEN - p)
    return list(zip(p.tolist(), o.tolist(), strict=True))


def allocator_count(num_blocks: int, seed: int) -> tuple[int, float]:
    """Sequences admitted at full length before the pool refuses one; internal waste."""
    kv = KVCacheManager(num_blocks, 16)
    used = alloc = 0
    n = 0
    for p, o in length_mix(10_000, seed):
        req = Request(str(n), [0] * (p + o), SamplingParams(), seed=0, max_tokens=o)
        if kv.allocate_slots(req, p + o) is None:
            break
        n += 1
        used += p + o
        alloc += len(kv.block_table(str(n - 1))) * 16
    return n, 1 - used / alloc


def engine_run(model: str, budget: str, kv_dtype: str, n: int, seed: int) -> dict:
    engine = LLMEngine(
        EngineArgs(
            model=model,
            kv_cache_memory=budget,
            kv_cache_dtype=kv_dtype,
            max_model_len=MAX_LEN,
            enable_prefix_caching=False,
        )
    )
    text = " ".join(f.read_text() for f in corpus_files("heldout"))
    ids = engine.tokenize(text)
    rng = np.random.default_rng(seed)
    for i, (p, o) in enumerate(length_mix(n, seed)):
        start = int(rng.integers(0, len(ids) - p))
        params = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False)
        engine.add_request(f"r{i}", ids[start : start + p], params)
    peak_running = peak_blocks = steps = 0
    t0 = time.perf_counter()
    bar = tqdm(total=n, desc=f"engine {kv_dtype}", unit="req")
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        peak_running = max(peak_running, len(engine.scheduler.running))
        peak_blocks = max(peak_blocks, engine.kv.pool.num_used)
        bar.update(sum(o.finished for o in outs))
    bar.close()
    return {
        "kv_cache_dtype": engine.kv_format.name,
        "bytes_per_token": engine.kv_spec.bytes_per_token,
        "capacity_tokens": engine.kv.capacity_tokens,
        "peak_running": peak_running,
        "peak_kv_usage": peak_blocks / engine.kv.num_blocks,
        "preemptions": engine.scheduler.num_preemptions,
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled default model")
    ap.add_argument("--budget", default="48MiB", help="KV memory for every configuration")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/kv_capacity.json")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    spec = load_model_spec(model)
    budget = parse_size(args.budget)
    result: dict = {
        "model": model,
        "budget_bytes": budget,
        "max_model_len": MAX_LEN,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "allocator": {},
        "engine": {},
    }
    mix = length_mix(100_000, 0)
    result["mix_mean_prompt"] = statistics.mean(p for p, _ in mix)
    result["mix_mean_output"] = statistics.mean(o for _, o in mix)
    base_tokens = None
    for name in ("bfloat16", "int8", "fp8_e4m3"):
        kv = KVCacheSpec.for_format(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_format(name, torch.bfloat16), 16
        )
        blocks = kv.num_blocks_for(budget)
        counts, wastes = zip(*(allocator_count(blocks, s) for s in range(args.seeds)), strict=True)
        contiguous = blocks * 16 // MAX_LEN
        base_tokens = base_tokens or blocks * 16
        result["allocator"][name] = {
            "bytes_per_token": kv.bytes_per_token,
            "tokens": blocks * 16,
            "tokens_vs_bfloat16": blocks * 16 / base_tokens,
            "contiguous_sequences": contiguous,
            "paged_sequences_mean": statistics.mean(counts),
            "paged_vs_contiguous": statistics.mean(counts) / max(contiguous, 1),
            "internal_waste_mean": statistics.mean(wastes),
        }
        print(name, json.dumps(result["allocator"][name]))
    if not args.skip_engine:
        for name in ("bfloat16", "int8", "fp8_e4m3"):
            result["engine"][name] = engine_run(model, args.budget, name, args.requests, 1)
            print(name, json.dumps(result["engine"][name]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
