"""The bundled default model: where it lives and which text it was trained and evaluated on.

The checkpoint under ``kvserve/models/default`` is produced by ``scripts/train_default_model.py``
from the Python standard library's own source files, which exist on every machine with Python.
``HELDOUT_FILES`` were never seen in training (nor by the tokenizer) and are what
``kvserve eval perplexity`` reads by default.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "models" / "default"

# Held out from tokenizer and model training; stable module names across Python 3.11+.
HELDOUT_FILES = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "difflib.py",
    "fractions.py",
    "heapq.py",
    "json/decoder.py",
    "json/encoder.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
)
# Directories of generated data or tables rather than ordinary source code.
_EXCLUDED_PARTS = frozenset({"site-packages", "pydoc_data", "encodings", "__pycache__"})
_MAX_FILE_BYTES = 300_000  # a few generated tables and test-data files


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(split: str) -> list[Path]:
    """Standard-library ``.py`` files of ``split`` ("train" or "heldout"), sorted by path.

    Raises ValueError for another split name.
    """
    root = stdlib_dir()
    if split == "heldout":
        return [root / name for name in HELDOUT_FILES if (root / name).is_file()]
    if split != "train":
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    held = {root / name for name in HELDOUT_FILES}
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if path in held or _EXCLUDED_PARTS.intersection(rel.parts[:-1]):
            continue
        if path.stat().st_size > _MAX_FILE_BYTES:
            continue
        files.append(path)
    return files


def default_model_path() -> Path:
    """The shipped checkpoint directory; raises FileNotFoundError if the package lacks it."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled default model is missing from {DEFAULT_MODEL_DIR}; "
            "run scripts/train_default_model.py or pass --model DIR"
        )
    return DEFAULT_MODEL_DIR
