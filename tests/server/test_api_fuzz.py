"""Property-based API fuzz: schemathesis generates requests from the server's own
/openapi.json; no response may be a 5xx and the server must keep serving."""

from __future__ import annotations

import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from kvserve.testing.procs import running_server

KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def fuzz_server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    with running_server(
        llama_dir,
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "128",
        "--api-key",
        KEY,
        "--admin-key",
        "adm",
        log=log,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_server):
    response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code < 500, (case.path, case.body, response.text[:500])
    with urllib.request.urlopen(fuzz_server.url + "/health", timeout=10) as r:
        assert r.status == 200
