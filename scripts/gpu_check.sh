#!/usr/bin/env bash
# GPU check for a session that draws a device machine (see the device tool's README).
# The device image has torch, transformers, pytest, hypothesis, tokenizers, safetensors,
# jinja2, tqdm and ninja, and no network, so the project runs from the tree via PYTHONPATH.
# (The server tests need fastapi/uvicorn/openai, absent there, so they are not run.)
# Tests pick device "auto" = cuda there (the CPU-kernel variants pin device cpu).
#   run: bash scripts/gpu_check.sh    (about 2-4 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_model_vs_hf.py tests/test_engine.py tests/test_api.py \
  tests/test_prefix_cache.py tests/test_kv_quant.py tests/test_sliding_window.py \
  2>&1 | tee "$OUT/pytest.txt"
# KV capacity from gpu_memory_utilization after the profiling pass, and a quick throughput.
python3 - <<'PY' 2>&1 | tee "$OUT/capacity.txt"
import logging, time, torch
logging.basicConfig(level=logging.INFO)
from benchmarks.offline import build_model, prompts
from kvserve import LLM, SamplingParams
d = build_model(__import__("pathlib").Path("/tmp/smol-bench"))
llm = LLM(str(d), dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=512)
print("engine info", llm.engine.info(), "device", llm.engine.device)
ps = prompts(256, 256, 8192, 0)
p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False)
llm.generate(ps[:4], p, use_tqdm=False)
t = time.perf_counter(); outs = llm.generate(ps, p, use_tqdm=False); el = time.perf_counter() - t
print(f"256 x (256 in, 128 out) bf16: {256 * 128 / el:.0f} output tok/s in {el:.1f}s")
PY
