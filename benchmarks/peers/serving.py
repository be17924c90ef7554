"""Online serving: kvserve serve vs vLLM-CPU's OpenAI server, driven by `kvserve bench serve`.

Models: the offline benchmark's random-weight SmolLM2-135M-shaped checkpoint (bfloat16),
given the default model's tokenizer (same 8192-token vocabulary) so both servers return
text; with ``--real``, SmolLM2-135M-Instruct itself (``benchmarks/peers/real_model.py``, vocab
49152). Workload per level: synthetic prompts of 256 random token ids, 128 output tokens,
``ignore_eos``, greedy; concurrency 1, 8, 32 with 8, 32, 64 prompts. The servers are
interleaved (kvserve, vLLM, kvserve, vLLM … for ``--rounds``), each alone (the other is
stopped), with tcmalloc: vLLM's server with it in ``LD_PRELOAD`` (its CPU guide's setup),
kvserve's as a user starts it (its engine core preloads tcmalloc itself,
``kvserve/engine/tcmalloc.py``); kvserve with a 2 GiB KV cache, vLLM with
``VLLM_CPU_KVCACHE_SPACE=2`` and its OpenMP threads bound to every allowed CPU. The summary
is the median over rounds; for kvserve each level also records the share of the engine
core's busy loop time spent outside the model runner (``engine_not_forward_frac``).

    python benchmarks/peers/serving.py --out benchmarks/results/serving.json
    python benchmarks/peers/serving.py --real --out benchmarks/results/serving_real.json
    python benchmarks/peers/serving.py --shape gemma3 --out benchmarks/results/serving_gemma3.json

``--shape`` serves another random shape (``gemma3``, ``qwen3moe``, ``gptoss``: their
vocabularies get a word-level tokenizer of their size, ``bench.word_tokenizer``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kvserve.engine.tcmalloc import find_tcmalloc
from kvserve.testing.bench import (
    ENGINE_COUNTERS,
    engine_seconds,
    kvserve_cmd,
    vocab_of,
    wait_ready,
    with_tokenizer,
)
from kvserve.testing.models import SHAPES
from kvserve.testing.models import build_bench_model as build_model
from kvserve.testing.procs import stop_process

LEVELS = ((1, 8), (8, 32), (32, 64))


def bench(url: str, model: str, concurrency: int, n: int, out: Path, vocab: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "bench",
        "serve",
        "--url",
        url,
        "--model",
        model,
        "--concurrency",
        str(concurrency),
        "--num-prompts",
        str(n),
        "--input-len",
        "256",
        "--output-len",
        "128",
        "--vocab",
        str(vocab),
        "--out",
        str(out),
        "--plot",
        str(out.with_suffix(".png")),
    ]
    subprocess.run(cmd, check=True, timeout=3600)
    return json.loads(out.read_text())["summary"]


def run_server(
    name: str,
    cmd: list[str],
    env: dict,
    url: str,
    model: str,
    outdir: Path,
    start_timeout: float,
    vocab: int,
) -> dict:
    log = (outdir / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    results = {}
    try:
        wait_ready(url, proc, start_timeout)
        bench(url, model, 1, 2, outdir / f"{name}-warmup.json", vocab)
        for c, n in LEVELS:
            before = engine_seconds(url)
            results[str(c)] = s = bench(url, model, c, n, outdir / f"{name}-c{c}.json", vocab)
            after = engine_seconds(url)
            if before and after:  # the share of the core loop's busy time not in forward
                d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
                busy = d["kvserve_engine_loop_busy_seconds_total"]
                fwd = d["kvserve_engine_forward_seconds_total"]
                s["engine_loop_busy_s"] = round(busy, 3)
                s["engine_forward_s"] = round(fwd, 3)
                s["engine_not_forward_frac"] = round(1 - fwd / busy, 4) if busy else None
            print(
                f"{name} c={c}: {s['output_throughput']:.1f} out tok/s, p50 TTFT "
                f"{s['p50_ttft_ms']:.0f} ms, p50 ITL {s['p50_itl_ms']:.1f} ms"
                + (
                    f", not forward {s['engine_not_forward_frac']:.1%}"
                    if s.get("engine_not_forward_frac") is not None
                    else ""
                ),
                flush=True,
            )
    finally:
        stop_process(proc, 60)
        log.close()
    return results


def vllm_cmd(python: str, model: Path) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", "8102", "--served-model-name", "smol", "--dtype", "bfloat16",
        "--max-model-len", "2048", "--max-num-seqs", "64",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench/smol-bf16")
    ap.add_argument(
        "--real",
        action="store_true",
        help="serve SmolLM2-135M-Instruct (benchmarks/peers/real_model.py) instead of the "
        "random shape",
    )
    ap.add_argument(
        "--shape",
        default="smol",
        choices=sorted(SHAPES),
        help="the random-weight checkpoint's shape (kvserve.testing.models.SHAPES); one "
        "with a larger vocabulary than the bundled tokenizer's gets a word-level tokenizer",
    )
    ap.add_argument("--rounds", type=int, default=2, help="kvserve, vLLM, kvserve, vLLM …")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--out", default="benchmarks/results/serving.json")
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    if args.real:
        from kvserve.testing.models import build_real_model

        model, vocab = build_real_model(Path("/tmp/kvserve-bench/smollm2-135m-instruct")), 49152
    else:
        path = Path(args.model_dir if args.shape == "smol" else f"/tmp/kvserve-bench/{args.shape}")
        model = with_tokenizer(build_model(path, args.shape))
        vocab = vocab_of(model)
    outdir = Path(args.out).with_suffix("")
    outdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)  # kvserve's engine core preloads tcmalloc by itself
    lib = find_tcmalloc()
    vllm_env = (
        env
        | ({"LD_PRELOAD": lib} if lib else {})
        | {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        }
    )
    with_vllm = not args.skip_vllm and Path(args.vllm_python).exists()
    result: dict = {"model": str(model), "levels": LEVELS, "kvserve": [], "vllm": []}
    for r in range(args.rounds):
        result["kvserve"].append(
            run_server(
                f"kvserve-r{r}",
                kvserve_cmd(model),
                env,
                "http://127.0.0.1:8101",
                "smol",
                outdir,
                300,
                vocab,
            )
        )
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # partial
        if with_vllm:
            result["vllm"].append(
                run_server(
                    f"vllm-r{r}",
                    vllm_cmd(args.vllm_python, model),
                    vllm_env,
                    "http://127.0.0.1:8102",
                    "smol",
                    outdir,
                    900,
                    vocab,
                )
            )
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["summary"] = summarize(result)
    print(json.dumps(result["summary"], indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def summarize(result: dict) -> dict:
    """Per level: the median over rounds of each engine's output tok/s, p50 TTFT and ITL."""
    out = {}
    for c, _ in LEVELS:
        row = {}
        for engine in ("kvserve", "vllm"):
            runs = [r[str(c)] for r in result[engine] if str(c) in r]
            if not runs:
                continue
            row[engine] = {
                key: statistics.median(r[key] for r in runs)
                for key in ("output_throughput", "p50_ttft_ms", "p50_itl_ms")
            }
        if "kvserve" in row and "vllm" in row:
            row["ratio"] = round(
                row["kvserve"]["output_throughput"] / row["vllm"]["output_throughput"], 3
            )
        out[str(c)] = row
    return out


if __name__ == "__main__":
    main()
