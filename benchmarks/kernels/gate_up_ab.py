"""Paired A/B in one process: the MLP's fused gate/up + SiLU kernel vs the two ops.

Whole-run throughput on this 2-core machine moves ±5 % between runs, more than a few-percent
change in one op. This benchmark removes that noise: one engine on a bf16 checkpoint, its
MLPs switched between ``KernelGateUpSilu`` (as loaded) and ``KernelLinear`` + ``silu_and_mul``
(built from the checkpoint's own gate/up weights) every few steps, with 32 sequences
decoding and then 8 x 256-token prefill steps. Prints the median of each side and of the
paired differences (fused minus unfused; negative is a saving).

    python benchmarks/kernels/gate_up_ab.py --model /tmp/kvserve-bench/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.model.linear import KernelGateUpSilu, KernelLinear


def _unfused(model_dir: Path, layers: int) -> list[KernelLinear]:
    """One KernelLinear per layer over [gate; up], from the checkpoint's tensors."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out = []
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        w = torch.cat([state[p + "gate_proj.weight"], state[p + "up_proj.weight"]]).bfloat16()
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        out.append(KernelLinear(lin))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a bf16 HF checkpoint directory")
    ap.add_argument("--rounds", type=int, default=10, help="decode rounds per side")
    ap.add_argument("--steps", type=int, default=6, help="decode steps per round")
    ap.add_argument("--prefill-rounds", type=int, default=6, help="prefill steps per side")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()

    llm = LLM(str(a.model), dtype="bfloat16", kv_cache_memory="2GiB", max_num_batched_tokens=2048)
    eng = llm.engine
    mlps = [layer.mlp for layer in eng.runner.model.layers]
    fused = [m.gate_up_proj for m in mlps]
    if not all(isinstance(f, KernelGateUpSilu) for f in fused):
        raise SystemExit("this machine/model does not use the fused gate/up kernel")
    plain = _unfused(a.model, len(mlps))

    def use(on: bool) -> None:
        for m, f, p in zip(mlps, fused, plain, strict=True):
            m.gate_up_proj, m.gate_up_applies_silu = (f, True) if on else (p, False)

    vocab = eng.runner.model.spec.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True, detokenize=False)
    for i in range(32):
        eng.add_request(f"d{i}", rng.integers(0, vocab, 256).tolist(), params)
    while eng.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.running
    ):
        eng.step()
    decode: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(2 * a.rounds):
        on = (rnd // 2 + rnd) % 2 == 0  # ABBA order: neither side always goes first
        use(on)
        eng.step()
        t = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        decode[on].append((time.perf_counter() - t) / a.steps * 1e3)
    for i in range(32):
        eng.abort_request(f"d{i}")
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    prefill: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(2 * a.prefill_rounds):
        on = (rnd // 2 + rnd) % 2 == 0
        use(on)
        ids = [f"p{rnd}.{i}" for i in range(8)]
        for rid in ids:
            eng.add_request(rid, rng.integers(0, vocab, 256).tolist(), one)
        t = time.perf_counter()
        eng.step()
        prefill[on].append((time.perf_counter() - t) * 1e3)
        for rid in ids:
            eng.abort_request(rid)
    report = {}
    for name, r in (("decode_step_ms", decode), ("prefill_step_ms", prefill)):
        diffs = [f - u for f, u in zip(r[True], r[False], strict=True)]
        report[name] = {
            "fused_median": statistics.median(r[True]),
            "unfused_median": statistics.median(r[False]),
            "paired_diff_median": statistics.median(diffs),
            "paired_diff_mean": statistics.mean(diffs),
        }
        row = report[name]
        print(
            f"{name}: fused {row['fused_median']:.2f}, unfused {row['unfused_median']:.2f}, "
            f"paired difference median {row['paired_diff_median']:+.2f} / mean "
            f"{row['paired_diff_mean']:+.2f}"
        )
    if a.json_out:
        a.json_out.write_text(json.dumps({"model": str(a.model), **report}, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
