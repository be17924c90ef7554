"""A GGUF file's tokenizer metadata → ``tokenizer.json`` + ``tokenizer_config.json``.

Byte-level BPE (``tokenizer.ggml.model`` ``gpt2``) only: the vocabulary, merges and token
types become a ``tokenizers`` BPE model with byte-level pre-tokenization and decoding;
control tokens become special added tokens, user-defined ones plain added tokens. The
chat template, BOS/EOS and ``add_bos_token`` go to ``tokenizer_config.json``.
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


def write_tokenizer(reader: Any, out: Path) -> None:
    """Write the tokenizer files into ``out``. Raises GGUFError when the file's tokenizer
    is not byte-level BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _get(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"tokenizer.ggml.model {kind!r} is not supported (byte-level BPE "
            "'gpt2' only); convert the checkpoint to an HF directory instead"
        )
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
