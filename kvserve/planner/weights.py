"""The weight bytes of a plan: the model's parameters in ``--dtype``, or, with
``--quantization auto|int8`` (CPU serving: GPUs dequantize), the matrices kvserve keeps
quantized at the size they are served at.

- ``auto``: a converted GGUF directory's raw blocks (``kvserve_quant.json``) of the types
  served quantized, at the kernels' bits a weight (``quantized.SERVED_BITS``: Q4_K and
  Q5_K keep their 6-bit scales as bytes, 4.625 and 5.625 bits where the file has 4.5 and
  5.5).
- ``int8``: those, and every other matrix ``--quantization int8`` quantizes
  (``quant_load.int8_shape_ok``; not the MoE experts) at one byte a weight plus a float32
  scale a row.

A preset (no checkpoint to read) is planned in ``--dtype``.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from kvserve.model.quant_load import int8_shape_ok, read_manifest
from kvserve.model.quantized import BLOCKS, SERVED_BITS
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
        elif ggml_type is None and quantization == "int8" and _int8(name, rows, cols):
            numel += rows * cols
            served += rows * (cols + 4)
    return int(served) + (num_params - numel) * elem


def _int8(name: str, rows: int, cols: int) -> bool:
    """Whether ``--quantization int8`` quantizes checkpoint matrix ``name``: what
    ``int8_shape_ok`` allows but a MoE expert's (stacked by the model, kept in float)."""
    return ".experts." not in name and int8_shape_ok(name, (rows, cols))


def _matrices(path: Path) -> dict[str, tuple[int, int]]:
    """Every 2-D tensor of the checkpoint in ``path`` and its shape (headers only)."""
    out: dict[str, tuple[int, int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2:
                    out[name] = (int(shape[0]), int(shape[1]))
    return out
