"""deploy/kubernetes: every manifest validates against the Kubernetes schema offline
(``kubernetes-validate``, strict: no unknown fields), and what the manifests say matches
what kvserve accepts — container args parse with the CLI's own parser, probes hit routes
the apps serve on the ports the args bind, the cluster secret comes from a Secret, and
the PrometheusRule is ``deploy/prometheus/alerts.yml`` as generated."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.cli import build_parser

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator: no offline schema


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


DOCS = _docs()


def _containers(kind: str) -> list[dict]:
    found = []
    for _, doc in DOCS:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c.get("args", [None])[0] == kind:
                    found.append(c)
    return found


def test_the_set_is_complete():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in DOCS}
    for want in [
        ("StatefulSet", "kvserve-redis"),
        ("StatefulSet", "kvserve-worker"),
        ("Deployment", "kvserve-router"),
        ("Service", "kvserve"),
        ("Service", "kvserve-sentinel"),
        ("PodDisruptionBudget", "kvserve-worker"),
        ("ServiceMonitor", "kvserve-worker"),
        ("PrometheusRule", "kvserve"),
    ]:
        assert want in kinds, want


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['metadata']['name']}" for n, d in DOCS])
def test_manifest_validates_against_the_kubernetes_schema(name, doc):
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _parse(args: list[str]) -> argparse.Namespace:
    # the kubelet expands $(VAR) from the container's env; any value parses the same
    return build_parser().parse_args([a.replace("$(POD_NAME)", "kvserve-worker-0") for a in args])


@pytest.mark.parametrize("kind", ["serve", "router"])
def test_container_args_parse_and_probes_match_the_app(kind):
    containers = _containers(kind)
    assert containers
    for c in containers:
        ns = _parse(c["args"])
        assert ns.host == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == ns.port
        assert ns.cluster.startswith("redis+sentinel://kvserve-sentinel:26379/")
        for probe in ("readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["port"] == "http"
            assert get["path"] == ("/ready" if probe == "readinessProbe" else "/health")
        env = {e["name"]: e for e in c["env"]}
        ref = env["KVSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "kvserve-cluster", "key": "secret"}  # never a literal


def test_workers_advertise_their_stable_address_and_drain_before_stopping():
    (c,) = _containers("serve")
    ns = _parse(c["args"])
    assert ns.node_id == "kvserve-worker-0"
    assert ns.advertise_url == f"http://kvserve-worker-0.kvserve-worker:{ns.port}"
    hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "/internal/drain" in hook and "X-Kvserve-Cluster-Secret" in hook
    sts = next(d for _, d in DOCS if d["metadata"]["name"] == "kvserve-worker" and
               d["kind"] == "StatefulSet")  # fmt: skip
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > ns.graceful_timeout
    assert sts["spec"]["serviceName"] == "kvserve-worker"
    affinity = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"]


def test_app_routes_exist():
    """The probe paths are routes of the worker and router apps."""
    from kvserve.router.app import build_router_app
    from kvserve.router.config import RouterConfig

    router = build_router_app(RouterConfig(cluster="redis://127.0.0.1:1/0", cluster_secret="s"))
    paths = {getattr(r, "path", None) for r in router.routes}
    assert {"/ready", "/health", "/metrics"} <= paths
    from kvserve.server import routes_admin

    src = Path(routes_admin.__file__).read_text()
    assert '"/ready"' in src and '"/health"' in src


def test_prometheus_rule_is_generated_from_alerts_yml():
    spec = importlib.util.spec_from_file_location("gen", DEPLOY / "generate_monitoring.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DEPLOY / "monitoring.yaml").read_text() == gen.render(), (
        "monitoring.yaml is stale: python deploy/kubernetes/generate_monitoring.py"
    )
    rule = next(d for _, d in DOCS if d["kind"] == "PrometheusRule")
    alerts = yaml.safe_load((DEPLOY.parent / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
