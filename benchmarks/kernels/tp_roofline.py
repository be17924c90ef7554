"""Roofline arithmetic for tensor parallelism: Llama-3-70B on 8 x H100 (issue 15).

What ``kvserve plan`` says for the shape at TP=8 (weights and KV per GPU, concurrency),
and what one decode step would take from bandwidth alone: every GPU streams its weight
shard and its share of the batch's KV from HBM, and the step's all-reduces (2 per layer,
the batch's hidden states in bf16) cross NVLink. The hardware figures are the datasheet
numbers, and ``--ar-latency-us`` is an assumed per-all-reduce latency: arithmetic, not
a measurement.

    python benchmarks/kernels/tp_roofline.py --batch 64 --context 4096
"""

from __future__ import annotations

import argparse
import json

from kvserve.planner.capacity import PlanInput, kv_spec_for, plan, resolve_shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-3-70b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="sequences decoding together")
    p.add_argument("--context", type=int, default=4096, help="tokens of context each")
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="H100 SXM HBM3, TB/s")
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="per direction, GB/s")
    p.add_argument("--ar-latency-us", type=float, default=10.0, help="assumed, per all-reduce")
    a = p.parse_args()
    inp = PlanInput(model=a.model, gpu="H100", tp=a.tp, concurrency=a.batch, context=a.context)
    pl = plan(inp)
    shape = resolve_shape(a.model)
    per_gpu_kv_token = kv_spec_for(shape, inp, per_rank=True).bytes_per_token
    weights_gpu = pl.weight_bytes / a.tp
    kv_gpu = a.batch * a.context * per_gpu_kv_token
    t_weights = weights_gpu / (a.hbm_tbps * 1e12)
    t_kv = kv_gpu / (a.hbm_tbps * 1e12)
    ar_bytes = a.batch * shape.hidden_size * 2  # bf16 hidden states of the batch
    n_ar = 2 * shape.num_layers
    ring = 2 * (a.tp - 1) / a.tp * ar_bytes  # bytes each GPU sends in a ring all-reduce
    t_ar = n_ar * (ring / (a.nvlink_gbps * 1e9) + a.ar_latency_us * 1e-6)
    step = t_weights + t_kv + t_ar
    out = {
        "plan": {
            "weights_per_gpu_GB": weights_gpu / 1e9,
            "kv_bytes_per_token_per_gpu": per_gpu_kv_token,
            "kv_room_per_gpu_GB": pl.kv_bytes_per_gpu_available / 1e9,
            "max_concurrency_at_context": pl.max_concurrency_per_replica,
            "gpus_needed": pl.gpus_needed,
        },
        "decode_step_ms": {
            "weights_from_hbm": 1e3 * t_weights,
            "kv_from_hbm": 1e3 * t_kv,
            "all_reduce": 1e3 * t_ar,
            "total": 1e3 * step,
        },
        "all_reduce": {"count": n_ar, "bytes_each": ar_bytes, "share_of_step": t_ar / step},
        "output_tok_s_at_floor": a.batch / step,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
