"""``kvserve plan``: KV and weight memory, concurrency per GPU and GPUs needed for a model
(``planner.capacity``), or the KV demand recorded by ``--kv-usage-log`` / scraped by
Prometheus (``planner.usage``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvserve.config import KV_LAYOUTS


def register(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plan", help="KV and weight memory, concurrency per GPU, GPUs needed")
    pl.add_argument("--model", help="preset name, model directory or config.json")
    pl.add_argument("--usage", help="JSONL of KV usage samples recorded by --kv-usage-log")
    pl.add_argument("--tenant", default=None, help="with --usage: one tenant's demand only")
    pl.add_argument("--prometheus", help="Prometheus base URL scraping kvserve's /metrics")
    pl.add_argument("--range", default="14d", help="with --prometheus: how far back")
    pl.add_argument("--step", default="15s", help="with --prometheus: sample spacing")
    pl.add_argument(
        "--query",
        default="sum(kvserve_kv_cache_used_bytes)",
        help="with --prometheus: PromQL for KV demand in bytes (one series)",
    )
    pl.add_argument("--headroom", type=float, default=0.15, help="with --usage: P99 × (1+h)")
    pl.add_argument("--plot", help="with --usage: write a PNG of distribution and time series")
    pl.add_argument("--dtype", default="bfloat16", help="weight dtype")
    pl.add_argument(
        "--quantization",
        default="none",
        choices=("none", "auto", "int8"),
        help="CPU serving: auto counts a converted GGUF directory's quantized matrices at "
        "their served size, int8 also a float checkpoint's (GPUs dequantize: none)",
    )
    pl.add_argument("--kv-cache-dtype", default="auto", help="as the engine flag")
    pl.add_argument(
        "--kv-cache-scales",
        default="auto",
        choices=("auto", "token", "head"),
        help="fp8 scales as the engine flag (auto: token, a model shape has no scales)",
    )
    pl.add_argument("--concurrency", type=int, default=1, help="requests held at once")
    pl.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    pl.add_argument("--output-len", type=int, default=0, help="output tokens per request")
    pl.add_argument("--gpu", default="H100-80GB", help="GPU preset (e.g. H100, A100-40GB, L40S)")
    pl.add_argument("--gpu-memory", default=None, help="e.g. 48GiB, overrides --gpu")
    pl.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory used"
    )
    pl.add_argument("--overhead", default="1GiB", help="per GPU: activations, CUDA context")
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per replica")
    pl.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    hybrid = "as the engine flag: hybrid counts a sliding layer's window only"
    pl.add_argument("--kv-layout", default="auto", choices=KV_LAYOUTS, help=hybrid)
    pl.add_argument("--compare", action="append", help="key=value[,key=value] variant")
    pl.add_argument("--json", action="store_true", help="print the plans as JSON")
    pl.set_defaults(func=plan)


def plan(ns: argparse.Namespace) -> int:
    """Print the plans (base and each ``--compare`` variant), or the usage report with
    ``--usage`` / ``--prometheus``. Raises ``ValueError`` without a model."""
    from kvserve.planner.capacity import PlanInput, variant
    from kvserve.planner.capacity import plan as plan_for

    if ns.usage or ns.prometheus:
        return usage(ns)
    if not ns.model:
        raise ValueError("kvserve plan needs --model (or --usage FILE / --prometheus URL)")
    from kvserve.planner.report import print_plans
    from kvserve.utils import parse_size

    base = PlanInput(
        model=ns.model,
        dtype=ns.dtype,
        kv_cache_dtype=ns.kv_cache_dtype,
        kv_cache_scales=ns.kv_cache_scales,
        concurrency=ns.concurrency,
        context=ns.context,
        output_len=ns.output_len,
        gpu=ns.gpu,
        gpu_memory=None if ns.gpu_memory is None else parse_size(ns.gpu_memory),
        gpu_memory_utilization=ns.gpu_memory_utilization,
        overhead=parse_size(ns.overhead),
        tp=ns.tp,
        block_size=ns.block_size,
        kv_layout=ns.kv_layout,
        quantization=ns.quantization,
    )
    plans = [plan_for(base, "base")]
    plans += [plan_for(variant(base, spec), spec) for spec in ns.compare or []]
    if ns.json:
        print(json.dumps([dataclasses.asdict(x) for x in plans], indent=2))
    else:
        print_plans(plans)
    return 0


def usage(ns: argparse.Namespace) -> int:
    """The KV demand report of ``--usage FILE`` or ``--prometheus URL`` (warnings to
    stderr); a PNG with ``--plot``."""
    from kvserve.planner.report import print_usage
    from kvserve.planner.usage import analyze, load_usage

    if ns.prometheus:
        from kvserve.planner.prometheus import load_prometheus, parse_duration

        if ns.tenant:
            raise ValueError("--tenant applies to --usage FILE; with --prometheus use --query")
        ts, used = load_prometheus(
            ns.prometheus, parse_duration(ns.range), parse_duration(ns.step), ns.query
        )
    else:
        ts, used = load_usage(ns.usage, ns.tenant)
    report = analyze(ts, used, headroom=ns.headroom)
    if ns.plot:
        from kvserve.planner.plot import plot_usage

        plot_usage(ts, used, report, ns.plot)
    if ns.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print_usage(report)
    for w in report.warnings:
        print(f"kvserve: warning: {w}", file=sys.stderr)
    return 0
