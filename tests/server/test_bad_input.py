"""Bad input gets a 400 with an OpenAI-shaped body, never a 500, and nothing is lost: lone
surrogates anywhere in the body, non-boolean booleans, ``min_tokens > max_tokens``,
non-UTF-8 and non-JSON bodies (a real ``kvserve serve`` process)."""

from __future__ import annotations

import openai
import pytest
from bad_bodies import BAD_BODIES, post_raw

from kvserve.testing.procs import running_server

KEY = "sk-bad-input"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("bad-input") / "serve.log"
    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "256", "--api-key", KEY)
    with running_server(llama_dir, *flags, "--served-model-name", "tiny", log=log) as proc:
        yield proc


@pytest.mark.parametrize("path,body,param", BAD_BODIES)
def test_bad_body_is_a_400_naming_what_is_wrong(server, path, body, param):
    status, payload = post_raw(server.url + path, body, KEY)
    assert status == 400, payload
    err = payload["error"]
    assert err["type"] == "BadRequestError"
    assert err["param"] == param
    assert "internal error" not in err["message"]
    if param is not None:
        assert err["message"].startswith(param)


def test_the_messages_say_what_to_fix(server):
    msgs = {
        body: post_raw(server.url + path, body, KEY)[1]["error"]["message"]
        for path, body, _ in BAD_BODIES
    }
    assert "lone UTF-16 surrogate" in msgs[BAD_BODIES[0][1]]
    assert "min_tokens (5) must not exceed max_tokens (2)" in msgs[BAD_BODIES[7][1]]
    assert msgs[BAD_BODIES[8][1]] == "the body is not valid JSON: it is not UTF-8 text"
    assert msgs[BAD_BODIES[9][1]].startswith("the body is not valid JSON: ")
    assert msgs[BAD_BODIES[10][1]] == "the body must be a JSON object"


def test_the_server_still_serves_after_bad_input(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert server.metric("kvserve_http_errors_total", 'status="500"') == 0


def test_served_model_id_is_short_and_leaks_no_path(tmp_path):
    from kvserve.default_model import DEFAULT_MODEL_DIR
    from kvserve.server.state import served_model_id

    assert served_model_id(str(DEFAULT_MODEL_DIR), None) == "kvserve-default"
    assert served_model_id(str(DEFAULT_MODEL_DIR) + "/", None) == "kvserve-default"
    assert served_model_id(str(tmp_path / "Llama-3.2-1B"), None) == "Llama-3.2-1B"
    assert served_model_id(str(tmp_path / "Llama-3.2-1B") + "/", None) == "Llama-3.2-1B"
    assert served_model_id(str(tmp_path / "m.Q4_1.gguf"), None) == "m.Q4_1"
    assert served_model_id(str(DEFAULT_MODEL_DIR), "mine") == "mine"


def test_the_bundled_model_is_served_as_kvserve_default(tmp_path):
    """The README's client example (``model="kvserve-default"``) against ``kvserve serve``."""
    from kvserve.default_model import default_model_path

    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "256")
    with running_server(default_model_path(), *flags, log=tmp_path / "serve.log") as proc:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["kvserve-default"]
        out = client.chat.completions.create(
            model="kvserve-default", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert out.model == "kvserve-default"
