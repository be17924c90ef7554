"""A GGUF file's tokenizer metadata → ``tokenizer.json`` + ``tokenizer_config.json``.

Byte-level BPE with GPT-2's pre-tokenization (``tokenizer.ggml.model`` ``gpt2`` and
``tokenizer.ggml.pre`` absent, ``default``, ``gpt2`` or ``smollm``) or with GPT-4o's
(``gpt-4o``: the o200k split gpt-oss files use, which transformers' GGUF loading does not
read) is converted here: the vocabulary, merges and token types become a ``tokenizers``
BPE model with byte-level pre-tokenization (after the o200k split for ``gpt-4o``) and
decoding; control tokens become special added tokens, user-defined
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


# tokenizer.ggml.pre -> the regex that splits the text before byte-level BPE; None: GPT-2's
# own, inside the byte-level step ("gpt-4o": llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O,
# tiktoken's o200k_base pattern)
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_SPLITS: dict[str | None, str | None] = {
    **dict.fromkeys((None, "default", "gpt2", "smollm")),
    "gpt-4o": "|".join(
        (
            rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}",
            rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        )
    ),
}


def write_tokenizer(reader: Any, out: Path, path: Path) -> None:
    """Write the tokenizer files of GGUF file ``path`` (read by ``reader``) into ``out``.
    Raises GGUFError when its tokenizer cannot be converted."""
    kind = _get(reader, "tokenizer.ggml.model")
    pre = _get(reader, "tokenizer.ggml.pre")
    if kind == "gpt2" and pre in _SPLITS:
        _write_gpt2_bpe(reader, out, _SPLITS[pre])
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


def _write_gpt2_bpe(reader: Any, out: Path, split: str | None) -> None:
    """Byte-level BPE; ``split``: a regex whose matches are pre-tokenized apart first
    (None: GPT-2's own, inside the byte-level step)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = _get(reader, "tokenizer.ggml.tokens")
    types: list[int] = _get(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _get(reader, "tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    prefix = bool(_get(reader, "tokenizer.ggml.add_space_prefix", False))
    # after a split, ByteLevel would prefix every piece: a file's add_space_prefix applies
    # to GPT-2's split only (llama.cpp ignores it for BPE vocabularies altogether)
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=prefix and split is None, use_regex=split is None
    )
    tok.pre_tokenizer = (
        byte_level
        if split is None
        else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    )
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
