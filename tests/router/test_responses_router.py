"""The Responses API through ``kvserve router`` over real workers sharing a real Redis:
``previous_response_id`` goes to the worker holding the conversation; with that worker
killed between turns, another continues the conversation from the shared tier (its
stored response and its KV); a Responses stream survives ``kill -9`` of its worker
mid-stream with the exact text of an uninterrupted run; stored responses are read and
deleted through the router; bad bodies get the workers' 400s."""

from __future__ import annotations

import json
import signal
import urllib.request

import openai
import pytest
from router_client import prompt_text, router_client

from kvserve.testing.cluster import cluster
from kvserve.testing.procs import wait_until

WORKER_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", "32MiB")
LONG = " ".join(prompt_text(i, 24) for i in range(6))


def _create(client: openai.OpenAI, model: str, **kw):
    """(worker that took it, response) of one whole request."""
    body = {"model": model, "max_output_tokens": 12, "temperature": 0, "instructions": "Answer."}
    raw = client.responses.with_raw_response.create(**(body | kw))
    return raw.headers["x-kvserve-worker"], raw.parse()


def _stream(client: openai.OpenAI, model: str, on_delta=None, **kw):
    """(worker, text, final response) of one streamed request; ``on_delta(n)`` after
    the n-th text delta."""
    body = {"model": model, "stream": True}
    raw = client.responses.with_raw_response.create(**(body | kw))
    worker, text, final, seqs = raw.headers["x-kvserve-worker"], "", None, []
    for ev in raw.parse():
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            text += ev.delta
            if on_delta is not None:
                on_delta(len(seqs))
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert seqs == list(range(len(seqs)))  # one sequence, across a failover too
    return worker, text, final


def test_a_conversation_moves_to_another_worker_when_its_holder_dies(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path, worker_args=WORKER_ARGS) as c:
        client = router_client(c.routers[0])
        model = str(llama_dir)
        # (instructions are not carried over: an agent sends them every turn)
        holder, r1 = _create(client, model, input=LONG)
        again, r2 = _create(client, model, input="and more", previous_response_id=r1.id)
        assert again == holder  # affinity: the conversation's worker
        assert r2.usage.input_tokens_details.cached_tokens >= 0.8 * r2.usage.input_tokens
        # a response not stored, continuing it, neither moves nor overwrites its session
        aside, _ = _create(client, model, input="aside", previous_response_id=r2.id, store=False)
        assert aside == holder
        other = "b" if holder == "a" else "a"
        session = c.workers[other].url + f"/v1/sessions/{r2.id[:29]}"

        def in_redis() -> bool:  # the holder's writes reached the shared tier
            try:
                with urllib.request.urlopen(session, timeout=5) as r:
                    return json.loads(r.read())["num_tokens"] == r2.usage.total_tokens
            except OSError:
                return False

        wait_until(in_redis, 30, "the conversation's session in Redis")
        c.workers[holder].proc.send_signal(signal.SIGKILL)
        c.workers[holder].proc.wait(10)
        # a stored response is read through the router from the shared tier
        assert client.responses.retrieve(r2.id).output_text == r2.output_text
        took, r3 = _create(client, model, input="and the end", previous_response_id=r2.id)
        assert took == other and r3.previous_response_id == r2.id
        cached = r3.usage.input_tokens_details.cached_tokens
        assert cached >= 0.8 * r3.usage.input_tokens, r3.usage  # restored from Redis
        items = client.responses.input_items.list(r3.id)
        assert items.data[0].content[0].text == "and the end"
        client.responses.delete(r3.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r3.id)
        # a bad body gets the worker's 400, through the router
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, input="x", extra_body={"reasoning": {}})
        assert e.value.body["param"] == "reasoning"


def test_a_responses_stream_survives_kill_9_of_its_worker(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path, worker_args=WORKER_ARGS) as c:
        router = c.routers[0]
        client = router_client(router)
        model = str(llama_dir)
        _, first = _create(client, model, input=LONG)
        spec = {
            "input": "go on",
            "previous_response_id": first.id,
            "max_output_tokens": 200,
            "temperature": 0.8,
            "extra_body": {"seed": 11},  # a kvserve (and vLLM) extension
            "instructions": "Answer.",
        }
        _, want, _ = _stream(client, model, **spec)  # uninterrupted
        assert len(want) > 50
        killed: list[str] = []

        def kill_at(n: int) -> None:
            if n >= 20 and not killed:
                killed.append(holder[0])
                c.workers[holder[0]].proc.send_signal(signal.SIGKILL)

        raw = client.responses.with_raw_response.create(model=model, stream=True, **spec)
        holder = [raw.headers["x-kvserve-worker"]]
        text, final, seqs = "", None, []
        for ev in raw.parse():
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                text += ev.delta
                kill_at(len(seqs))
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert killed and seqs == list(range(len(seqs)))
        assert text == want and final.output_text == want  # nothing lost or repeated
        assert router.metric("kvserve_router_failovers_total") >= 1
        # the continuing worker stored the response under the id the client has
        assert client.responses.retrieve(final.id).output_text == want
