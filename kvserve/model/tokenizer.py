"""Tokenizer from an HF directory (``tokenizer.json`` + ``tokenizer_config.json``).

Uses the ``tokenizers`` library directly and renders the chat template with Jinja2 in a
sandbox, as HF does. Returns None from ``load_tokenizer`` when the directory has no
``tokenizer.json`` (then only token-id prompts can be served).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


_LONG_TEXT = 4096  # characters; longer texts are tokenized without holding the GIL


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_LEVEL = _byte_level_alphabet()


def _uses(component: Any, kind: str) -> bool:
    """Is ``kind`` (e.g. ``ByteLevel``) the type of a tokenizer.json component, or of one
    of a ``Sequence``'s parts?"""
    if not isinstance(component, dict):
        return False
    if component.get("type") == kind:
        return True
    parts = component.get("decoders") or component.get("pretokenizers") or []
    return any(_uses(p, kind) for p in parts)


class PromptTooLong(ValueError):
    """A text with more tokens than allowed; ``num_tokens`` says how many."""

    def __init__(self, num_tokens: int):
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


class Tokenizer:
    """Encode/decode and chat-template rendering for one model."""

    def __init__(self, tok: HFTokenizer, config: dict[str, Any], source: Path):
        self._tok = tok
        self.source = source
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = None if self.eos_token is None else tok.token_to_id(self.eos_token)
        self._add_bos = bool(config.get("add_bos_token", False))
        self.bos_token_id = None if self.bos_token is None else tok.token_to_id(self.bos_token)
        self._added = set(tok.get_added_tokens_decoder())
        try:
            self._byte_level = _uses(json.loads(tok.to_str()).get("decoder"), "ByteLevel")
        except ValueError:
            self._byte_level = False

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short id of what decides prompt token ids (vocabulary, merges, normalizer,
        BOS rule, chat template): two tokenizers with the same fingerprint turn the same
        request into the same ids (a router checks its own against each worker's)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(self._tok.to_str().encode())
        h.update(f"|bos={self._add_bos}:{self.bos_token_id}|".encode())
        h.update((self.chat_template or "").encode())
        return h.hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """Token ids of ``text``. Raises ``PromptTooLong`` (before building the id list)
        when it has more than ``max_tokens`` tokens. Long texts go through the batch
        call, which releases the GIL while it works (the single call does not: a 6 MB
        prompt would stall every other thread of the process for seconds)."""
        if len(text) > _LONG_TEXT:
            enc = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        if max_tokens is not None and len(enc) > max_tokens:
            raise PromptTooLong(len(enc))
        ids = enc.ids
        if (
            add_special_tokens
            and self._add_bos
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when they are not a whole UTF-8 character
        (OpenAI's logprob ``bytes``): byte-level BPE pieces map back through their
        alphabet, byte-fallback pieces (``<0xE2>``) are that byte; otherwise the token's
        decoded text."""
        if token_id in self._added:  # added/special tokens are stored as plain text
            return self.decode([token_id], skip_special_tokens=False).encode()
        piece = self._tok.id_to_token(token_id)
        if piece is not None and self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token_id], skip_special_tokens=False).encode()

    def vocab_bytes(self) -> list[bytes]:
        """Every token's bytes by id (a grammar engine's vocabulary); special tokens (EOS,
        template markers) are ``b""``, so no grammar spells text with one."""
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return [b"" if i in special else self.token_bytes(i) for i in range(self.vocab_size)]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages to a prompt string. Raises ValueError without a template."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                f"{self.source}: tokenizer_config.json has no 'chat_template'; "
                "pass chat_template= or use generate() with a plain prompt"
            )

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as e:  # e.g. None + "text"
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from None


# the files load_tokenizer reads: all a tokenizer is built from (a router rebuilds a worker's
# from exactly these: server.tokenizer_export)
TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
)  # fmt: skip
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """Load the tokenizer of ``model_dir``; None when it has no ``tokenizer.json``."""
    model_dir = Path(model_dir)
    path = model_dir / TOKENIZER_JSON
    if not path.is_file():
        return None
    cfg_path = model_dir / TOKENIZER_CONFIG
    config: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: invalid JSON ({e})") from None
    template_file = model_dir / CHAT_TEMPLATE
    if "chat_template" not in config and template_file.is_file():
        config["chat_template"] = template_file.read_text()
    return Tokenizer(HFTokenizer.from_file(str(path)), config, model_dir)
