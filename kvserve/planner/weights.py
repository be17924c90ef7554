"""The weight bytes of a plan: the model's parameters in ``--dtype``, or, with
``--quantization auto|int8`` (CPU serving: GPUs dequantize), the matrices kvserve keeps
quantized at the size they are served at.

- ``auto``: a converted GGUF directory's raw blocks (``kvserve_quant.json``) of the types
  served quantized, at the kernels' bits a weight (``quantized.SERVED_BITS``: Q4_K and
  Q5_K keep their 6-bit scales as bytes, 4.625 and 5.625 bits where the file has 4.5 and
  5.5).
- ``int8``: those, and every other matrix ``--quantization int8`` quantizes
  (``quant_load.int8_shape_ok``: every expert's projections too, not the routers) at one
  byte a weight plus a float32 scale a row.

A preset (no checkpoint to read) is planned in ``--dtype``.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from kvserve.model.gpt_oss import model_names
from kvserve.model.quant_load import int8_shape_ok, read_manifest
from kvserve.model.quantized import BLOCKS, SERVED_BITS
from kvserve.model.spec import load_model_spec
from kvserve.utils import parse_dtype

QUANTIZATION = ("none", "auto", "int8")


def weight_bytes(model: str, num_params: int, dtype: str, quantization: str) -> int:
    """Bytes of the weights of ``model`` (``num_params`` parameters) as served with
    ``quantization``; ValueError for an unknown mode."""
    if quantization not in QUANTIZATION:
        raise ValueError(f"quantization {quantization!r} is not one of {QUANTIZATION}")
    elem = parse_dtype(dtype).itemsize
    path = Path(model)
    path = path.parent if path.name == "config.json" else path
    if quantization == "none" or not path.is_dir():
        return num_params * elem
    manifest = read_manifest(path)
    numel, served = 0, 0.0
    for name, (rows, cols) in _matrices(path).items():
        ggml_type = manifest.get(name)
        if ggml_type in SERVED_BITS:
            per, size = BLOCKS[ggml_type]
            k = cols // size * per  # raw rows: [rows, row bytes]
            numel += rows * k
            served += rows * k * SERVED_BITS[ggml_type] / 8
        elif ggml_type is None and quantization == "int8" and int8_shape_ok(name, (rows, cols)):
            numel += rows * cols
            served += rows * (cols + 4)
    return int(served) + (num_params - numel) * elem


def _matrices(path: Path) -> dict[str, tuple[int, int]]:
    """Every matrix of the checkpoint in ``path`` and its ``[out, in]`` shape (headers
    only): its 2-D tensors, and each expert's projections of a stacked gpt-oss tensor
    (``[experts, in, out]``, or MXFP4 blocks ``[experts, out, groups, 16]``) under the
    model's names for them."""
    spec = load_model_spec(path) if (path / "config.json").is_file() else None
    out: dict[str, tuple[int, int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = [int(n) for n in f.get_slice(name).get_shape()]
                parts = model_names(spec, name) if spec is not None else [name]
                if len(shape) == 2:
                    out[name] = (shape[0], shape[1])
                elif len(parts) > 1 and len(shape) in (3, 4):  # stacked experts
                    rows, cols = (shape[1], shape[2] * 32) if len(shape) == 4 else shape[2:0:-1]
                    per = len(parts) // shape[0]  # gate and up: the rows halved
                    out.update((part, (rows // per, cols)) for part in parts)
    return out
