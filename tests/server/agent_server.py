"""One real ``kvserve serve`` of the bundled model for the agent-API tests (tools,
structured outputs, sampling controls, conformance), driven by the official client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai

from kvserve.default_model import DEFAULT_MODEL_DIR
from kvserve.tenants import hash_key

MODEL = "kvserve-default"
FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")
BUNDLED = DEFAULT_MODEL_DIR


def tenants_file(
    path: Path, keys: dict[str, str], settings: dict[str, dict[str, Any]] | None = None
) -> Path:
    """A tenants file at ``path``: tenant name → its one API key, no default tenant;
    ``settings``: more fields per tenant (``priority``, ``reservation`` …)."""
    tenants = [
        {"name": name, "api_keys": [hash_key(key)], **(settings or {}).get(name, {})}
        for name, key in keys.items()
    ]
    path.write_text(json.dumps({"default_tenant": None, "tenants": tenants}))
    return path


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def post(server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A raw POST (fields the client would not send); the status and the JSON body."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_body(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 128,
    }
    body.update(kw)
    return body
