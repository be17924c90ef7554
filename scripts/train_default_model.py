"""Train kvserve's bundled default model on the Python standard library's source files.

Reproducible: every random choice is seeded (``--seed``), the file lists are fixed in
``kvserve.default_model`` (train = stdlib ``.py`` files, tests included, minus data
tables, files over 300 kB and the held-out modules), and the run's hyper-parameters,
timings and losses are written beside the checkpoint in ``training.json``.

    python scripts/train_default_model.py --out kvserve/models/default

Defaults (about 35 minutes on 2 Sapphire Rapids cores, bfloat16 autocast):
  tokenizer  byte-level BPE, 8192 tokens, special tokens <s> </s> <|system|> <|user|>
             <|assistant|> <|end|>, a simple chat template
  model      Llama architecture: 6 layers, hidden 256, MLP 768, 4 query heads of 64,
             2 KV heads (GQA), tied embeddings, RoPE theta 10000 — 6.8 M parameters
  training   900 steps × 16 sequences × 512 tokens (7.4 M tokens, about one epoch), AdamW
             (lr 2e-3, betas 0.9/0.95, weight decay 0.1), 50 warm-up steps, cosine to 10%,
             gradient clipping 1.0
  saved as   bfloat16 safetensors (about 14 MB) with config.json and tokenizer files

Needs ``transformers`` (the reference implementation, in the ``test`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from kvserve.default_model import HELDOUT_FILES, corpus_files
from kvserve.tiny_model import train_bpe_tokenizer


def train_tokenizer(files: list[Path], vocab_size: int, out: Path) -> Tokenizer:
    """Byte-level BPE over ``files``; writes tokenizer.json and tokenizer_config.json."""
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    return train_bpe_tokenizer(texts, out, vocab_size)


def encode_files(tok: Tokenizer, files: list[Path]) -> torch.Tensor:
    """One long int64 stream: <s> file </s> <s> file </s> …"""
    eos = tok.token_to_id("</s>")
    ids: list[int] = []
    for f in files:
        ids += [*tok.encode(f.read_text(encoding="utf-8", errors="replace")).ids, eos]
    return torch.tensor(ids, dtype=torch.int64)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over ``windows`` [N, T+1]."""
    model.eval()
    total, count = 0.0, 0
    for w in windows.split(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="kvserve/models/default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_files, held_files = corpus_files("train"), corpus_files("heldout")
    tok = train_tokenizer(train_files, args.vocab_size, out)
    train_ids, held_ids = encode_files(tok, train_files), encode_files(tok, held_files)
    t_tok = time.time() - t0
    print(
        f"tokenizer + encoding: {t_tok:.0f}s; train {len(train_ids):,} tokens "
        f"from {len(train_files)} files, held-out {len(held_ids):,} tokens"
    )

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    span = args.seq_len + 1
    n_eval = min(16, max(1, len(held_ids) // span))
    held_windows = torch.stack([held_ids[i * span : (i + 1) * span] for i in range(n_eval)])

    history = []
    t1 = time.time()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(train_ids) - span, (args.batch,), generator=gen)
        batch = torch.stack([train_ids[s : s + span] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            held = evaluate(model, held_windows)
            history.append(
                {
                    "step": step + 1,
                    "train_loss": round(loss.item(), 4),
                    "heldout_loss": round(held, 4),
                    "elapsed_s": round(time.time() - t1),
                }
            )
            tqdm.write(
                f"step {step + 1}: train {loss.item():.3f}  held-out {held:.3f} "
                f"(ppl {math.exp(held):.2f})"
            )
    t_train = time.time() - t1

    model.config.dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    summary = {
        "script": "scripts/train_default_model.py",
        "args": vars(args),
        "parameters": n_params,
        "train_files": len(train_files),
        "train_tokens": len(train_ids),
        "heldout_files": list(HELDOUT_FILES),
        "heldout_tokens": len(held_ids),
        "tokens_seen": args.steps * args.batch * args.seq_len,
        "tokenizer_seconds": round(t_tok),
        "train_seconds": round(t_train),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {out} ({n_params / 1e6:.2f} M parameters, {t_train / 60:.1f} min training)")


if __name__ == "__main__":
    main()
