"""Paired A/B in one process: this tree's paged attention kernel vs another checkout's.

Whole-run throughput on this 2-core machine moves ±10 % between runs, more than a change of a
few percent in one kernel. This benchmark pairs the two kernels call against call instead.
The baseline checkout's ``paged_attention.cpp`` (and the headers beside it) is copied, its op
registered as ``torch.ops.kvattn_ab.paged_attention`` and built with the same flags (with
``paged_attention_tiles.cpp`` where the checkout has one). The tree's op,
``torch.ops.kvserve.paged_attention``, is the other side. ``--layout tiles`` gives each side
that reads them the engine's tiled bf16 caches (``model/kv_cache.py``; a checkout without them
gets rows of the same values), and then the outputs must agree to bf16's precision instead
of bit for bit.

The workload is the decode step of ``offline.py``: 32 sequences at context 320, 30 layers'
bf16 caches of SmolLM2-135M's shape (9 query heads on 3 KV heads of 64), 16-token blocks.
Each sequence's first 16 blocks are contiguous and the rest interleaved across sequences, as
the engine allocates them. Every iteration times all 30 layers from DRAM on both sides, in
alternating order. Every third iteration also times an 8 x 256-token prefill chunk. The
medians of the per-iteration ratios (this tree / baseline; below 1 is faster) are printed.
Both kernels must give equal outputs.

    git worktree add /tmp/old HEAD~1
    python benchmarks/kernels/attention_ab.py --baseline /tmp/old
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kernel_build import CFLAGS, LDFLAGS
from kvserve.model.kv_cache import tiles_from_rows

L, B, HKV, HQ, D, BS = 30, 32, 3, 9, 64, 16


def decode_tables(seqs: int, blocks: int) -> tuple[torch.Tensor, int]:
    """The decode workload's block tables ``[seqs, blocks]``: each sequence's first 16
    blocks contiguous (as a prefill writes them), the rest interleaved across sequences
    (as decode steps take them); and the next free block."""
    tables = torch.zeros(seqs, blocks, dtype=torch.long)
    nxt = 0
    for s in range(seqs):
        for j in range(min(16, blocks)):
            tables[s, j], nxt = nxt, nxt + 1
    for j in range(16, blocks):
        for s in range(seqs):
            tables[s, j], nxt = nxt, nxt + 1
    return tables, nxt


def build_baseline(checkout: Path) -> bool:
    """Builds the checkout's attention kernel as ``torch.ops.kvattn_ab.paged_attention``;
    True when it reads tiled caches."""
    src = checkout / "kvserve" / "model" / "csrc"
    names = [n for n in ("paged_attention.cpp", "paged_attention_tiles.cpp") if (src / n).exists()]
    out = Path(tempfile.mkdtemp(prefix="kvattn_ab_"))
    digest = hashlib.sha256()
    for path in [*src.glob("*.h"), *(src / n for n in names)]:
        text = path.read_text()
        text = text.replace("FRAGMENT(kvserve, m)", "FRAGMENT(kvattn_ab, m)")
        # its C++ entry points would clash with the tree's
        text = re.sub(
            r"\nnamespace kvserve \{(?=  // entry point)", "\nnamespace kvattn_ab {", text
        )
        text = text.replace("kvserve_tiles", "kvattn_ab_tiles")
        (out / path.name).write_text(text)
        digest.update(text.encode())
    load(
        name=f"kvattn_ab_{digest.hexdigest()[:12]}",
        sources=[str(out / n) for n in names],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        is_python_module=False,
    )
    return "paged_attention_tiles.cpp" in names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a kvserve checkout")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument(
        "--layout",
        choices=["rows", "tiles"],
        default="tiles",
        help="the caches each side reads where it can (tiles: the engine's bf16 layout)",
    )
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args()
    assert load_cpu_kernels(), "the tree's CPU kernels did not build"
    baseline_tiles = build_baseline(a.baseline)
    torch.manual_seed(0)
    nbs = (a.context + BS - 1) // BS
    rows = torch.randn(L, 2, 2048, BS, HKV, D).bfloat16()
    tiles = None
    if a.layout == "tiles":  # the same values, in the tiled order
        tiles = torch.stack(
            [
                tiles_from_rows(c.view(2, -1, HKV, D)).view(2, 2048, BS // 16, HKV, 16, D)
                for c in rows
            ]
        )
    side_caches = {
        "tree": tiles if tiles is not None else rows,
        "baseline": tiles if tiles is not None and baseline_tiles else rows,
    }
    tables, nxt = decode_tables(B, nbs)
    lens = torch.full((B,), a.context, dtype=torch.long)
    starts = torch.arange(B + 1, dtype=torch.long)
    q = torch.randn(B, HQ, D).bfloat16()
    P, T = 8, 256  # prefill: 8 prompts of 256 tokens in one chunk
    p_tables = torch.arange(P * 16).view(P, 16).long() + nxt
    p_lens = torch.full((P,), T, dtype=torch.long)
    p_starts = torch.arange(P + 1, dtype=torch.long) * T
    p_q = torch.randn(P * T, HQ, D).bfloat16()
    ops = {
        "tree": torch.ops.kvserve.paged_attention,
        "baseline": torch.ops.kvattn_ab.paged_attention,
    }

    def decode(side: str) -> float:
        op, caches = ops[side], side_caches[side]
        t = time.perf_counter()
        for layer in range(L):
            k, v = caches[layer, 0], caches[layer, 1]
            op(q, k, v, tables, lens, starts, D**-0.5, 0, 0, None, None)
        return time.perf_counter() - t

    def prefill(side: str) -> float:
        op, caches = ops[side], side_caches[side]
        t = time.perf_counter()
        for layer in range(3):
            op(p_q, caches[layer, 0], caches[layer, 1], p_tables, p_lens, p_starts, D**-0.5, 0, 0,
               None, None)  # fmt: skip
        return (time.perf_counter() - t) * L / 3

    outs = [
        ops[k](q, c[0, 0], c[0, 1], tables, lens, starts, D**-0.5, 0, 0, None, None)
        for k, c in side_caches.items()
    ]
    if side_caches["tree"] is side_caches["baseline"]:
        assert torch.equal(outs[0], outs[1]), "the two kernels disagree"
    else:  # another layout folds keys in another order: equal to bf16's precision
        assert (outs[0].float() - outs[1].float()).abs().max().item() < 3e-2, "kernels disagree"
    times: dict[str, list[float]] = {"tree": [], "baseline": []}
    ratios, p_ratios = [], []
    for i in range(a.iters):
        order = ["tree", "baseline"] if i % 2 else ["baseline", "tree"]
        got = {k: decode(k) for k in order}
        for k in got:
            times[k].append(got[k])
        ratios.append(got["tree"] / got["baseline"])
        if i % 3 == 0:
            p_ratios.append(prefill("tree") / prefill("baseline"))
    q1, _, q3 = statistics.quantiles(ratios)
    result = {
        "decode_ms_per_step": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "decode_ratio_median": statistics.median(ratios),
        "decode_ratio_quartiles": [q1, q3],
        "prefill_ratio_median": statistics.median(p_ratios),
        "workload": vars(a) | {"baseline": str(a.baseline), "baseline_reads_tiles": baseline_tiles},
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
