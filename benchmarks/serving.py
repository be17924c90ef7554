"""Online serving: kvserve serve vs vLLM-CPU's OpenAI server, driven by `kvserve bench serve`.

Model: the offline benchmark's random-weight SmolLM2-135M-shaped checkpoint (bfloat16),
given the default model's tokenizer (same 8192-token vocabulary) so both servers return
text. Workload per level: synthetic prompts of 256 random token ids, 128 output tokens,
``ignore_eos``, greedy; concurrency 1, 8, 32 with 8, 32, 64 prompts. Each server runs
alone (the other is stopped), with tcmalloc preloaded; kvserve with a 2 GiB KV cache,
vLLM with ``VLLM_CPU_KVCACHE_SPACE=2`` and its OpenMP threads bound to both cores.

    python benchmarks/serving.py --out benchmarks/results/serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline import build_model  # noqa: E402 - sibling scripts
from peer_vllm import find_tcmalloc  # noqa: E402

LEVELS = ((1, 8), (8, 32), (32, 64))


def with_tokenizer(model: Path) -> Path:
    from kvserve.default_model import default_model_path

    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (model / name).exists():
            shutil.copy(default_model_path() / name, model / name)
    return model


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def bench(url: str, model: str, concurrency: int, n: int, out: Path) -> dict:
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
        "8192",
        "--out",
        str(out),
        "--plot",
        str(out.with_suffix(".png")),
    ]
    subprocess.run(cmd, check=True, timeout=3600)
    return json.loads(out.read_text())["summary"]


def run_server(
    name: str, cmd: list[str], env: dict, url: str, model: str, outdir: Path, start_timeout: float
) -> dict:
    log = (outdir / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    results = {}
    try:
        wait_ready(url, proc, start_timeout)
        bench(url, model, 1, 2, outdir / f"{name}-warmup.json")
        for c, n in LEVELS:
            results[str(c)] = bench(url, model, c, n, outdir / f"{name}-c{c}.json")
            s = results[str(c)]
            print(
                f"{name} c={c}: {s['output_throughput']:.1f} out tok/s, p50 TTFT "
                f"{s['p50_ttft_ms']:.0f} ms, p50 ITL {s['p50_itl_ms']:.1f} ms",
                flush=True,
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench/smol-bf16")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--out", default="benchmarks/results/serving.json")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-kvserve", action="store_true")
    args = ap.parse_args()
    model = with_tokenizer(build_model(Path(args.model_dir)))
    outdir = Path(args.out).with_suffix("")
    outdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    lib = find_tcmalloc()
    if lib:
        env["LD_PRELOAD"] = lib
    result = {"model": str(model), "levels": LEVELS}
    if args.skip_kvserve:  # keep the kvserve half of an earlier run
        result["kvserve"] = json.loads(Path(args.out).read_text())["kvserve"]
    else:
        result["kvserve"] = run_server(
            "kvserve",
            [
                sys.executable,
                "-m",
                "kvserve.cli",
                "serve",
                "--model",
                str(model),
                "--port",
                "8101",
                "--served-model-name",
                "smol",
                "--kv-cache-memory",
                "2GiB",
                "--max-model-len",
                "2048",
                "--dtype",
                "bfloat16",
            ],
            env,
            "http://127.0.0.1:8101",
            "smol",
            outdir,
            300,
        )
    if not args.skip_vllm and Path(args.vllm_python).exists():
        venv_env = env | {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # partial
        result["vllm"] = run_server(
            "vllm",
            [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--port",
                "8102",
                "--served-model-name",
                "smol",
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "2048",
                "--max-num-seqs",
                "64",
            ],
            venv_env,
            "http://127.0.0.1:8102",
            "smol",
            outdir,
            900,
        )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
