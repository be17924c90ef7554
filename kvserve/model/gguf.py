"""GGUF checkpoints (llama.cpp's format) as ordinary HF model directories.

``--model FILE.gguf`` (or a directory holding one ``.gguf`` and no ``config.json``) is
converted once into a cache directory — ``config.json``, ``model.safetensors`` (the
tensors dequantized with the ``gguf`` package, in float32 so no value is rounded),
``tokenizer.json`` and ``tokenizer_config.json`` (vocabulary, merges, special tokens and
chat template from the file's metadata) — and every other part of kvserve loads that
directory as it loads any checkpoint. The cache key hashes the file's size and its
metadata and tensor index, so a replaced file is converted again; conversion runs under a
lock and publishes the directory atomically (two processes starting at once convert once).

Supported: ``general.architecture`` ``llama`` (Llama, Mistral, SmolLM …) with a byte-level
BPE tokenizer (``tokenizer.ggml.model`` ``gpt2``: Llama 3, SmolLM2 …). The served dtype
defaults to bfloat16 (``--dtype`` overrides). Anything else, and a truncated or corrupt
file, raises ``GGUFError`` naming the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.model.gguf_tokenizer import GGUFError, write_tokenizer

__all__ = ["GGUFError", "convert", "find_gguf", "resolve_model"]

logger = logging.getLogger(__name__)

_CONVERTER_VERSION = "1"  # bump when the produced directory changes
# GGUF tensor name (per layer after ``blk.N.``) → HF name (after ``model.layers.N.``)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


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


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"metadata lacks {key!r}")
        return default
    return field.contents()


def _config(reader: Any, has_output: bool) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"general.architecture {arch!r} is not supported (llama only)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    rope_dim = int(_field(reader, "llama.rope.dimension_count", hidden // heads))
    if rope_dim != hidden // heads:
        raise GGUFError("partial rotary (rope.dimension_count) is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "dtype": "bfloat16",  # the serving default; the tensors themselves are float32
    }


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary reordering of Q/K rows (each head's pairs interleaved back
    into HF's two halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(reader: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    from gguf import quants

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in _LAYER_NAMES:
            layer, rest = name.split(".", 2)[1:]
            hf = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
        elif name == "rope_freqs.weight":
            raise GGUFError("rope scaling factors (rope_freqs) are not supported")
        else:
            raise GGUFError(f"tensor {name!r} is not part of a llama model")
        try:
            data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise GGUFError(f"tensor {name!r} does not decode ({e})") from None
        shape = tuple(int(x) for x in reversed(t.shape))  # GGML lists dims innermost first
        if data.size != int(np.prod(shape)):
            raise GGUFError(f"tensor {name!r} is truncated")
        data = data.reshape(shape)
        if name.endswith("attn_q.weight"):
            data = _unpermute(data, heads)
        elif name.endswith("attn_k.weight"):
            data = _unpermute(data, kv_heads)
        out[hf] = np.ascontiguousarray(data)
    return out


def _write_checkpoint(path: Path, reader: Any, out: Path) -> None:
    from safetensors.numpy import save_file

    has_output = any(t.name == "output.weight" for t in reader.tensors)
    try:  # the helpers' messages say what is wrong; this names the file
        config = _config(reader, has_output)
        tensors = _tensors(reader, config)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=1))
        write_tokenizer(reader, out)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    (out / "SOURCE").write_text(f"{path.resolve()}\n")
