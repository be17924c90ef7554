"""Deployment artefacts: Prometheus alert rules and the Grafana dashboard.

* ``promtool check rules`` accepts ``deploy/prometheus/alerts.yml``;
* ``promtool test rules`` passes ``deploy/prometheus/alerts_test.yml`` (fire and no-fire
  cases per alert);
* every rule has a severity, summary/description and a runbook link whose anchor exists
  in ``docs/operations.md``;
* every ``kvserve_*`` metric referenced by the alert rules and by the Grafana dashboard's
  panel queries is one the server (or the HA router) exports, every one of them is charted,
  and the dashboard's queries parse as PromQL.

promtool ships in the Debian/Ubuntu ``prometheus`` package; the tests fail (not skip)
without it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvserve.json"
OPERATIONS = ROOT / "docs" / "operations.md"

# Metric names exported at /metrics (counters with their ``_total`` suffix): the workers'
# and, for the HA cluster, the router's (``kvserve router``, its own /metrics).
HISTOGRAMS = {
    "kvserve_time_to_first_token_seconds",
    "kvserve_e2e_request_latency_seconds",
    "kvserve_router_failover_seconds",
}
KNOWN_METRICS = HISTOGRAMS | {
    "kvserve_kv_cache_usage_perc",
    "kvserve_kv_cache_blocks",
    "kvserve_kv_cache_used_bytes",
    "kvserve_kv_cache_capacity_bytes",
    "kvserve_kv_cache_usage_peak_perc",
    "kvserve_kv_cache_internal_fragmentation_ratio",
    "kvserve_kv_cache_free_fragmentation_ratio",
    "kvserve_num_preemptions_total",
    "kvserve_swap_space_used_bytes",
    "kvserve_swap_space_capacity_bytes",
    "kvserve_tenant_kv_blocks",
    "kvserve_tenant_kv_limit_blocks",
    "kvserve_tenant_kv_reservation_blocks",
    "kvserve_tenant_kv_cache_usage_perc",
    "kvserve_tenant_kv_limit_usage_perc",
    "kvserve_tenant_num_requests_waiting",
    "kvserve_tenant_num_requests_running",
    "kvserve_num_requests_waiting",
    "kvserve_num_requests_running",
    "kvserve_prefix_cache_queries_total",
    "kvserve_prefix_cache_hits_total",
    "kvserve_prefix_cache_hit_rate",
    "kvserve_generation_tokens_total",
    # HA workers (`kvserve serve --cluster …`).
    "kvserve_replication_sessions",
    "kvserve_replication_lag_tokens",
    "kvserve_replication_lag_seconds",
    "kvserve_replication_records_total",
    "kvserve_replication_errors_total",
    "kvserve_replication_fenced_total",
    "kvserve_replication_prewarmed_blocks_total",
    "kvserve_replication_pushed_blocks_total",
    # HA router (`kvserve router`).
    "kvserve_router_workers",
    "kvserve_router_failovers_total",
    "kvserve_router_failover_failures_total",
    "kvserve_router_worker_failures_total",
    "kvserve_router_requests_total",
}
# The router's series carry no model_name label (only job/instance, plus state/how/
# endpoint): dashboard queries on them filter by the `router` variable's instances instead.
ROUTER_METRIC_RE = re.compile(r"kvserve_router_[a-z0-9_]+")
EXPECTED_ALERTS = {
    "KVCacheUsageHigh",
    "KVCacheUsageCritical",
    "KVCachePreemptionRateHigh",
    "KVSwapSpaceNearlyFull",
    "TenantAtKVLimit",
    "KVReplicationLagHigh",
    "KVSessionFenced",
    "KVRouterNoRoutableWorkers",
    "KVFailoverFailures",
}
# `kvserve_[a-z_]+` plus digits: `kvserve_e2e_request_latency_seconds` has a "2".
METRIC_RE = re.compile(r"kvserve_[a-z0-9_]+")
HISTOGRAM_SUFFIX_RE = re.compile(r"_(bucket|sum|count)$")
# Grafana variables substituted so dashboard queries can be parsed by promtool.
GRAFANA_VARS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$model_name": ".*",
    "$instance": ".*",
    "$tenant": ".*",
    "$router": ".*",
}


def _promtool() -> str:
    """promtool's path; a missing promtool fails the calling test (reported FAILED)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found on PATH; install it with `apt-get install prometheus` "
            "(Debian/Ubuntu package that ships /usr/bin/promtool)"
        )
    return path


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )


def _base_name(name: str) -> str:
    """Histogram series (``_bucket``/``_sum``/``_count``) map to the histogram's name."""
    base = HISTOGRAM_SUFFIX_RE.sub("", name)
    return base if base in HISTOGRAMS else name


def _unknown_metrics(expr: str) -> set[str]:
    return {m for m in METRIC_RE.findall(expr) if _base_name(m) not in KNOWN_METRICS}


def _rules() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _panels(panels: list[dict]) -> list[dict]:
    """All panels, including those nested in collapsed rows."""
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def _dashboard_exprs() -> dict[str, str]:
    """``"panel title [refId]" -> expr`` for every panel query."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {}
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                exprs[f"{panel['title']} [{target['refId']}]"] = target["expr"]
    return exprs


def test_promtool_check_rules():
    promtool = _promtool()
    _run([promtool, "check", "rules", str(ALERTS)])


def test_promtool_unit_tests():
    promtool = _promtool()
    _run([promtool, "test", "rules", str(ALERTS_TEST)])


def test_alert_rules_are_complete():
    rules = _rules()
    assert {r["alert"] for r in rules} == EXPECTED_ALERTS
    text = OPERATIONS.read_text()
    anchors = {
        re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    }
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule.get("for"), f"{name} has no `for` duration"
        ann = rule["annotations"]
        assert ann.get("summary") and ann.get("description"), name
        page, _, anchor = ann["runbook"].partition("#")
        assert page == "docs/operations.md", f"{name}: runbook {ann['runbook']!r}"
        assert anchor in anchors, f"{name}: no heading for #{anchor} in docs/operations.md"


def test_alert_rules_reference_known_metrics():
    for rule in _rules():
        assert METRIC_RE.search(rule["expr"]), rule["alert"]
        unknown = _unknown_metrics(rule["expr"])
        assert not unknown, f"{rule['alert']} references unknown metrics {sorted(unknown)}"


def test_dashboard_references_known_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _dashboard_exprs()
    assert exprs, "dashboard has no panel queries"
    for where, expr in exprs.items():
        unknown = _unknown_metrics(expr)
        assert not unknown, f"{where} references unknown metrics {sorted(unknown)}: {expr}"
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        unknown = _unknown_metrics(query)
        assert not unknown, f"variable {var['name']} references unknown metrics {unknown}"
    # Every exported metric is charted somewhere.
    used = {_base_name(m) for expr in exprs.values() for m in METRIC_RE.findall(expr)}
    missing = KNOWN_METRICS - used
    assert not missing, f"metrics missing from the dashboard: {sorted(missing)}"


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert {"model_name", "instance", "router"} <= variables.keys()
    panels = _panels(dashboard["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            if set(METRIC_RE.findall(expr)) <= set(ROUTER_METRIC_RE.findall(expr)):
                # Router series only: no model_name label to filter on.
                assert "model_name" not in expr, panel["title"]
                assert 'instance=~"$router"' in expr, panel["title"]
            else:
                assert 'model_name=~"$model_name"' in expr, panel["title"]
                assert 'instance=~"$instance"' in expr, panel["title"]


def test_dashboard_queries_parse(tmp_path):
    """Each panel query, with Grafana variables substituted, is valid PromQL."""
    promtool = _promtool()
    rules = []
    for i, (where, expr) in enumerate(_dashboard_exprs().items()):
        for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{where}: unsubstituted Grafana variable in {expr}"
        rules.append({"record": f"grafana:panel_query:{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _run([promtool, "check", "rules", str(path)])
