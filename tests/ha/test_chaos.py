"""The chaos run, short (``benchmarks/features/chaos.py`` runs it long): one round of each fault —
a worker SIGKILLed, a worker SIGSTOPped, an engine core SIGKILLed, a router SIGKILLed, the
Redis master SIGKILLed — at a random token of a live stream, with client disconnects and
a burst. Nothing is lost or altered, no 5xx, nothing stuck or leaked, and the cluster is
whole again within a bound after each fault."""

from __future__ import annotations

from kvserve.testing.chaos import KINDS, chaos_cluster, run


def test_one_round_of_each_fault_loses_and_alters_nothing(llama_dir, tmp_path):
    with chaos_cluster(llama_dir, tmp_path, seed=1) as chaos:
        results = run(chaos, rounds=len(KINDS), streams=2)
    assert [r["kind"] for r in results] == list(KINDS)
    for r in results:
        assert r["target"] != "none", r
        counts = {k: r[k] for k in ("lost", "altered", "errors_5xx", "stuck", "leaked")}
        assert counts == dict.fromkeys(counts, 0), r
        assert r["recovery_s"] < 60, r
    assert any(r["burst"] for r in results)
