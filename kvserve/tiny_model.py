"""A real BPE tokenizer for small test models and the bundled model's training script.

Needs no ``transformers``: the tokenizer is trained with ``tokenizers`` on Python
standard-library source files. The special tokens and chat template are shared with the
default model's training script (tests build their random-weight models with
transformers' own classes, ``tests/conftest.py``).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS_FILES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string/__init__.py")


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in _CORPUS_FILES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts or ["def hello(name):\n    return 'hello ' + name\n" * 50]


def train_bpe_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (kvserve's special tokens, BOS prepended, the chat
    template) on ``texts``; writes tokenizer.json and tokenizer_config.json to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Train a small tokenizer on a few stdlib files into ``out_dir``; returns its size."""
    return train_bpe_tokenizer(_corpus(), out_dir, vocab_size).get_vocab_size()
