"""``kvserve`` command line: ``generate`` (offline), ``plan`` (capacity), ``eval perplexity``
(quality), ``serve`` (OpenAI-compatible server), ``router`` (the front of a cluster of
servers), ``bench serve`` (load generator). Engine flags map one-to-one to ``EngineArgs``
fields, router flags to ``RouterConfig``; ``--model`` defaults to the bundled default model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from kvserve.config import KV_LAYOUTS, EngineArgs
from kvserve.flags import add_flags, from_flags
from kvserve.router.config import RouterConfig
from kvserve.server.config import ServerConfig


def _default_model() -> str:
    from kvserve.default_model import default_model_path

    return str(default_model_path())


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the top k (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below p x the top one")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def _generate(ns: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    if ns.model is None:
        ns.model = _default_model()
    args = EngineArgs.from_cli(ns)
    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        seed=ns.seed,  # the engine --seed also seeds sampling, so runs repeat
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )
    llm = LLM(**dataclasses.asdict(args))
    prompts = ns.prompt or [sys.stdin.read()]
    start = time.perf_counter()
    if ns.chat:
        outs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_out = 0
    for out in outs:
        comp = out.outputs[0]
        n_out += len(comp.token_ids)
        if ns.echo and out.prompt is not None:
            sys.stdout.write(out.prompt)
        sys.stdout.write(comp.text + "\n")
    logging.getLogger("kvserve").info(
        "%d output tokens in %.2fs (%.1f tok/s)", n_out, elapsed, n_out / max(elapsed, 1e-9)
    )
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from kvserve.server.serve import run_server

    if ns.model is None:
        ns.model = _default_model()
    engine_args = EngineArgs.from_cli(ns)
    parallel = engine_args.parallel_config()
    if parallel.node_rank > 0:  # another node's ranks only: no engine core, no server
        from kvserve.worker.executor import run_headless

        logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(message)s")
        return run_headless(parallel)
    config = from_flags(ServerConfig, ns)
    if config.tenants is not None and engine_args.prefix_cache_isolation is None:
        # tenants do not learn from one another's TTFT what the others sent
        engine_args = dataclasses.replace(engine_args, prefix_cache_isolation="tenant")
    elif config.tenants is not None and engine_args.prefix_cache_isolation == "none":
        logging.getLogger("kvserve").warning(
            "--prefix-cache-isolation none with --tenants: tenants share prefix blocks, so a "
            "tenant can tell from its time to first token whether another sent a prompt"
        )
    if config.role != "both" and not engine_args.cluster:
        raise ValueError("--role prefill|decode needs --cluster (a router hands requests over)")
    if config.role == "prefill" and "standby" not in engine_args.replicate_to:
        # the prompt's blocks go straight to the decode worker (the router makes it the
        # request's standby), besides the shared tier
        engine_args = dataclasses.replace(
            engine_args, replicate_to=(*engine_args.replicate_to, "standby")
        )
    run_server(engine_args, config, ns.log_level)
    return 0


def _router(ns: argparse.Namespace) -> int:
    from kvserve.router.serve import run_router

    config = from_flags(RouterConfig, ns)
    run_router(config, ns.log_level)
    return 0


def _hash_key(ns: argparse.Namespace) -> int:
    from kvserve.tenants import hash_key

    print(hash_key(ns.key))
    return 0


def _check_tenants(ns: argparse.Namespace) -> int:
    from kvserve.tenants import TenantsConfig

    budgets = TenantsConfig.load(ns.file).resolve(ns.pool_blocks, ns.block_size, ns.bytes_per_block)
    for b in budgets.values():
        print(
            f"{b.tenant.name}: priority {b.tenant.priority}, reservation "
            f"{b.reservation_blocks} blocks, limit {b.limit_blocks} blocks"
        )
    return 0


def _bench_serve(ns: argparse.Namespace) -> int:
    from kvserve.bench_serve import main as bench_main

    return bench_main(ns)


def _eval_perplexity(ns: argparse.Namespace) -> int:
    import json

    from kvserve.default_model import corpus_files
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.evaluation import perplexity

    if ns.model is None:
        ns.model = _default_model()
    files = ns.files or [str(f) for f in corpus_files("heldout")]
    engine = LLMEngine(EngineArgs.from_cli(ns))
    result = perplexity(engine, files, ns.context, max_tokens_per_file=ns.max_tokens_per_file)
    if ns.json:
        fields = dataclasses.asdict(result)
        del fields["token_logprobs"]  # one number per token: not for a terminal
        print(json.dumps(fields | {"engine": engine.info()}, indent=2))
    else:
        print(
            f"perplexity {result.perplexity:.3f} (NLL {result.nll:.4f} nats/token) over "
            f"{result.num_tokens} tokens in {result.num_windows} windows of {result.context}; "
            f"kv_cache_dtype {engine.kv_format.name}, sliding_window {engine.window}"
        )
    return 0


def _plan_usage(ns: argparse.Namespace) -> int:
    import json

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


def _plan(ns: argparse.Namespace) -> int:
    import json

    from kvserve.planner.capacity import PlanInput, plan, variant

    if ns.usage or ns.prometheus:
        return _plan_usage(ns)
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
    )
    plans = [plan(base, "base")]
    plans += [plan(variant(base, spec), spec) for spec in ns.compare or []]
    if ns.json:
        print(json.dumps([dataclasses.asdict(x) for x in plans], indent=2))
    else:
        print_plans(plans)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    levels = ("debug", "info", "warning", "error", "DEBUG", "INFO", "WARNING", "ERROR")
    log_help = "logging level (default: info)"
    parser.add_argument("--log-level", default="INFO", choices=levels, help=log_help)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline from one or more prompts")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable; else stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(sv, serve=True)
    add_flags(sv, ServerConfig)
    sv.set_defaults(func=_serve)

    rt = sub.add_parser("router", help="OpenAI-compatible front of a cluster (failover)")
    add_flags(rt, RouterConfig)
    rt.set_defaults(func=_router)

    bn = sub.add_parser("bench", help="benchmarks against a running server")
    bn_sub = bn.add_subparsers(dest="bench_command", required=True)
    bs = bn_sub.add_parser("serve", help="async load generator for OpenAI-compatible servers")
    from kvserve.bench_serve import add_args as _bench_args

    _bench_args(bs)
    bs.set_defaults(func=_bench_serve)

    tn = sub.add_parser("tenants", help="tenant file helpers")
    tn_sub = tn.add_subparsers(dest="tenants_command", required=True)
    hk = tn_sub.add_parser("hash-key", help="print the stored form of an API key")
    hk.add_argument("key")
    hk.set_defaults(func=_hash_key)
    ck = tn_sub.add_parser("check", help="validate a tenants file against a KV pool size")
    ck.add_argument("file")
    ck.add_argument("--pool-blocks", type=int, required=True, help="KV blocks of the pool")
    ck.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ck.add_argument(
        "--bytes-per-block", type=int, required=True, help="bytes of one block (all layers)"
    )
    ck.set_defaults(func=_check_tenants)

    ev = sub.add_parser("eval", help="quality measurements through the serving path")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser(
        "perplexity", help="held-out perplexity with the given KV options (dtype, window)"
    )
    EngineArgs.add_cli_args(ppl)
    ppl.add_argument(
        "--files",
        nargs="+",
        help="text files to score (default: the default model's held-out standard-library files)",
    )
    ppl.add_argument("--context", type=int, default=512, help="tokens per scored window")
    ppl.add_argument(
        "--max-tokens-per-file", type=int, default=None, help="score at most this many per file"
    )
    ppl.add_argument("--json", action="store_true", help="print the result as JSON")
    ppl.set_defaults(func=_eval_perplexity)

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
    pl.set_defaults(func=_plan)
    # ``--log-level`` also after the subcommand (``kvserve serve --log-level debug``)
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for sp in getattr(action, "choices", {}).values():
            sp.add_argument("--log-level", default=argparse.SUPPRESS, choices=levels, help=log_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # the openai client logs every HTTP request at INFO: noise over progress bars (bench
    # serve) and over the server's own log
    for chatty in ("httpx", "httpx2", "httpcore", "httpcore2", "openai"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
