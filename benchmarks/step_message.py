"""The size of the step message tensor-parallel ranks receive, per step.

Under ``--tensor-parallel-size > 1`` the engine core pickles one ``WorkerStep`` (the step's
copy lists and its ``StepInputs``: ids, positions, attention metadata with block tables,
``SampleRow``s) to every rank each step. This measures those bytes on an in-process engine
— the same message the executor would send, built by the same ``InputBuilder`` — for
decode steps and for steps with prefill, greedy and with a repetition penalty (whose
sampler rows carry the request's prompt and output ids every step). It is the "before"
of issue 51's per-rank input building, where the message carries deltas only.

    python benchmarks/step_message.py --model /tmp/kvserve-bench/smollm2-135m-instruct \\
        --out benchmarks/results/step_message.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from offline import prompts, vocab_of


def measure(model: str, penalty: float, num: int, input_len: int, output_len: int) -> dict:
    from kvserve import LLM, SamplingParams
    from kvserve.worker.inputs import WorkerStep

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
        inputs = runner.builder.build(out.scheduled) if out.scheduled else None
        size = len(pickle.dumps(WorkerStep.of(out, inputs), protocol=pickle.HIGHEST_PROTOCOL))
        decode = all(s.num_new_tokens == 1 for s in out.scheduled)
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
