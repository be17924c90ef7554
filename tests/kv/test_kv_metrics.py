"""KV metrics: peak watermarks over sliding windows, fragmentation, per-tenant usage and
preemption counts in the engine's snapshot (the server renders them; see test_tenants)."""

from __future__ import annotations

import pytest
from helpers import greedy, make_engine, random_prompts

from kvserve.engine.kv_metrics import largest_free_run
from kvserve.engine.peak import PeakTracker
from kvserve.engine.stats import TenantStats
from kvserve.kv.tenant_ledger import Budget


def test_peak_tracker_windows():
    p = PeakTracker()
    p.record(0.9, now=1000.0)
    p.record(0.5, now=1200.0)
    p.record(0.2, now=1290.0)
    p.record(0.3, now=1290.5)
    assert p.peak(60, now=1290.5) == 0.3
    assert p.peak(300, now=1290.5) == 0.9
    assert p.peak(3600, now=1290.5) == 0.9
    p.record(0.1, now=4700.0)  # 1000 s fell out of the hour
    assert p.peak(3600, now=4700.0) == 0.5


def test_largest_free_run():
    assert largest_free_run([]) == 0
    assert largest_free_run([7, 3, 4, 5, 9, 10]) == 3


def test_snapshot_reports_fragmentation_tenants_and_preemptions(llama_dir):
    engine = make_engine(
        llama_dir, kv_cache_memory=16 * 16 * 512, max_model_len=128, preemption_mode="swap"
    )
    engine.set_tenant_budgets({"a": Budget(4, 12), "b": Budget(0)})
    prompts = random_prompts([30, 25, 20, 18], seed=11)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(40), tenant="ab"[i % 2])
    engine.step()  # all four prefilled: 2+2+2+2 blocks, 16 tokens of 128 slots unused
    snap = engine.metrics_snapshot()
    used = engine.kv.pool.num_used
    assert used == 8
    assert snap.internal_fragmentation == pytest.approx((128 - (30 + 25 + 20 + 18)) / 128)
    assert snap.free_fragmentation >= 1.0
    assert snap.peak_usage["1m"] == pytest.approx(8 / 16)
    assert snap.tenants["a"] == TenantStats(blocks=4, limit=12, reservation=4, waiting=0, running=2)
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    snap = engine.metrics_snapshot()
    assert snap.preemptions and all(p.mode == "swap" for p in snap.preemptions)
    assert snap.peak_usage["5m"] == 1.0
    assert snap.swap_used_bytes == 0 and snap.swap_capacity_bytes == 4 * 1024**3
    # fitted from step times: on a busy machine the per-token share can fit to 0 (seen
    # once in a full run beside other load), the step's whole cost cannot
    rates = snap.cost_rates
    assert rates["prefill_s_per_token"] >= 0
    assert rates["step_overhead_s"] + rates["prefill_s_per_token"] > 0
