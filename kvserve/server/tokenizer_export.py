"""A worker's tokenizer, shipped to a router: ``GET /internal/tokenizer`` (cluster secret).

Prefix-aware placement needs the router to turn a request into exactly the token ids the
worker will compute. Rather than a second copy of the model on the router (``--tokenizer``,
still an override), a worker hands over what its own tokenizer was built from:

1. ``export_tokenizer`` (worker) reads ``model.tokenizer.TOKENIZER_FILES`` — the files
   ``load_tokenizer`` reads — from the directory the worker loaded its
   tokenizer from. For a GGUF model that is the converted directory (``model.gguf``), so a
   GGUF-derived tokenizer travels like any HF one. The answer (msgpack
   ``TokenizerExport``) carries the raw bytes and the fingerprint the worker registers as
   ``tokenizer_fp``.
2. ``rebuild_tokenizer`` (router) writes those bytes into a private temporary directory
   and loads them with ``load_tokenizer`` itself — the worker's own code path — then
   checks that the rebuilt tokenizer's fingerprint is the expected one. Anything else
   (files changed on disk since the worker loaded them, an unreadable answer, another
   fingerprint) raises ValueError: a tokenizer that would place requests wrongly is never
   used.

Both functions do file I/O and parse megabytes: call them off an event loop.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgspec

from kvserve.model.tokenizer import TOKENIZER_FILES, TOKENIZER_JSON, Tokenizer, load_tokenizer

TOKENIZER_PATH = "/internal/tokenizer"
TOKENIZER_MEDIA_TYPE = "application/vnd.kvserve.tokenizer+msgpack"


class TokenizerExport(msgspec.Struct, frozen=True):
    """A tokenizer as its files: ``fingerprint`` (``Tokenizer.fingerprint``), ``source``
    (the worker's directory, for messages) and ``files`` (name → bytes, names from
    ``TOKENIZER_FILES`` only; an absent file is left out)."""

    fingerprint: str
    source: str
    files: dict[str, bytes]


def export_tokenizer(tok: Tokenizer) -> bytes:
    """The msgpack ``TokenizerExport`` of ``tok``, read from ``tok.source``. Raises
    ValueError when ``tokenizer.json`` is not there any more."""
    found = [tok.source / n for n in TOKENIZER_FILES if (tok.source / n).is_file()]
    files = {p.name: p.read_bytes() for p in found}
    if TOKENIZER_JSON not in files:
        raise ValueError(f"{tok.source}: tokenizer.json is gone")
    return msgspec.msgpack.encode(TokenizerExport(tok.fingerprint, str(tok.source), files))


def rebuild_tokenizer(data: bytes, fingerprint: str) -> Tokenizer:
    """The tokenizer an export describes, built by ``load_tokenizer``; its ``source`` is
    the worker's directory. Raises ValueError unless the export is readable, names only
    known files and rebuilds to ``fingerprint``."""
    try:
        exp = msgspec.msgpack.decode(data, type=TokenizerExport)
    except msgspec.DecodeError as e:
        raise ValueError(f"unreadable tokenizer export: {e}") from None
    unknown = set(exp.files) - set(TOKENIZER_FILES)
    if unknown:
        raise ValueError(f"tokenizer export names unknown files {sorted(unknown)}")
    if exp.fingerprint != fingerprint:
        raise ValueError(f"the export is of tokenizer {exp.fingerprint}, not {fingerprint}")
    with tempfile.TemporaryDirectory(prefix="kvserve-tokenizer-") as tmp:
        for name, content in exp.files.items():
            (Path(tmp) / name).write_bytes(content)
        tok = load_tokenizer(tmp)
    if tok is None:
        raise ValueError("tokenizer export without tokenizer.json")
    if tok.fingerprint != fingerprint:
        raise ValueError(
            f"{exp.source}: the files rebuild tokenizer {tok.fingerprint}, not {fingerprint} "
            "(changed on disk since the worker loaded them?)"
        )
    tok.source = Path(exp.source)
    return tok
