"""A 10-turn agent conversation on SmolLM2-135M-Instruct (``benchmarks/peers/real_model.py``):
kvserve's Responses API continuing each turn with ``previous_response_id`` beside vLLM-CPU
re-sending the whole history to ``/v1/chat/completions`` with prefix caching.

The conversation: a ~4k-token tool catalogue as the instructions (a system message — the
same text for both engines: SmolLM2's chat template renders no ``tools``, so passing them
would give the engines different prompts), then ten user turns of ~40 tokens (a task, then
tool results), 32 output tokens each, greedy. Per turn: time to first token (the first
text delta, streamed) and prompt tokens computed (prompt tokens − cached tokens, from each
engine's usage).

Scenarios, each engine alone, rounds interleaved:
- ``kvserve``: one worker, ``previous_response_id`` (the server holds the conversation).
- ``vllm``: one vLLM server, the client re-sends the history (prefix caching on).
- ``kvserve-failover``: two workers and a router sharing a Redis tier; before every turn
  after the first, the worker holding the conversation is killed (SIGKILL) and restarted:
  each turn runs on the other worker, from the shared tier.
- ``vllm-cold``: vLLM with a fresh ``cache_salt`` every turn — what a restarted vLLM (or
  one that lost the conversation's cache) computes.

    python benchmarks/peers/agent_conversation.py --rounds 2
    python benchmarks/peers/agent_conversation.py --random \
        --out benchmarks/results/agent_conversation_random.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
from structured import commands, serve, stop

from kvserve.testing.bench import with_tokenizer
from kvserve.testing.models import SMOL, build_real_model
from kvserve.testing.procs import free_port

TURNS = 10
OUTPUT_TOKENS = 32
MAX_MODEL_LEN = 8192


def random_model(path: Path = Path("/tmp/kvserve-bench/smol-random-8k")) -> Path:
    """The offline benchmark's random-weight SmolLM2 shape with 8k positions (the
    conversation outgrows 2k) and the bundled model's tokenizer, saved once (seeded)."""
    if not (path / "config.json").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(**(SMOL | {"max_position_embeddings": MAX_MODEL_LEN}))
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return with_tokenizer(path)


def catalogue(n_tools: int = 20) -> str:
    """A tool catalogue as a system prompt (~4k SmolLM2 tokens)."""
    tools = []
    for i in range(n_tools):
        tools.append({
            "name": f"tool_{i}_{['search', 'fetch', 'update', 'create', 'delete'][i % 5]}",
            "description": f"Operation {i}: looks up, validates and returns the records of "
            f"collection {i} that match the given filters, sorted by relevance, with "
            "pagination, retries on transient errors and an audit entry for each call.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                    "cursor": {"type": "string", "description": "from the previous page"},
                    "fields": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["query"],
            },
        })  # fmt: skip
    return (
        "You are an operations agent. You can call these tools by answering with "
        '<tool_call>{"name": ..., "arguments": ...}</tool_call>:\n' + json.dumps(tools, indent=1)
    )


def user_turn(t: int) -> str:
    if t == 0:
        return "Find the three most recent failed orders for customer 4471 and summarize them."
    result = {"step": t, "status": "ok", "rows": [{"id": 9000 + t * 3 + k, "state": "failed"}
                                                 for k in range(3)]}  # fmt: skip
    return f"Tool result {t}: {json.dumps(result)}. Continue."


def _ttft_responses(client: openai.OpenAI, **kw: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    first, final = None, None
    for ev in client.responses.create(stream=True, **kw):
        if first is None and ev.type == "response.output_text.delta" and ev.delta:
            first = time.perf_counter() - start
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None
    return (first if first is not None else time.perf_counter() - start), final


def kvserve_chain(url: str) -> list[dict[str, float]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
    system, prev, out = catalogue(), None, []
    for t in range(TURNS):
        ttft, r = _ttft_responses(
            client, model="smol", instructions=system, input=user_turn(t),
            previous_response_id=prev, max_output_tokens=OUTPUT_TOKENS, temperature=0,
        )  # fmt: skip
        u = r.usage
        out.append({"ttft": ttft, "prompt": u.input_tokens,
                    "computed": u.input_tokens - u.input_tokens_details.cached_tokens})  # fmt: skip
        prev = r.id
    return out


def vllm_chain(url: str, cold: bool) -> list[dict[str, float]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
    messages = [{"role": "system", "content": catalogue()}]
    out = []
    for t in range(TURNS):
        messages.append({"role": "user", "content": user_turn(t)})
        extra = {"cache_salt": f"cold-{time.time_ns()}"} if cold else {}
        start, first, text, usage = time.perf_counter(), None, "", None
        for chunk in client.chat.completions.create(
            model="smol", messages=messages, max_tokens=OUTPUT_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
        ):  # fmt: skip
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        cached = (
            (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        )
        out.append({"ttft": first or time.perf_counter() - start, "prompt": usage.prompt_tokens,
                    "computed": usage.prompt_tokens - cached})  # fmt: skip
        messages.append({"role": "assistant", "content": text})
    return out


class Cluster:
    """redis-server, two kvserve workers (unpinned: one conversation keeps one busy at a
    time) and a router; a worker can be killed and restarted."""

    def __init__(self, model: Path, logs: Path):
        self.model, self.logs = model, logs
        self.redis_port = free_port()
        self.redis = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.redis_port),
             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.ports = {n: free_port() for n in ("a", "b")}
        self.workers: dict[str, subprocess.Popen] = {}
        for n in self.ports:
            self.start(n)
        for n in self.ports:
            self.wait(n)
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self.router = serve(
            [sys.executable, "-m", "kvserve.cli", "router", "--cluster", self.url,
             "--cluster-secret", "bench", "--port", str(port)],
            dict(os.environ), self.router_url, logs / "router.log")  # fmt: skip
        self.wait_routable(2)

    def start(self, node: str) -> None:
        log = (self.logs / f"worker-{node}.log").open("a")
        self.workers[node] = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(self.model),
             "--served-model-name", "smol", "--dtype", "bfloat16", "--max-model-len",
             str(MAX_MODEL_LEN), "--kv-cache-memory", "1GiB", "--port", str(self.ports[node]),
             "--node-id", node, "--cluster", self.url, "--cluster-secret", "bench",
             "--kv-store", self.url],
            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def wait(self, node: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.ports[node]}/ready", timeout=2
                ):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker {node} did not start") from None
                time.sleep(0.5)

    def wait_routable(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(self.router_url + "/router/workers", timeout=5) as r:
                view = json.loads(r.read())
            if sum(w["routable"] for w in view["workers"]) >= n:
                return
            if time.monotonic() > deadline:
                raise SystemExit("the router does not see both workers")
            time.sleep(0.5)

    def restart_holder(self, holder: str) -> None:
        """SIGKILL ``holder`` and start it again; returns once the other worker alone is
        there (the next turn goes to it) — the restart goes on meanwhile."""
        self.workers[holder].send_signal(signal.SIGKILL)
        self.workers[holder].wait(30)
        self.start(holder)

    def close(self) -> None:
        stop(self.router)
        for p in self.workers.values():
            stop(p)
        stop(self.redis)


def failover_chain(model: Path, logs: Path) -> list[dict[str, float]]:
    c = Cluster(model, logs)
    try:
        owner = {"node": None}

        def before(t: int) -> None:
            # the previous turn's worker: the one serving the conversation's session now
            node = owner["node"]
            if node is not None:
                c.restart_holder(node)
            owner["node"] = None

        client = openai.OpenAI(base_url=c.router_url + "/v1", api_key="x", max_retries=0,
                               timeout=900)  # fmt: skip
        system, prev, out = catalogue(), None, []
        for t in range(TURNS):
            if t > 0:
                before(t)
            start = time.perf_counter()
            raw = client.responses.with_raw_response.create(
                model="smol", instructions=system, input=user_turn(t), previous_response_id=prev,
                max_output_tokens=OUTPUT_TOKENS, temperature=0, stream=True,
            )  # fmt: skip
            owner["node"] = raw.headers["x-kvserve-worker"]
            first, final = None, None
            for ev in raw.parse():
                if first is None and ev.type == "response.output_text.delta" and ev.delta:
                    first = time.perf_counter() - start
                if ev.type in ("response.completed", "response.incomplete"):
                    final = ev.response
            u = final.usage
            out.append({"ttft": first or time.perf_counter() - start, "prompt": u.input_tokens,
                        "computed": u.input_tokens - u.input_tokens_details.cached_tokens,
                        "worker": owner["node"]})  # fmt: skip
            prev = final.id
            for n in c.ports:  # the restarted worker is back before the next kill
                c.wait(n)
            c.wait_routable(2)
        return out
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/kvserve-bench/smollm2-135m-instruct")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument(
        "--random",
        action="store_true",
        help="the random-weight SmolLM2-135M shape (benchmarks/peers/offline.py, 8k positions, the "
        "bundled model's tokenizer) instead of the real checkpoint",
    )
    ap.add_argument("--out", default="benchmarks/results/agent_conversation.json")
    a = ap.parse_args()
    model = random_model() if a.random else build_real_model(Path(a.model_dir))
    engines = commands(model, a.vllm_python)
    for name, (cmd, _, _) in engines.items():  # a long conversation, cached tokens shown
        cmd[cmd.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
        if name == "vllm":
            cmd.append("--enable-prompt-tokens-details")
    if a.skip_vllm or not Path(a.vllm_python).exists():
        del engines["vllm"]
    logs = Path("/tmp/agent-conversation")
    logs.mkdir(exist_ok=True)
    runs: dict[str, list[list[dict[str, float]]]] = {}
    for r in range(a.rounds):
        order = ["kvserve", "vllm", "kvserve-failover"]
        order = order if r % 2 == 0 else list(reversed(order))
        for name in order:
            if name == "kvserve-failover":
                runs.setdefault(name, []).append(failover_chain(model, logs))
                print(f"round {r} {name}: {runs[name][-1]}", flush=True)
                continue
            if name not in engines:
                continue
            cmd, env, url = engines[name]
            proc = serve(cmd, env, url, logs / f"{name}-r{r}.log")
            try:
                if name == "kvserve":
                    runs.setdefault(name, []).append(kvserve_chain(url))
                else:  # warm (prefix caching) and cold (a new salt each turn)
                    runs.setdefault("vllm", []).append(vllm_chain(url, cold=False))
                    runs.setdefault("vllm-cold", []).append(vllm_chain(url, cold=True))
            finally:
                stop(proc)
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    summary = {}
    for name, rounds in runs.items():
        per_turn = [
            {
                k: statistics.median(rd[t][k] for rd in rounds)
                for k in ("ttft", "prompt", "computed")
            }
            for t in range(TURNS)
        ]
        summary[name] = {
            "ttft_ms": [round(p["ttft"] * 1000) for p in per_turn],
            "prompt_tokens": [int(p["prompt"]) for p in per_turn],
            "computed_tokens": [int(p["computed"]) for p in per_turn],
            "ttft_ms_turns_2_10_median": round(
                statistics.median(p["ttft"] for p in per_turn[1:]) * 1000),
            "computed_tokens_total": int(sum(p["computed"] for p in per_turn)),
        }  # fmt: skip
    print(json.dumps(summary, indent=1))
    Path(a.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
