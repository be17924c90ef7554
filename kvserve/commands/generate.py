"""``kvserve generate``: text from one or more prompts, offline (``kvserve.LLM``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from kvserve.commands import model_or_default
from kvserve.config import EngineArgs


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text offline from one or more prompts")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable; else stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the top k (0: all)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below p x the top one")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    gen.set_defaults(func=generate)


def generate(ns: argparse.Namespace) -> int:
    """Print each prompt's completion (and, at info level, the output tokens per second)."""
    from kvserve import LLM, SamplingParams

    model_or_default(ns)
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
