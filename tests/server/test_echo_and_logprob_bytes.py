"""Completions ``echo`` (the prompt before the output, streamed or not, text or token-id
prompts) and chat logprobs' ``bytes`` (a token's own bytes, also for part of a UTF-8
character), against a real ``kvserve serve`` process and the bundled model's tokenizer."""

from __future__ import annotations

import openai
import pytest

from kvserve.default_model import default_model_path
from kvserve.model.tokenizer import load_tokenizer
from kvserve.testing.procs import running_server


@pytest.fixture(scope="module")
def client(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("echo") / "serve.log"
    flags = ("--kv-cache-memory", "16MiB", "--max-model-len", "256")
    with running_server(llama_dir, *flags, "--served-model-name", "tiny", log=log) as proc:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _complete(client, prompt, stream: bool, **kw) -> str:
    args = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, **kw)
    if not stream:
        return client.completions.create(**args).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_output(client, stream):
    prompt = "hello there, general"
    plain = _complete(client, prompt, stream)
    echoed = _complete(client, prompt, stream, echo=True)
    assert echoed == prompt + plain
    assert len(plain) > 0


def test_echo_of_token_ids_is_their_text(client):
    ids = [5, 17, 42, 99]
    echoed = (
        client.completions.create(
            model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True, extra_body={}
        )
        .choices[0]
        .text
    )
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0)
    assert echoed.endswith(plain.choices[0].text)
    assert len(echoed) > len(plain.choices[0].text)


def test_echo_with_logprobs_is_refused_clearly(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, echo=True, logprobs=1)
    assert "echo together with logprobs" in str(e.value)


def test_token_bytes_are_the_tokens_own_bytes():
    """Byte-level BPE splits multi-byte characters: each piece's bytes, not U+FFFD's."""
    tok = load_tokenizer(default_model_path())
    text = "naïve café, 日本語 and 😀!"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert any(p.decode("utf-8", errors="replace") != p.decode("utf-8", "ignore") for p in pieces)
    assert all(p != "\ufffd".encode() for p in pieces)


def test_chat_logprob_bytes_join_to_the_tokens_text(client):
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token or (
            "\ufffd" in entry.token
        )
        for top in entry.top_logprobs:
            assert top.bytes is not None
