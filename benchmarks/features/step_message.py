"""The size of the step message tensor-parallel ranks receive, per step.

Under ``--tensor-parallel-size > 1`` the engine core pickles the step's
``SchedulerOutput`` to every rank: plain data, the deltas of the requests each rank keeps
a copy of (new requests whole, then each known request's new tokens and blocks), plus the
copy lists and grammar masks; each rank builds its own inputs. This measures those bytes
on an in-process engine — the same object the executor publishes — for decode steps and
for steps with prefill, greedy and with a repetition penalty.

Before issue 51's per-rank input building (7db6425) the message was a ``WorkerStep`` with
the inputs built on the engine's side (``results/step_message.json``); its sampler rows
carried every penalized request's prompt and output ids each step.

    python benchmarks/features/step_message.py --model /tmp/kvserve-bench/smollm2-135m-instruct \
        --out benchmarks/results/step_message_deltas.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
from pathlib import Path

from kvserve.testing.bench import prompts, vocab_of


def measure(model: str, penalty: float, num: int, input_len: int, output_len: int) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        kv_cache_memory="1GiB",
        max_model_len=input_len + output_len,
        max_num_batched_tokens=2048,
    )
    engine = llm.engine
    runner = engine.runner
    sizes: dict[str, list[int]] = {"decode": [], "prefill": []}
    inner = runner.step

    def step(out):
        size = len(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        decode = all(n == 1 for n in out.num_scheduled_tokens.values())
        sizes["decode" if decode else "prefill"].append(size)
        return inner(out)

    runner.step = step  # measuring only: the engine is thrown away after
    params = SamplingParams(
        max_tokens=output_len,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=penalty,
        detokenize=False,
    )
    for i, ids in enumerate(prompts(num, input_len, vocab_of(Path(model)), seed=0)):
        engine.add_request(f"m-{i}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        kind: {
            "steps": len(v),
            "mean_bytes": round(statistics.fmean(v)) if v else 0,
            "max_bytes": max(v, default=0),
        }
        for kind, v in sizes.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF model directory")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    results = {
        name: measure(a.model, penalty, a.num_prompts, a.input_len, a.output_len)
        for name, penalty in (("greedy", 1.0), ("repetition_penalty", 1.1))
    }
    doc = {"workload": vars(a), "results": results}
    print(json.dumps(results, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
