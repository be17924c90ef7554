"""KV usage recording by the engine and ``kvserve plan --usage`` analysis."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import greedy, make_engine, random_prompts, run_to_end

from kvserve.planner.usage import analyze, load_usage

BLOCK = 1000  # bytes per block in the synthetic traces
MONDAY_2026 = 1_767_571_200  # 2026-01-05 00:00 UTC, a Monday


def _write_trace(path, ts, used_blocks):
    with path.open("w") as f:
        for t, u in zip(ts, used_blocks, strict=True):
            f.write(
                json.dumps(
                    {
                        "ts": float(t),
                        "used_blocks": int(u),
                        "total_blocks": 200,
                        "bytes_per_block": BLOCK,
                        "usage": u / 200,
                    }
                )
                + "\n"
            )


def test_two_week_trace_known_percentiles(tmp_path):
    # 14 days, one sample a minute; demand cycles through 0..99 blocks uniformly, so the
    # nearest-rank P50/P95/P99 are 49/94/98 blocks exactly
    n = 14 * 24 * 60
    ts = MONDAY_2026 + 60 * np.arange(n)
    used = np.arange(n) % 100
    path = tmp_path / "usage.jsonl"
    _write_trace(path, ts, used)
    r = analyze(*load_usage(path), headroom=0.15)
    assert (r.p50, r.p95, r.p99, r.max) == (49 * BLOCK, 94 * BLOCK, 98 * BLOCK, 99 * BLOCK)
    assert r.recommended_bytes == pytest.approx(98 * BLOCK * 1.15)
    assert r.warnings == []
    assert len(r.hourly_mean) == 24 and len(r.weekday_mean) == 7


def test_weekly_shape_and_short_trace_and_gap_warnings(tmp_path):
    hours = np.arange(3 * 24)  # three days, hourly, busy on Wednesday only
    ts = MONDAY_2026 + 3600 * hours
    used = np.where(hours // 24 == 2, 100, 10)
    ts = np.delete(ts, range(30, 40))  # a 10-hour hole
    used = np.delete(used, range(30, 40))
    path = tmp_path / "short.jsonl"
    _write_trace(path, ts, used)
    r = analyze(*load_usage(path))
    assert r.weekday_mean[2] == 100 * BLOCK and r.weekday_mean[0] == 10 * BLOCK
    assert any("14 are needed" in w for w in r.warnings)
    assert any("gap" in w for w in r.warnings)


def test_engine_records_usage_samples(llama_dir, tmp_path):
    log = tmp_path / "kv.jsonl"
    engine = make_engine(llama_dir, kv_usage_log=str(log), kv_usage_interval=1e-9)
    for i, p in enumerate(random_prompts([40, 20])):
        engine.add_request(f"r{i}", p, greedy(5))
    run_to_end(engine)
    samples = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(samples) >= 5
    assert max(s["used_blocks"] for s in samples) >= 4  # 40 + 20 tokens need 4+ blocks
    assert all(s["total_blocks"] == engine.kv.num_blocks for s in samples)
    assert all(s["bytes_per_block"] == engine.kv_spec.bytes_per_block for s in samples)


def test_usage_samples_per_tenant(llama_dir, tmp_path):
    log = tmp_path / "kv.jsonl"
    engine = make_engine(
        llama_dir, kv_usage_log=str(log), kv_usage_interval=1e-9, enable_prefix_caching=False
    )
    engine.add_request("a", random_prompts([40])[0], greedy(5), tenant="alpha")
    engine.add_request("b", random_prompts([20], seed=1)[0], greedy(5), tenant="beta")
    run_to_end(engine)
    samples = [json.loads(line) for line in log.read_text().splitlines()]
    peak = max(samples, key=lambda s: s["used_blocks"])
    assert peak["tenants"] == {"alpha": 3, "beta": 2}  # 41+ and 21+ tokens
    assert sum(peak["tenants"].values()) == peak["used_blocks"]
    _, alpha = load_usage(log, "alpha")
    _, beta = load_usage(log, "beta")
    _, total = load_usage(log)
    assert alpha.max() == 3 * engine.kv_spec.bytes_per_block
    assert (alpha + beta == total).all()
    _, nobody = load_usage(log, "gamma")
    assert not nobody.any()


def test_cli_plan_usage(tmp_path):
    path = tmp_path / "u.jsonl"
    _write_trace(path, MONDAY_2026 + 60 * np.arange(500), np.arange(500) % 100)
    cmd = [sys.executable, "-m", "kvserve.cli", "plan", "--usage", str(path)]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["p99"] == 98 * BLOCK
    assert "14 are needed" in out.stderr
    png = tmp_path / "u.png"
    table = subprocess.run([*cmd, "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "recommended" in table.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    (tmp_path / "bad.jsonl").write_text('{"ts": 1}\n')
    bad = subprocess.run(
        [*cmd[:4], "--usage", str(tmp_path / "bad.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "bad.jsonl:1" in bad.stderr
