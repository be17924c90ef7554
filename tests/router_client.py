"""The client side of cluster tests: a mixed streaming workload through a router."""

from __future__ import annotations

import openai

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hum",
]


def prompt_text(i: int, n: int = 12) -> str:
    return " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(n))


def workload_spec(i: int, model: str) -> dict:
    """Stream ``i`` of a mixed workload: completion/chat, greedy/seeded sampling, with and
    without a session id."""
    spec: dict = {"model": model, "max_tokens": 200, "temperature": 0.0 if i % 2 == 0 else 0.8}
    if i % 2:
        spec["seed"] = 100 + i
    extra: dict = {"ignore_eos": True}
    if i < 4:
        extra["session_id"] = f"conv-{i}"
    if i % 4 == 3:
        spec["messages"] = [{"role": "user", "content": prompt_text(i)}]
    else:
        spec["prompt"] = prompt_text(i)
    spec["extra_body"] = extra
    return spec


def session_spec(i: int, model: str, session: str, max_tokens: int) -> dict:
    """``workload_spec(i)`` as one session's stream of exactly ``max_tokens`` tokens."""
    spec = workload_spec(i, model) | {"max_tokens": max_tokens}
    spec["extra_body"] = {"ignore_eos": True, "session_id": session}
    return spec


def stream_via(client: openai.OpenAI, spec: dict, progress: list | None = None):
    """(worker that took it, text) of one streamed request; ``progress[0]`` counts the
    content chunks as they arrive."""
    chat = "messages" in spec
    api = client.chat.completions if chat else client.completions
    raw = api.with_raw_response.create(stream=True, **spec)
    worker = raw.headers["x-kvserve-worker"]
    text = ""
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
        text += piece or ""
        if progress is not None and piece:
            progress[0] += 1
    return worker, text


def router_client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
