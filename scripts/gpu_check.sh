#!/usr/bin/env bash
# The GPU check: one short call on a lent device machine (scripts/gpu_wheels.sh first, here,
# then the device tool's run with carry=[".whl"]), results under $OUT:
#   bash scripts/gpu_check.sh          # ≤ 8 min on an H100
# 1. the Triton kernels' and CUDA graphs' tests on CUDA (tests/triton: kernels against
#    torch references, batch invariance, the engine's greedy text vs the SDPA path),
# 2. HF parity on CUDA (the model tests' torch-backend variants),
# 3. benchmarks/kernels/gpu_decode.py: the kernel on real sizes, a Llama-3.2-1B-shaped model at
#    c = 64 (512 → 128) on Triton + CUDA graphs, Triton eager and SDPA, the HBM bandwidth
#    and the decode step's roofline; the engine logs its GPU memory plan (a table).
# Without a GPU it is a dry run: it says so, checks that what it would run exists and that
# the benchmark script runs (a tiny shape under Triton's interpreter), and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
TESTS=(tests/triton tests/model/test_model_vs_hf.py)

# GPU_CHECK_DRY=1 asks for the dry run on any machine (the test of this script does)
if [ "${GPU_CHECK_DRY:-0}" = 1 ] \
  || ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no GPU found (torch.cuda.is_available() is False) or GPU_CHECK_DRY=1: dry run"
  for t in "${TESTS[@]}" benchmarks/kernels/gpu_decode.py scripts/triton_compile_check.py; do
    [ -e "$t" ] || { echo "gpu_check: $t is missing"; exit 1; }
  done
  TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 benchmarks/kernels/gpu_decode.py --tiny --out "$OUT/dry" > "$OUT/dry.log" 2>&1 \
    || { echo "gpu_check: the benchmark's smoke run failed:"; tail -30 "$OUT/dry.log"; exit 1; }
  echo "gpu_check: dry run ok (the tests and the benchmark are in place; nothing ran on a GPU)"
  exit 0
fi

if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (scripts/gpu_wheels.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider -x "${TESTS[@]}" 2>&1 | tee "$OUT/pytest.txt" \
  || status=1
timeout 300 python3 benchmarks/kernels/gpu_decode.py --out "$OUT/bench" 2>&1 | tee "$OUT/bench.txt" \
  || status=1
cp "$OUT/bench/gpu_decode.json" "$OUT/" 2>/dev/null
exit $status
