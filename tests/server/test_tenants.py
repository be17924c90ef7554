"""Tenants file: parsing, validation against a pool, API key → tenant in a real server."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

from kvserve.tenants import Amount, TenantsConfig, hash_key
from kvserve.testing.procs import running_server

ACME_KEY, BETA_KEY = "sk-acme", "sk-beta"


def _config(**overrides) -> dict:
    cfg = {
        "default_tenant": None,
        "tenants": [
            {
                "name": "acme",
                "api_keys": [hash_key(ACME_KEY)],
                "priority": 10,
                "reservation": "25%",
                "limit": "60%",
                "max_concurrent_requests": 8,
            },
            {
                "name": "beta",
                "api_keys": [hash_key(BETA_KEY)],
                "reservation": "64 tokens",
                "limit": "1MiB",
            },
        ],
    }
    cfg.update(overrides)
    return cfg


def test_amounts_resolve_to_blocks():
    pool, bs, bpb = 200, 16, 4096
    assert Amount.parse(12, "x").blocks(pool, bs, bpb) == 12
    assert Amount.parse("12 blocks", "x").blocks(pool, bs, bpb) == 12
    assert Amount.parse("17 tokens", "x").blocks(pool, bs, bpb) == 2  # rounds up
    assert Amount.parse("1MiB", "x").blocks(pool, bs, bpb) == 256
    assert Amount.parse("25%", "x").blocks(pool, bs, bpb) == 50
    for bad in ("lots", "150%", -1, True):
        with pytest.raises(ValueError, match="x"):
            Amount.parse(bad, "x")


def test_resolve_and_keys():
    cfg = TenantsConfig.from_dict(_config())
    budgets = cfg.resolve(pool_blocks=200, block_size=16, bytes_per_block=4096)
    assert (budgets["acme"].reservation_blocks, budgets["acme"].limit_blocks) == (50, 120)
    assert (budgets["beta"].reservation_blocks, budgets["beta"].limit_blocks) == (4, 200)
    assert cfg.tenant_for_key(ACME_KEY) == "acme"
    assert cfg.tenant_for_key(BETA_KEY) == "beta"
    assert cfg.tenant_for_key("sk-nobody") is None
    assert cfg.tenant_for_key(None) is None  # no default tenant: refused


def test_a_tenant_s_own_queue_bound_or_the_server_s():
    cfg = TenantsConfig.from_dict(
        {"tenants": [{"name": "a", "max_waiting_requests": 3}, {"name": "b"}]}
    )
    assert (cfg.queue_bound("a", 16), cfg.queue_bound("b", 16)) == (3, 16)
    assert cfg.queue_bound("nobody", 16) == 16 and cfg.total_queue_bound(16) == 19


@pytest.mark.parametrize(
    "change,message",
    [
        ({"default_tenant": "ghost"}, "default_tenant 'ghost'"),
        ({"extra": 1}, "unknown field"),
        ({"tenants": [{"name": "a", "api_keys": ["sk-plain"]}]}, "hashes"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "defined twice"),
        ({"tenants": [{"name": "a", "reservation": "70%", "limit": "50%"}]}, "exceeds its limit"),
        (
            {"tenants": [{"name": "a", "reservation": "60%"}, {"name": "b", "reservation": "50%"}]},
            "reservations add up to 220 blocks but the KV pool has 200",
        ),
        ({"tenants": [{"name": "a", "colour": "red"}]}, "unknown field"),
        ({"tenants": [{"name": "a", "max_waiting_requests": 0}]}, "max_waiting_requests must"),
        ({"tenants": [{"name": "a", "max_waiting_requests": True}]}, "max_waiting_requests must"),
    ],
)
def test_bad_files_are_rejected_with_the_reason(change, message):
    with pytest.raises(ValueError, match=message):
        TenantsConfig.from_dict(_config(**change), "t.yaml").resolve(200, 16, 4096)


def test_cli_check_rejects_overbooked_reservations(tmp_path):
    import yaml

    path = tmp_path / "t.yaml"

    def check(cfg: dict, pool: int) -> subprocess.CompletedProcess:
        path.write_text(yaml.safe_dump(cfg))
        cmd = [
            sys.executable,
            "-m",
            "kvserve.cli",
            "tenants",
            "check",
            str(path),
            "--pool-blocks",
            str(pool),
            "--bytes-per-block",
            "4096",
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    ok = check(_config(), 200)
    assert ok.returncode == 0 and "acme: priority 10, reservation 50 blocks" in ok.stdout
    over = _config(
        tenants=[{"name": "a", "reservation": "60%"}, {"name": "b", "reservation": "300 blocks"}]
    )
    bad = check(over, 400)
    assert bad.returncode == 2
    assert "reservations add up to 540 blocks but the KV pool has 400" in bad.stderr


def test_server_maps_keys_to_tenants(llama_dir, tmp_path):
    import yaml

    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(_config()))
    usage = tmp_path / "usage.jsonl"
    with running_server(
        llama_dir,
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
        "--tenants",
        str(path),
        "--kv-usage-log",
        str(usage),
        "--kv-usage-interval",
        "0.001",
        log=tmp_path / "serve.log",
    ) as server:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)

        out = client(ACME_KEY).completions.create(
            model=str(llama_dir), prompt="x" * 40, max_tokens=40, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 40
        with pytest.raises(openai.AuthenticationError):
            client("sk-nobody").completions.create(model=str(llama_dir), prompt="x")
        req = urllib.request.Request(
            server.url + "/v1/completions",
            method="POST",
            data=b'{"prompt": "x"}',
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as no_key:
            urllib.request.urlopen(req, timeout=30)
        assert no_key.value.code == 401  # no default tenant: key-less requests refused
    samples = [json.loads(line) for line in usage.read_text().splitlines()]
    assert any(s.get("tenants", {}).get("acme", 0) > 0 for s in samples)
    assert not any("beta" in s.get("tenants", {}) for s in samples)


@pytest.mark.parametrize("flag", [(), ("--prefix-cache-isolation", "none")])
def test_tenants_share_prefix_blocks_only_within_a_tenant_by_default(llama_dir, tmp_path, flag):
    import yaml

    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(_config()))
    with running_server(
        llama_dir, "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--tenants",
        str(path), *flag, log=tmp_path / "serve.log",
    ) as server:  # fmt: skip

        def cached(key: str) -> int:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            out = c.completions.create(model=str(llama_dir), prompt="x" * 40, max_tokens=1)
            return out.usage.prompt_tokens_details.cached_tokens

        assert cached(ACME_KEY) == 0
        assert cached(ACME_KEY) >= 16  # the same tenant: its blocks are reused
        assert (cached(BETA_KEY) == 0) == (flag == ())  # another: only when shared on purpose
    if flag:
        assert "tenants share prefix blocks" in (tmp_path / "serve.log").read_text()


def _labelled(server, name: str, **labels: str) -> float | None:
    """The value of metric ``name`` whose labels include ``labels`` (None if absent)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_reload_applies_new_limits_without_dropping_streams(llama_dir, tmp_path):
    """SIGHUP and POST /admin/tenants/reload apply a changed file while a stream runs; an
    invalid file is refused (400) and the old limits stay."""
    import signal

    import yaml

    from kvserve.testing.procs import wait_until

    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(_config()))
    admin = "sk-admin"
    with running_server(
        llama_dir,
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "512",
        "--tenants",
        str(path),
        "--admin-key",
        admin,
        log=tmp_path / "serve.log",
    ) as server:
        pool = server.metric("kvserve_kv_cache_capacity_bytes")
        limit0 = _labelled(server, "kvserve_tenant_kv_limit_blocks", tenant="acme")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=ACME_KEY, max_retries=0)
        stream = client.completions.create(
            model=str(llama_dir),
            prompt="x" * 40,
            max_tokens=300,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        assert next(chunks).choices
        assert _labelled(server, "kvserve_tenant_kv_blocks", tenant="acme") > 0
        assert _labelled(server, "kvserve_kv_cache_usage_peak_perc", window="1m") > 0

        path.write_text(
            yaml.safe_dump(_config(tenants=[{**_config()["tenants"][0], "limit": "30%"}]))
        )
        server.proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: (
                _labelled(server, "kvserve_tenant_kv_limit_blocks", tenant="acme") == limit0 // 2
            ),
            30,
            "the SIGHUP reload",
        )
        assert _labelled(server, "kvserve_tenant_kv_limit_blocks", tenant="beta") is None

        def reload() -> urllib.request.Request:
            return urllib.request.Request(
                server.url + "/admin/tenants/reload",
                method="POST",
                headers={"Authorization": f"Bearer {admin}"},
            )

        path.write_text(yaml.safe_dump(_config()))
        with urllib.request.urlopen(reload(), timeout=30) as r:
            assert json.loads(r.read())["tenants"] == ["acme", "beta"]
        assert _labelled(server, "kvserve_tenant_kv_limit_blocks", tenant="acme") == limit0
        path.write_text(yaml.safe_dump(_config(default_tenant="nobody")))
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(reload(), timeout=30)
        assert bad.value.code == 400
        assert "nobody" in json.loads(bad.value.read())["error"]["message"]
        assert _labelled(server, "kvserve_tenant_kv_limit_blocks", tenant="acme") == limit0

        rest = list(chunks)
        assert rest[-2].choices[0].finish_reason == "length"
        assert rest[-1].usage.completion_tokens == 300  # the stream outlived three reloads
        assert pool > 0
