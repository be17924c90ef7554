"""Where the server's time goes: ``kvserve serve`` at concurrency c beside the same engine
offline, with the CPU seconds of each process (issue 49, part 2).

One workload for both: ``--num-prompts`` synthetic prompts (``kvserve bench serve``'s, same
seed, so the same token ids) of 256 tokens, 128 output tokens, ``ignore_eos``, greedy.
Offline, ``LLM.generate`` runs them with ``max_num_seqs = c`` (so at most c run at once, as
the client's concurrency allows) and detokenizes, as a user's call does. Online, the server
is started as a user does and driven by ``kvserve bench serve`` in its own process. The CPU
time (user + system, from ``/proc``) of the API server and of the engine core is read before
and after the run, with the engine core's loop counters from ``/metrics``; the client
reports its own CPU while its requests ran (``client_cpu_s``). The rounds alternate offline
and online; the summary is the median.

    python benchmarks/features/serve_breakdown.py --rounds 3 \
        --out benchmarks/results/serve_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.testing.bench import engine_seconds, wait_ready
from kvserve.testing.models import build_real_model
from kvserve.testing.procs import stop_process

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent  # benchmarks/

TICKS = os.sysconf("SC_CLK_TCK")
INPUT_LEN, OUTPUT_LEN = 256, 128


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def offline(model: Path, c: int, n: int, vocab: int, seed: int) -> dict:
    """The engine in this process, as ``LLM.generate`` runs it (text included)."""
    code = f"""
import json, time
from kvserve import LLM, SamplingParams
from kvserve.bench_serve import synthetic
llm = LLM({str(model)!r}, dtype="bfloat16", kv_cache_memory="2GiB", max_model_len=2048,
          max_num_seqs={c})
ps = [it["prompt"] for it in synthetic({n}, {INPUT_LEN}, {OUTPUT_LEN}, {vocab}, {seed})]
llm.generate(ps[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
params = SamplingParams(temperature=0, max_tokens={OUTPUT_LEN}, ignore_eos=True)
t = time.perf_counter()
outs = llm.generate(ps, params)
dt = time.perf_counter() - t
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({{"elapsed_s": dt, "output_tokens": tokens, "output_tok_s": tokens / dt}}))
llm.close()
"""
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1800
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def online(model: Path, c: int, n: int, vocab: int, seed: int, port: int, client_kind: str) -> dict:
    """``kvserve serve`` driven by ``kvserve bench serve``; CPU seconds per process."""
    url = f"http://127.0.0.1:{port}"
    server_cmd = [
        sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model), "--port",
        str(port), "--served-model-name", "smol", "--kv-cache-memory", "2GiB",
        "--max-model-len", "2048", "--dtype", "bfloat16", "--max-num-seqs", str(c),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "w")  # noqa: SIM115 - closed below
        server = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, server, 600)
            (core,) = [c for c in children(server.pid) if b"spawn_main" in cmdline(c)]

            def client(count: int, out: str) -> subprocess.Popen:
                return subprocess.Popen([
                    sys.executable, "-m", "kvserve.cli", "bench", "serve", "--url", url,
                    "--model", "smol", "--concurrency", str(c), "--num-prompts", str(count),
                    "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--vocab",
                    str(vocab), "--seed", str(seed), "--out", str(Path(tmp) / out),
                    "--client", client_kind,
                ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

            if client(2, "warm.json").wait(600) != 0:
                raise RuntimeError("warm-up failed")
            counters = engine_seconds(url) or {}
            cpu0 = cpu_seconds(server.pid), cpu_seconds(core)
            proc = client(n, "run.json")
            if proc.wait(1800) != 0:
                raise RuntimeError(f"bench serve exited {proc.returncode}")
            cpu1 = cpu_seconds(server.pid), cpu_seconds(core)
            after = engine_seconds(url) or {}
            summary = json.loads((Path(tmp) / "run.json").read_text())["summary"]
        finally:
            stop_process(server, 60)
            log.close()
    d = {k: after.get(k, 0.0) - counters.get(k, 0.0) for k in after}
    return {
        "output_tok_s": summary["output_throughput"],
        "duration_s": summary["duration_s"],
        "failed": summary["failed"],
        "p50_ttft_ms": summary["p50_ttft_ms"],
        "p50_itl_ms": summary["p50_itl_ms"],
        "cpu_api_server_s": cpu1[0] - cpu0[0],
        "cpu_engine_core_s": cpu1[1] - cpu0[1],
        "cpu_client_s": summary["client_cpu_s"],  # while the requests ran (not its start)
        "engine_loop_busy_s": d.get("kvserve_engine_loop_busy_seconds_total"),
        "engine_step_s": d.get("kvserve_engine_step_seconds_total"),
        "engine_forward_s": d.get("kvserve_engine_forward_seconds_total"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/kvserve-bench/smol-bf16"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8111)
    ap.add_argument("--client", choices=["http", "openai"], default="http")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "serve_breakdown.json")
    a = ap.parse_args()
    model = build_real_model(a.model_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rounds = []
    for r in range(a.rounds):
        off = offline(model, a.concurrency, a.num_prompts, vocab, a.seed)
        on = online(model, a.concurrency, a.num_prompts, vocab, a.seed, a.port, a.client)
        on["vs_offline"] = on["output_tok_s"] / off["output_tok_s"]
        rounds.append({"offline": off, "online": on})
        print(
            f"round {r}: offline {off['output_tok_s']:.1f} tok/s, online "
            f"{on['output_tok_s']:.1f} ({on['vs_offline']:.2f}x); CPU s: api server "
            f"{on['cpu_api_server_s']:.2f}, engine core {on['cpu_engine_core_s']:.2f}, client "
            f"{on['cpu_client_s']:.2f}; engine forward {on['engine_forward_s']:.2f} s of "
            f"{on['duration_s']:.2f} s",
            flush=True,
        )

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    summary = {
        "offline_tok_s": med("offline", "output_tok_s"),
        "online_tok_s": med("online", "output_tok_s"),
        "online_vs_offline": med("online", "vs_offline"),
    } | {k: med("online", k) for k in rounds[0]["online"] if k.startswith(("cpu_", "engine_"))}
    print(json.dumps(summary, indent=2))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "concurrency": a.concurrency,
        "num_prompts": a.num_prompts, "client": a.client, "rounds": rounds, "summary": summary,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
