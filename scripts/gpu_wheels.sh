#!/usr/bin/env bash
# Wheels the device machine's image lacks (see the device tool's KINDS.md: Python 3.12,
# torch, Triton, no msgspec or pyzmq), fetched HERE into .whl/ for `run`'s carry=[".whl"];
# scripts/gpu_check.sh installs whatever .whl/ holds. Run once before the device call:
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  msgspec==0.19.0 pyzmq==27.1.0
ls -la .whl
