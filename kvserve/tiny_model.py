"""Build a small random-weight Llama checkpoint (HF format) and a real BPE tokenizer.

Used by tests (the quickstart uses the bundled trained model). Needs no ``transformers``:
the tokenizer is trained with ``tokenizers`` on Python standard-library source files, the
weights are written with ``safetensors``. The special tokens and chat template are shared
with the default model's training script.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
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


def build_random_llama(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and a tokenizer; returns the directory."""
    out = Path(out_dir)
    vocab = max(vocab_size, build_tokenizer(out, vocab_size))
    head_dim = hidden_size // num_heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden_size, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden_size, dtype=dtype)
        tensors[p + "self_attn.q_proj.weight"] = rand(num_heads * head_dim, hidden_size)
        tensors[p + "self_attn.k_proj.weight"] = rand(num_kv_heads * head_dim, hidden_size)
        tensors[p + "self_attn.v_proj.weight"] = rand(num_kv_heads * head_dim, hidden_size)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden_size, num_heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(intermediate_size, hidden_size)
        tensors[p + "mlp.up_proj.weight"] = rand(intermediate_size, hidden_size)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden_size, intermediate_size)
    tensors["model.norm.weight"] = torch.ones(hidden_size, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": str(dtype).removeprefix("torch."),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
