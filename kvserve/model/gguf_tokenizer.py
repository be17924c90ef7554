"""A GGUF file's tokenizer metadata → ``tokenizer.json`` + ``tokenizer_config.json``.

Byte-level BPE with GPT-2's pre-tokenization (``tokenizer.ggml.model`` ``gpt2`` and
``tokenizer.ggml.pre`` absent, ``default``, ``gpt2`` or ``smollm``) is converted here:
the vocabulary, merges and token types become a ``tokenizers`` BPE model with byte-level
pre-tokenization and decoding; control tokens become special added tokens, user-defined
ones plain added tokens. The chat template, BOS/EOS and ``add_bos_token`` go to
``tokenizer_config.json``.

Every other tokenizer (SentencePiece ``llama`` as Gemma and Phi use, BPE with another
pre-tokenizer such as Llama 3's ``llama-bpe`` or Qwen's ``qwen2``) is converted by HF
transformers' own GGUF tokenizer loading, so the token ids are transformers' (it must be
installed: GGUFError otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values


class GGUFError(ValueError):
    """A GGUF file kvserve cannot serve; the message names the file and the reason."""


def _get(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


_GPT2_SPLITS = (None, "default", "gpt2", "smollm")  # GPT-2's own pre-tokenizer regex


def write_tokenizer(reader: Any, out: Path, path: Path) -> None:
    """Write the tokenizer files of GGUF file ``path`` (read by ``reader``) into ``out``.
    Raises GGUFError when its tokenizer cannot be converted."""
    kind = _get(reader, "tokenizer.ggml.model")
    if kind == "gpt2" and _get(reader, "tokenizer.ggml.pre") in _GPT2_SPLITS:
        _write_gpt2_bpe(reader, out)
    else:
        _write_with_transformers(path, out, kind)


def _write_with_transformers(path: Path, out: Path, kind: str) -> None:
    """The tokenizer as transformers loads it from the GGUF file, saved as HF files."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise GGUFError(
            f"tokenizer.ggml.model {kind!r}: converting this tokenizer needs HF transformers "
            "(pip install transformers), or serve the checkpoint's HF directory"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers' own message says what it lacks
        raise GGUFError(f"tokenizer.ggml.model {kind!r} does not convert ({e})") from None
    tok.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers adds BOS through tokenizer.json's post-processor; say so for kvserve's
    # loader, which reads the flag (and adds BOS itself when the post-processor does not)
    config.setdefault("add_bos_token", bool(getattr(tok, "add_bos_token", False)))
    config_path.write_text(json.dumps(config, indent=1))


def _write_gpt2_bpe(reader: Any, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = _get(reader, "tokenizer.ggml.tokens")
    types: list[int] = _get(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _get(reader, "tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    prefix = bool(_get(reader, "tokenizer.ggml.add_space_prefix", False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    tok.save(str(out / "tokenizer.json"))

    def name(key: str) -> str | None:
        i = _get(reader, key)
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    config = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_get(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _get(reader, "tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
