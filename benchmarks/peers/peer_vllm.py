"""Peer benchmark: offline batch generation throughput of vLLM's CPU build.

Run with the vLLM venv's interpreter (see benchmarks/VLLM_SETUP.md), not the project's::

    /work/venvs/vllm/bin/python benchmarks/peers/peer_vllm.py --model DIR \\
        --num-prompts 32 --input-len 256 --output-len 128 --seed 0 \\
        [--dtype bfloat16] [--json-out FILE]

Prompts are random token-id lists drawn from a NumPy generator seeded with ``--seed``
(ids in ``[0, vocab_size)``, ``vocab_size`` read from ``DIR/config.json``), so every run
and every engine given the same arguments sees the same prompts. No tokenizer is needed.
Generation is greedy, ignores EOS and produces exactly ``--output-len`` tokens per prompt.

One small warmup ``generate`` (different prompts, so no prefix-cache hits) runs first;
then a single ``generate`` over all prompts is timed. The result is printed and,
with ``--json-out``, written as JSON.

CPU tuning: vLLM reads its CPU settings from the environment. This script sets
defaults for them before importing vLLM (values already in the environment win):

* ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), default from ``--kvcache-space``.
* ``VLLM_CPU_OMP_THREADS_BIND``, default from ``--threads-bind``. vLLM's ``auto``
  keeps one core per worker for its engine-core process, which on a 2-core machine
  leaves a single OpenMP thread; ``all`` (this script's default) binds to every
  allowed CPU.
* ``LD_PRELOAD``: vLLM's CPU docs recommend preloading tcmalloc. If a
  ``libtcmalloc_minimal``/``libtcmalloc`` shared library is installed (Debian:
  ``libtcmalloc-minimal4``) it is prepended for vLLM's worker processes, which are
  spawned after this point; ``--no-tcmalloc`` turns that off. vLLM itself adds
  PyTorch's libgomp.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_KVCACHE_SPACE_GIB = 4
DEFAULT_THREADS_BIND = "all"
TCMALLOC_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.*",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.*",
    "/usr/lib64/libtcmalloc_minimal.so.*",
    "/usr/lib/libtcmalloc_minimal.so.*",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.*",
    "/usr/lib64/libtcmalloc.so.*",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", required=True, type=Path, help="HF-format model directory")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32, auto")
    p.add_argument("--json-out", type=Path, default=None, help="also write the result here")
    p.add_argument(
        "--kvcache-space",
        type=int,
        default=DEFAULT_KVCACHE_SPACE_GIB,
        help="GiB for VLLM_CPU_KVCACHE_SPACE (ignored if that variable is already set)",
    )
    p.add_argument(
        "--threads-bind",
        default=DEFAULT_THREADS_BIND,
        help=(
            "VLLM_CPU_OMP_THREADS_BIND value: 'all' = every allowed CPU, or a vLLM value "
            "('auto', 'nobind', '0-1', ...); ignored if that variable is already set"
        ),
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip torch.compile (faster start-up, usually slower decode)",
    )
    p.add_argument(
        "--no-tcmalloc",
        action="store_true",
        help="do not add an installed tcmalloc to LD_PRELOAD for vLLM's workers",
    )
    p.add_argument(
        "--shared-prefix-frac",
        type=float,
        default=0.0,
        help="fraction of every prompt that is one prefix shared by all prompts",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's enable_prefix_caching (default: vLLM's own default)",
    )
    p.add_argument("--warmup-prompts", type=int, default=2)
    p.add_argument("--warmup-output-len", type=int, default=8)
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc shared library, or None."""
    for pattern in TCMALLOC_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def configure_env(kvcache_space_gib: int, threads_bind: str, tcmalloc: bool) -> None:
    """Set vLLM CPU environment defaults; must run before ``import vllm``."""
    preload = os.environ.get("LD_PRELOAD", "")
    if tcmalloc and "tcmalloc" not in preload:
        lib = find_tcmalloc()
        if lib is not None:
            os.environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_space_gib))
    if threads_bind == "all":
        cpus = sorted(os.sched_getaffinity(0))
        threads_bind = ",".join(str(c) for c in cpus)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind)
    # The engine core is started in a child process; keep its logs readable.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def read_vocab_size(model_dir: Path) -> int:
    """Return ``vocab_size`` from the model's ``config.json``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg.get("vocab_size")
    if vocab is None and isinstance(cfg.get("text_config"), dict):
        vocab = cfg["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"no usable vocab_size in {model_dir / 'config.json'}")
    return vocab


def make_prompts(
    num: int, length: int, vocab_size: int, seed: int, shared_frac: float = 0.0
) -> list[list[int]]:
    """Random token-id prompts, deterministic for a given (num, length, vocab, seed,
    shared_frac); the first ``round(shared_frac * length)`` tokens are the same in all."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(num, length), dtype=np.int64)
    shared = round(shared_frac * length)
    if shared:
        ids[:, :shared] = np.random.default_rng(seed + 7).integers(0, vocab_size, shared)
    return [row.tolist() for row in ids]


def round_up(value: int, multiple: int) -> int:
    """Round ``value`` up to a multiple of ``multiple``."""
    return int(math.ceil(value / multiple) * multiple)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, warm it up, time one batch ``generate`` and return the result."""
    configure_env(args.kvcache_space, args.threads_bind, tcmalloc=not args.no_tcmalloc)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = args.model.resolve()
    vocab_size = read_vocab_size(model_dir)
    prompts = make_prompts(
        args.num_prompts, args.input_len, vocab_size, args.seed, args.shared_prefix_frac
    )
    # Separate stream for warmup so the timed prompts never hit the prefix cache.
    warm = make_prompts(args.warmup_prompts, args.input_len, vocab_size, args.seed + 1_000_003)

    max_model_len = round_up(args.input_len + args.output_len, 128)
    llm = LLM(
        model=str(model_dir),
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        max_num_seqs=max(args.num_prompts, args.warmup_prompts),
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        **({} if args.prefix_caching is None else {"enable_prefix_caching": args.prefix_caching}),
    )

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False
        )

    if args.warmup_prompts > 0:
        llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in warm],
            params(args.warmup_output_len),
            use_tqdm=False,
        )

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    sp = params(args.output_len)
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    input_tokens = sum(len(o.prompt_token_ids or []) for o in outputs)
    return {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": round(elapsed, 4),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / elapsed, 2),
        "total_tok_s": round((input_tokens + output_tokens) / elapsed, 2),
        "dtype": args.dtype,
        "seed": args.seed,
        "shared_prefix_frac": args.shared_prefix_frac,
        "prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kvcache_space_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
        "tcmalloc": "tcmalloc" in os.environ.get("LD_PRELOAD", ""),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
