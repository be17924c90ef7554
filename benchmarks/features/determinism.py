"""How many of N seeded sampled texts change with the batch, the chunking or the prefix cache.

The reference is every request run alone (prefix cache off); each other configuration runs
the same (prompt, seed) pairs and counts the requests whose tokens differ from it:

    python benchmarks/features/determinism.py --model /tmp/kvserve-bench/smollm2-135m-instruct

Prompts: words of one sentence in varying lengths (so prompts share prefixes), temperature
0.8, ``ignore_eos``. Run it with ``PYTHONPATH`` pointing at another checkout to measure that
one (README, "Determinism", says what is guaranteed).
"""

from __future__ import annotations

import argparse
import json
import time

from tqdm import tqdm

from kvserve import LLM, SamplingParams
from kvserve.default_model import DEFAULT_MODEL_DIR

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
    "wizards",
    "brew",
    "tea",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    n = a.num_prompts
    prompts = [
        " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(20 + (i * 7) % 60))
        for i in range(n)
    ]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=a.max_tokens, ignore_eos=True)
        for i in range(n)
    ]

    def run(llm: LLM, group: int) -> list[list[int]]:
        out: list[list[int]] = []
        for s in range(0, n, group):
            res = llm.generate(prompts[s : s + group], params[s : s + group], use_tqdm=False)
            out += [list(r.outputs[0].token_ids) for r in res]
        return out

    def make(**kw) -> LLM:
        return LLM(a.model, dtype=a.dtype, **kw)

    configs = [
        ("4 at a time", {"enable_prefix_caching": False}, [4]),
        ("32 at a time", {"enable_prefix_caching": False}, [n]),
        ("32 at a time, --max-num-batched-tokens 64",
         {"enable_prefix_caching": False, "max_num_batched_tokens": 64}, [n]),
        ("prefix cache: one by one, again, then 8 at a time", {}, [1, 1, 8]),
    ]  # fmt: skip
    start = time.time()
    ref = run(make(enable_prefix_caching=False), 1)
    rows: dict[str, list[int]] = {}
    for name, kw, groups in tqdm(configs, desc="configurations"):
        llm = make(**kw)
        rows[name] = [sum(o != r for o, r in zip(run(llm, g), ref, strict=True)) for g in groups]
        del llm
    print(f"{a.model} ({a.dtype}), {n} requests x {a.max_tokens} tokens; differ from one-by-one:")
    for name, counts in rows.items():
        print(f"  {name:<52} {' / '.join(map(str, counts))} of {n}")
    print(f"({time.time() - start:.0f} s)")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"model": a.model, "dtype": a.dtype, "n": n, "differ": rows}, f, indent=2)


if __name__ == "__main__":
    main()
