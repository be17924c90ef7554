"""The chaos run (issue 50): N rounds over three workers, two routers and Redis with
Sentinel, each round injecting one fault — worker SIGKILL, worker SIGSTOP, engine-core
SIGKILL, router SIGKILL, Redis-master SIGKILL (and, with ``--tp 2``, a tensor-parallel
rank's SIGKILL), in turn — at a random token of a live stream, with a client that
disconnects in every round and a 10x burst every fifth. The harness (what a round does
and records) is ``kvserve/testing/chaos.py``, shared with the short version in
``tests/ha/test_chaos.py``.

Reported: lost / altered streams, 5xx, stuck requests, leaked blocks (totals), and per
fault kind the recovery time (fault → cluster whole again: restarted processes ready and
routable on both routers, Redis replica in sync) and the first stream's longest silence
after the fault (what its client felt), p50 / p99.

    python benchmarks/features/chaos.py --rounds 100 --out benchmarks/results/chaos.json
    python benchmarks/features/chaos.py --rounds 24 --tp 2 --out benchmarks/results/chaos_tp2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvserve.default_model import DEFAULT_MODEL_DIR
from kvserve.testing.chaos import TP_KINDS, chaos_cluster, run  # the shared harness

COUNTS = ("lost", "altered", "errors_5xx", "stuck", "leaked")


def _pct(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (the largest for q=0.99 below 100 samples)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(results: list[dict]) -> dict:
    """Totals and, per fault kind, recovery and silence p50 / p99 (seconds)."""
    out: dict = {"rounds": len(results), **{k: sum(r[k] for r in results) for k in COUNTS}}
    out["faults_injected"] = sum(r["target"] != "none" for r in results)
    per_kind = {}
    for kind in TP_KINDS:
        rs = [r for r in results if r["kind"] == kind and r["target"] != "none"]
        if rs:
            rec, gap = [r["recovery_s"] for r in rs], [r["gap_s"] for r in rs]
            per_kind[kind] = {
                "n": len(rs),
                "recovery_p50_s": round(statistics.median(rec), 2),
                "recovery_p99_s": round(_pct(rec, 0.99), 2),
                "silence_p50_s": round(statistics.median(gap), 3),
                "silence_p99_s": round(_pct(gap, 0.99), 3),
            }
    out["per_kind"] = per_kind
    bursts = [r["burst"] for r in results if r["burst"]]
    out["burst_statuses"] = {
        code: sum(b.get(code, 0) for b in bursts) for code in sorted({c for b in bursts for c in b})
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=100, help="rounds (one fault each)")
    ap.add_argument("--streams", type=int, default=3, help="streams per round")
    ap.add_argument("--seed", type=int, default=0, help="seeds the fault tokens and prompts")
    ap.add_argument("--stop-seconds", type=float, default=3.0, help="how long SIGSTOP lasts")
    ap.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks per worker (2 adds rank kills)"
    )
    ap.add_argument("--out", type=Path, help="write the rounds and the summary as JSON")
    args = ap.parse_args()
    started = time.time()
    bar = tqdm(total=args.rounds, desc="chaos rounds", unit="fault")

    def progress(r) -> None:
        bad = sum(getattr(r, k) for k in COUNTS)
        bar.set_postfix_str(f"{r.kind} {r.recovery_s:.1f}s bad={bad}")
        bar.update()
        if bad or r.notes:
            tqdm.write(f"round {r.index} {r.kind}: {r}")

    with (
        tempfile.TemporaryDirectory(prefix="kvserve-chaos-") as tmp,
        chaos_cluster(DEFAULT_MODEL_DIR, Path(tmp), args.seed, args.stop_seconds, args.tp) as chaos,
    ):
        results = run(chaos, args.rounds, args.streams, progress)
    bar.close()
    report = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {platform.node()}",
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "summary": summary(results),
        "rounds": results,
    }
    print(json.dumps(report["summary"], indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
