"""``return_token_ids`` (vLLM's extension) through the official openai client: the
prompt's and each choice's token ids, whole or per streamed delta — what a router needs
to resume a stream elsewhere."""

from __future__ import annotations

import openai
from helpers import random_prompts

from kvserve.testing.procs import running_server

PROMPT = random_prompts([30], seed=3)[0]


def test_token_ids_whole_and_streamed(llama_dir, tmp_path):
    with running_server(llama_dir, "--kv-cache-memory", "8MiB", log=tmp_path / "s.log") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=str(llama_dir), max_tokens=20, temperature=0.0)
        extra = {"ignore_eos": True, "return_token_ids": True}
        whole = client.completions.create(prompt=PROMPT, extra_body=extra, **kw)
        ids = whole.choices[0].token_ids
        assert len(ids) == whole.usage.completion_tokens == 20
        assert whole.prompt_token_ids == PROMPT

        chunks = list(client.completions.create(prompt=PROMPT, stream=True, extra_body=extra, **kw))
        assert chunks[0].prompt_token_ids == PROMPT
        assert [t for c in chunks for t in c.choices[0].token_ids] == ids
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text

        plain = client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **kw)
        assert "token_ids" not in (plain.choices[0].model_extra or {})

        msgs = [{"role": "user", "content": "hello"}]
        chat = client.chat.completions.create(messages=msgs, extra_body=extra, **kw)
        stream = client.chat.completions.create(messages=msgs, stream=True, extra_body=extra, **kw)
        streamed = [t for c in stream for t in (getattr(c.choices[0], "token_ids", None) or [])]
        assert streamed == chat.choices[0].token_ids and len(streamed) == 20
