"""Where a decode step and a prefill step go: per-op time of kvserve's forward pass.

Builds the offline engine on a checkpoint, brings ``--num-seqs`` requests of ``--input-len``
random prompt tokens to the decode phase, then profiles ``--steps`` decode steps and one
prefill step of ``--prefill-tokens`` tokens with ``torch.profiler`` (CPU), and prints the
ops by self time per step. Run it with tcmalloc preloaded, as the throughput benchmarks do:

    LD_PRELOAD=$(python -c 'import benchmarks.peer_vllm as p; print(p.find_tcmalloc())') \
        python benchmarks/kernels/step_profile.py --model /tmp/kvserve-bench/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams


def _table(prof: profile, steps: int, top: int) -> list[dict]:
    rows = []
    for ev in prof.key_averages():
        rows.append(
            {
                "op": ev.key,
                "ms_per_step": ev.self_cpu_time_total / 1e3 / steps,
                "calls_per_step": ev.count / steps,
            }
        )
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=256, help="per prefill prompt")
    ap.add_argument("--prefill-prompts", type=int, default=8, help="prompts in the prefill step")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default="auto", help="auto, or int8 (per-channel weights)")
    ap.add_argument(
        "--python-layers",
        action="store_true",
        help="run the layers through the Python loop, one profiler row per kernel, instead "
        "of the fused C++ stack (one row, decoder_stack, for all of them)",
    )
    ap.add_argument("--json-out")
    a = ap.parse_args()

    llm = LLM(
        a.model,
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_num_batched_tokens=2048,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
    )
    engine = llm.engine
    if a.python_layers:
        engine.runner.model.fused_stack = None
    vocab = engine.runner.model.spec.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True, detokenize=False)
    for i in range(a.num_seqs):
        engine.add_request(f"d{i}", rng.integers(0, vocab, a.input_len).tolist(), params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    t = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    decode_ms = (time.perf_counter() - t) * 1e3 / a.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            engine.step()
    decode = _table(prof, a.steps, a.top)
    for i in range(a.num_seqs):
        engine.abort_request(f"d{i}")

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)

    def add_prefills(tag: str) -> None:
        for i in range(a.prefill_prompts):
            prompt = rng.integers(0, vocab, a.prefill_tokens).tolist()
            engine.add_request(f"{tag}{i}", prompt, one)  # only its prefill step is run

    add_prefills("w")  # the unprofiled (timed) step
    t = time.perf_counter()
    engine.step()
    prefill_ms = (time.perf_counter() - t) * 1e3
    for i in range(a.prefill_prompts):
        engine.abort_request(f"w{i}")
    add_prefills("p")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    prefill = _table(prof, 1, a.top)
    report = {
        "model": a.model,
        "decode_step_ms": decode_ms,
        "decode_seqs": a.num_seqs,
        "prefill_step_ms": prefill_ms,
        "prefill_tokens": a.prefill_tokens,
        "prefill_prompts": a.prefill_prompts,
        "threads": torch.get_num_threads(),
        "kv_cache_dtype": a.kv_cache_dtype,
        "quantization": a.quantization,
        "fused_stack": engine.runner.model.fused_stack is not None,
        "decode_ops": decode,
        "prefill_ops": prefill,
    }
    for name, rows, ms in (("decode", decode, decode_ms), ("prefill", prefill, prefill_ms)):
        print(f"\n{name} step: {ms:.1f} ms (unprofiled)")
        for r in rows:
            print(f"  {r['op'][:48]:48s} {r['ms_per_step']:8.2f} ms  x{r['calls_per_step']:.0f}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
