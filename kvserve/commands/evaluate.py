"""``kvserve eval perplexity``: held-out perplexity through the engine, with the KV
options given (dtype, window, layout)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvserve.commands import model_or_default
from kvserve.config import EngineArgs


def register(sub: argparse._SubParsersAction) -> None:
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
    ppl.set_defaults(func=perplexity)


def perplexity(ns: argparse.Namespace) -> int:
    """Print the perplexity (or, with ``--json``, the result and the engine's info)."""
    from kvserve.default_model import corpus_files
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.evaluation import perplexity as score

    model_or_default(ns)
    files = ns.files or [str(f) for f in corpus_files("heldout")]
    engine = LLMEngine(EngineArgs.from_cli(ns))
    result = score(engine, files, ns.context, max_tokens_per_file=ns.max_tokens_per_file)
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
