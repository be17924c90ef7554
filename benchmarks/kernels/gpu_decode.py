"""GPU check's numbers: the Triton paged attention against a torch reference on real
sizes, and offline throughput of a Llama-3.2-1B-shaped random model (bf16, c = 64 prompts
of 512 tokens → 128 new) on three paths — Triton with CUDA graphs, Triton eager, the
portable SDPA path — with the measured HBM bandwidth and the decode step's roofline
(weights + the KV read per step, over the bandwidth). Each engine runs in its own
process (it takes --gpu-memory-utilization of the GPU).

    python benchmarks/kernels/gpu_decode.py --out DIR            # on a GPU (a few minutes)
    TRITON_INTERPRET=1 python benchmarks/kernels/gpu_decode.py --tiny --out DIR   # CPU smoke run

``--tiny`` runs a small shape on CPU under Triton's interpreter so the script itself is
exercised where there is no GPU (scripts/gpu_check.sh's dry run); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LLAMA_1B = dict(  # Llama-3.2-1B's shape
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
TINY = dict(LLAMA_1B, vocab_size=512, hidden_size=64, intermediate_size=128)
TINY.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
PATHS = {  # name: (attention backend, enforce_eager)
    "triton+graphs": ("triton", False),
    "triton-eager": ("triton", True),
    "torch-sdpa": ("torch", True),
}


def build(path: Path, tiny: bool, device: str) -> Path:
    """Save the random bf16 checkpoint once (initialised on ``device``: fast on a GPU)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**(TINY if tiny else LLAMA_1B)), dtype=torch.bfloat16
        )
    model.save_pretrained(path)
    return path


def hbm_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read and written."""
    import torch

    if device == "cpu":
        return 0.0
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def kernel_check(device: str, tiny: bool) -> dict:
    """The Triton kernel against a float32 gather-and-softmax reference on the 1B shape's
    decode (64 sequences × 576 positions, 32 query / 8 KV heads, d 64), and its time."""
    import torch

    from kvserve.model.triton_attention import paged_attention

    g = torch.Generator(device="cpu").manual_seed(0)
    seqs, ctx, hq, hkv, d, bs = (4, 40, 4, 2, 16, 16) if tiny else (64, 576, 32, 8, 64, 16)
    nb = seqs * -(-ctx // bs)
    k = torch.randn(nb * bs, hkv, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(nb * bs, hkv, d, generator=g).to(device, torch.bfloat16)
    tables = torch.randperm(nb, generator=g).view(seqs, -1).to(device)
    q = torch.randn(seqs, hq, d, generator=g).to(device, torch.bfloat16)
    lens = torch.full((seqs,), ctx, device=device)
    starts = torch.arange(seqs + 1, device=device)
    out = paged_attention(q, k, v, tables, lens, starts, d**-0.5, block_size=bs, max_context=ctx)
    slots = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=device)).view(seqs, -1)[:, :ctx]
    kk = k[slots].float().repeat_interleave(hq // hkv, 2)  # [seqs, ctx, hq, d]
    vv = v[slots].float().repeat_interleave(hq // hkv, 2)
    w = torch.einsum("shd,sthd->sht", q.float(), kk).mul(d**-0.5).softmax(-1)
    ref = torch.einsum("sht,sthd->shd", w, vv)
    err = (out.float() - ref).abs().max().item()
    reps = 1 if tiny else 50
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        paged_attention(q, k, v, tables, lens, starts, d**-0.5, block_size=bs, max_context=ctx)
    sync()
    ms = (time.perf_counter() - t) / reps * 1e3
    kv_bytes = 2 * seqs * ctx * hkv * d * 2
    return {"max_abs_err": err, "ms": ms, "kv_gb_s": kv_bytes / (ms / 1e3) / 1e9}


def worker(a: argparse.Namespace) -> dict:
    """One path's offline run (in its own process)."""
    import numpy as np
    import torch

    from kvserve import LLM, SamplingParams

    backend, eager = PATHS[a.path]
    n, prompt, gen = (2, 20, 4) if a.tiny else (64, 512, 128)
    llm = LLM(
        str(a.model_dir), dtype="bfloat16", device=a.device, attention_backend=backend,
        enforce_eager=eager, max_model_len=prompt + gen, max_num_seqs=n,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.8,
        kv_cache_memory="64MiB" if a.tiny else None,
    )  # fmt: skip
    vocab = llm.engine.model.spec.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, size=(n, prompt)).tolist()
    greedy = SamplingParams(
        temperature=0, max_tokens=4 if a.tiny else 8, ignore_eos=True, detokenize=False
    )
    first = [o.outputs[0].token_ids for o in llm.generate(ids[:4], greedy, use_tqdm=False)]
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True, detokenize=False)
    engine = llm.engine
    for i, p in enumerate(ids):
        engine.add_request(f"b{i}", p, params)
    decode_s, decode_steps, n_out = 0.0, 0, 0
    sync = torch.cuda.synchronize if a.device != "cpu" else (lambda: None)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_tokens - 1 for r in engine.scheduler.running)
        decoding = decoding and not engine.scheduler.waiting
        t = time.perf_counter()
        n_out += len(engine.step())
        sync()
        if decoding:
            decode_s += time.perf_counter() - t
            decode_steps += 1
    elapsed = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    runner = engine.runner
    info = {
        "path": a.path,
        "graphs": getattr(runner, "graphs", None) is not None,
        "output_tok_s": n_out / elapsed,
        "decode_step_ms": 1e3 * decode_s / max(decode_steps, 1),
        "weight_bytes": weights,
        "kv_bytes_per_token": engine.kv_spec.bytes_per_token,
        "num_seqs": n,
        "mean_context": prompt + gen / 2,
        "first_tokens": first,
    }
    llm.close()
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (a small shape)")
    p.add_argument("--device", default=None)
    p.add_argument("--path", choices=sorted(PATHS), help=argparse.SUPPRESS)  # a worker
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.device = a.device or ("cpu" if a.tiny else "cuda")
    if a.path:
        print(json.dumps(worker(a)))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    model_dir = build(a.out / ("model-tiny" if a.tiny else "model-1b"), a.tiny, a.device)
    result: dict = {"bandwidth_gb_s": hbm_bandwidth(a.device) / 1e9}
    result["kernel"] = kernel_check(a.device, a.tiny)
    print("attention kernel:", json.dumps(result["kernel"]), flush=True)
    runs = []
    for path in PATHS:
        cmd = [sys.executable, __file__, "--out", str(a.out), "--path", path]
        cmd += ["--model-dir", str(model_dir), "--device", a.device] + ["--tiny"] * a.tiny
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            runs.append({"path": path, "error": proc.stderr[-2000:]})
            print(f"{path}: FAILED\n{proc.stderr[-2000:]}", flush=True)
            continue
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        bw = result["bandwidth_gb_s"] * 1e9
        step_bytes = (
            run["weight_bytes"] + run["num_seqs"] * run["mean_context"] * run["kv_bytes_per_token"]
        )
        run["roofline_step_ms"] = 1e3 * step_bytes / bw if bw else None
        if bw:
            run["roofline_fraction"] = run["roofline_step_ms"] / run["decode_step_ms"]
        runs.append(run)
        step, roof = run["decode_step_ms"], run["roofline_step_ms"]
        print(f"{path}: {run['output_tok_s']:.0f} tok/s, decode step {step:.2f} ms (roofline "
              f"{roof})", flush=True)  # fmt: skip
    ok = [r for r in runs if "first_tokens" in r]
    result["runs"] = runs
    result["greedy_agree"] = len({json.dumps(r["first_tokens"]) for r in ok}) == 1
    (a.out / "gpu_decode.json").write_text(json.dumps(result, indent=1))
    print("greedy tokens agree across paths:", result["greedy_agree"])
    if len(ok) != len(runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
