"""GGUF checkpoints (llama.cpp's format) as ordinary HF model directories.

``--model FILE.gguf`` (or a directory holding one ``.gguf`` and no ``config.json``) is
converted once into a cache directory — ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` (vocabulary, merges, special tokens and
chat template from the file's metadata) — and every other part of kvserve loads that
directory as it loads any checkpoint. In ``model.safetensors``, the projections and
embeddings stored as ``Q4_0``, ``Q4_1``, ``Q4_K`` or ``Q8_0`` keep their raw blocks (uint8
``[rows, row_bytes]``, rows in HF's order; ``kvserve_quant.json`` names each one's type:
``model/quantized.py`` serves them quantized or dequantizes them at load); every other
tensor is dequantized with the ``gguf`` package, in float32 so no value is rounded. The
cache key hashes the file's size and its metadata and tensor index, so a replaced file is
converted again; conversion runs under a lock and publishes the directory atomically (two
processes starting at once convert once).

Supported: ``general.architecture`` ``llama`` (Llama, Mistral, SmolLM …), ``qwen2``,
``qwen3``, ``qwen3moe``, ``qwen2moe``, ``phi3``, ``gemma2``, ``gemma3`` and ``gpt-oss``
(``model/gguf_arch.py`` says how each maps to HF), with the tokenizers
``model/gguf_tokenizer.py`` converts. The served dtype defaults to bfloat16 (``--dtype``
overrides). Anything else, and a truncated or corrupt file, raises ``GGUFError`` naming
the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.model.gguf_arch import architecture, hf_config, hf_tensors
from kvserve.model.gguf_tokenizer import GGUFError, write_tokenizer
from kvserve.model.quantized import QUANT_MANIFEST, kept_quantized, row_bytes

__all__ = ["GGUFError", "convert", "find_gguf", "resolve_model"]

logger = logging.getLogger(__name__)

_CONVERTER_VERSION = "4"  # bump when the produced directory changes


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names (the file, or the only ``.gguf`` of a directory that
    has no ``config.json``); None for an HF directory or anything else."""
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path}: holds {len(files)} .gguf files; pass one as --model")
        return files[0] if files else None
    return None


def resolve_model(model: str) -> str:
    """``model`` itself for an HF directory; for a GGUF file, its converted directory."""
    found = find_gguf(model)
    return model if found is None else str(convert(found))


def _reader(path: Path):
    import gguf  # a dependency; imported only when a GGUF file is served

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # truncated, corrupt, not GGUF at all
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _cache_root() -> Path:
    """``$KVSERVE_CACHE_DIR/gguf``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)``/kvserve/gguf``."""
    if os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(os.environ["KVSERVE_CACHE_DIR"]) / "gguf"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve" / "gguf"


def cache_key(path: Path, reader: Any) -> str:
    """Hash of the converter version, the file size, the metadata and the tensor index."""
    h = hashlib.sha256(f"{_CONVERTER_VERSION}|{path.stat().st_size}".encode())
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml."):  # large arrays: their length is enough
            h.update(f"{name}:{len(field.data)}".encode())
            continue
        h.update(name.encode())
        for part in field.parts:
            h.update(bytes(part))
    for t in reader.tensors:
        h.update(f"{t.name}|{t.tensor_type}|{list(t.shape)}|{t.data_offset}".encode())
    return h.hexdigest()[:16]


def convert(path: Path) -> Path:
    """The converted directory of ``path`` (building it on first use). Raises GGUFError."""
    reader = _reader(path)
    out = _cache_root() / f"{path.stem}-{cache_key(path, reader)}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting it now
        if (out / "config.json").is_file():
            return out
        logger.warning("converting %s into %s (first start with this file only)", path, out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            _write_checkpoint(path, reader, tmp)
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return out


# HF tensors kept in their GGUF blocks when stored so: dense projections and embeddings
_RAW_NAMES = re.compile(
    r"(model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)"
    r"|model\.embed_tokens|lm_head)\.weight"
)


def _raw_tensors(
    t: Any, arch: str, config: dict[str, Any], manifest: dict[str, str]
) -> list[tuple[str, np.ndarray]] | None:
    """Tensor ``t``'s HF tensors as raw blocks (recorded in ``manifest``), or None when it
    is not one kept so (another type, not a dense projection or embedding)."""
    kind = t.tensor_type.name
    if not kept_quantized(kind) or len(t.shape) != 2:
        return None
    raw = np.asarray(t.data, dtype=np.uint8)
    rows, k = int(t.shape[1]), int(t.shape[0])
    if raw.size != rows * row_bytes(kind, k):
        raise GGUFError(f"tensor {t.name!r} is truncated")
    pairs = hf_tensors(arch, t.name, raw.reshape(rows, -1), config)  # row moves only
    if not all(_RAW_NAMES.fullmatch(hf) for hf, _ in pairs):
        return None
    manifest.update({hf: kind for hf, _ in pairs})
    return [(hf, np.ascontiguousarray(v)) for hf, v in pairs]


def _tensors(
    reader: Any, arch: str, config: dict[str, Any], manifest: dict[str, str]
) -> dict[str, np.ndarray]:
    from gguf import quants

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        raw = _raw_tensors(t, arch, config, manifest)
        if raw is not None:
            out.update(raw)
            continue
        try:
            data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise GGUFError(f"tensor {name!r} does not decode ({e})") from None
        shape = tuple(int(x) for x in reversed(t.shape))  # GGML lists dims innermost first
        if data.size != int(np.prod(shape)):
            raise GGUFError(f"tensor {name!r} is truncated")
        for hf, value in hf_tensors(arch, name, data.reshape(shape), config):
            out[hf] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def _write_checkpoint(path: Path, reader: Any, out: Path) -> None:
    from safetensors.numpy import save_file

    has_output = any(t.name == "output.weight" for t in reader.tensors)
    try:  # the helpers' messages say what is wrong; this names the file
        config = hf_config(reader, has_output)
        manifest: dict[str, str] = {}
        tensors = _tensors(reader, architecture(reader), config, manifest)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / QUANT_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        (out / "config.json").write_text(json.dumps(config, indent=1))
        write_tokenizer(reader, out, path)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    (out / "SOURCE").write_text(f"{path.resolve()}\n")
