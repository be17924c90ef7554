"""``kvserve router`` in front of real worker processes sharing a real Redis (issue 8):
streams survive ``kill -9`` and SIGSTOP of their worker with the exact text of an
uninterrupted run, a stopped-then-resumed primary writes nothing, session affinity lives
in Redis (router restarts, several routers), and serving goes on while Redis is briefly
stopped. The client is the official ``openai`` package."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import msgspec
import openai
import pytest
from bad_bodies import BAD_BODIES, post_raw
from router_client import prompt_text, router_client, session_spec, stream_via, workload_spec

from kvserve.ha.record import SessionRecord
from kvserve.router.workers import rendezvous
from kvserve.sampling import SamplingParams
from kvserve.testing.cluster import SECRET, cluster, router_view
from kvserve.testing.procs import wait_until


def _router_metric(router, name: str) -> float:
    with urllib.request.urlopen(router.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )


def test_eight_streams_survive_kill_9_of_a_worker(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path) as c:
        router = c.routers[0]
        client = router_client(router)
        specs = [workload_spec(i, str(llama_dir)) for i in range(8)]
        want = [stream_via(client, s)[1] for s in specs]  # uninterrupted runs
        assert len(set(want)) == 8

        progress = [[0] for _ in specs]
        results: list = [None] * 8

        def run(i: int) -> None:
            try:
                results[i] = stream_via(client, specs[i], progress[i])
            except Exception as e:  # reported by the assertion below
                results[i] = ("error", repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        wait_until(lambda: all(p[0] >= 16 for p in progress), 60, "every stream under way")
        c.workers["a"].proc.send_signal(signal.SIGKILL)
        at_kill = [p[0] for p in progress]
        for t in threads:
            t.join(120)
        on_a = [i for i, r in enumerate(results) if r[0] == "a"]
        assert len(on_a) >= 2 and min(at_kill[i] for i in on_a) < 150  # killed mid-stream
        for i, (_, text) in enumerate(results):
            assert text == want[i], f"stream {i} differs after the failover"
        assert _router_metric(router, "kvserve_router_failovers_total") >= 1
        assert _router_metric(router, "kvserve_router_failover_failures_total") == 0


def test_a_stopped_primary_is_failed_over_and_fenced(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path) as c:
        router = c.routers[0]
        client = router_client(router)
        spec = session_spec(1, str(llama_dir), "paused", 120)
        want = stream_via(client, spec)[1]

        chat = "messages" in spec
        raw = client.completions.with_raw_response.create(stream=True, **spec)
        assert not chat
        primary = raw.headers["x-kvserve-worker"]
        other = "b" if primary == "a" else "a"
        text, stopped = "", False
        for chunk in raw.parse():
            text += chunk.choices[0].text if chunk.choices else ""
            if not stopped and len(text) >= 20:
                c.workers[primary].proc.send_signal(signal.SIGSTOP)
                stopped = True
        assert stopped and text == want  # nothing lost, nothing repeated
        assert _router_metric(router, "kvserve_router_worker_failures_total") >= 1
        coord = c.coord
        own = coord.owner("paused")
        assert own.node == other

        wait_until(lambda: json.loads(coord.owner("paused").state)["finished"], 10, "final record")
        c.workers[primary].proc.send_signal(signal.SIGCONT)
        w = c.workers[primary]
        wait_until(lambda: w.metric("kvserve_num_requests_running") == 0, 30, "stale one dropped")
        after = coord.owner("paused")
        assert (after.node, after.epoch) == (own.node, own.epoch)  # no stale write landed
        record = json.loads(after.state)
        assert record["finished"] and record["epoch"] == own.epoch


def test_a_failover_waits_for_a_standby_that_is_briefly_unroutable(llama_dir, tmp_path):
    """The primary dies while its standby is out of rotation (SIGSTOP: its probes fail).
    The router waits for the standby (here 3 s, twice the old bound of ``max_failovers``
    x ``health_interval``) without spending attempts, and the stream goes on exactly once
    the standby is back."""
    with cluster(llama_dir, tmp_path) as c:
        router = c.routers[0]
        client = router_client(router)
        spec = session_spec(2, str(llama_dir), "late-standby", 150)
        want = stream_via(client, spec)[1]

        def routable(node: str) -> bool:
            return any(w["id"] == node and w["routable"] for w in router_view(router)["workers"])

        standby = "b" if c.coord.owner("late-standby").node == "a" else "a"
        primary = "a" if standby == "b" else "b"
        c.workers[standby].proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: not routable(standby), 30, "the standby out of rotation")
            progress, result = [0], {}

            def run() -> None:
                try:
                    result["r"] = stream_via(client, spec, progress)
                except Exception as e:  # reported by the assertion below
                    result["r"] = ("error", repr(e))

            t = threading.Thread(target=run)
            t.start()
            wait_until(lambda: progress[0] >= 20, 60, "stream under way")
            c.workers[primary].proc.send_signal(signal.SIGKILL)
            wait_until(
                lambda: _router_metric(router, "kvserve_router_worker_failures_total") >= 1,
                30,
                "the router saw the primary fail",
            )
            # the outage under test: the standby stays unroutable 3 s (twice the old bound),
            # unless the stream ends first (as it did, cut, before the router waited)
            t0 = time.monotonic()
            wait_until(
                lambda: "r" in result or time.monotonic() - t0 >= 3.0, 10, "the standby's outage"
            )
        finally:
            c.workers[standby].proc.send_signal(signal.SIGCONT)
        t.join(120)
        assert result["r"] == (primary, want)
        assert _router_metric(router, "kvserve_router_failovers_total") == 1
        assert _router_metric(router, "kvserve_router_failover_failures_total") == 0


def test_session_affinity_is_kept_in_redis_across_routers(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path, routers=2) as c:
        model = str(llama_dir)
        sessions = [f"user-{i}" for i in range(6)]
        home = {}
        for s in sessions:  # first turns go straight to the worker a fresh router would not pick
            favourite = max("ab", key=lambda n: rendezvous(s, n))
            home[s] = "b" if favourite == "a" else "a"
            direct = openai.OpenAI(base_url=c.workers[home[s]].url + "/v1", api_key="x")
            direct.completions.create(
                model=model, prompt=prompt_text(1), max_tokens=4, extra_body={"session_id": s}
            )

        def turn(router, s: str) -> str:
            raw = router_client(router).completions.with_raw_response.create(
                model=model, prompt=prompt_text(2), max_tokens=4, extra_body={"session_id": s}
            )
            raw.parse()
            return raw.headers["x-kvserve-worker"]

        coord = c.coord
        wait_until(  # the first turns' claims are made asynchronously by their workers
            lambda: all(coord.owner(s) is not None for s in sessions), 10, "sessions claimed"
        )
        for k, s in enumerate(sessions):  # two routers at once agree
            assert turn(c.routers[k % 2], s) == home[s]
            other = "b" if home[s] == "a" else "a"

            def standby_named(s=s, other=other) -> bool:  # the primary was told its standby
                own = coord.owner(s)
                return own.state is not None and json.loads(own.state).get("standby") == other

            wait_until(standby_named, 10, "record names the standby")
        c.routers[0].proc.send_signal(signal.SIGKILL)
        c.routers[0].proc.wait(10)
        fresh = c.add_router()  # a restarted router knows nothing but what Redis holds
        for s in sessions:
            assert turn(fresh, s) == home[s]
        wait_until(lambda: coord.owner(sessions[0]).epoch == 3, 10, "one claim per turn")


def test_serving_goes_on_while_redis_is_briefly_stopped(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path) as c:
        router = c.routers[0]
        client = router_client(router)
        spec = session_spec(5, str(llama_dir), "outage", 150)
        want = stream_via(client, spec)[1]

        raw = client.completions.with_raw_response.create(stream=True, **spec)
        text, stopped = "", False
        for chunk in raw.parse():
            text += chunk.choices[0].text if chunk.choices else ""
            if not stopped and len(text) >= 20:
                c.redis.proc.send_signal(signal.SIGSTOP)
                stopped = True
        assert stopped and text == want
        # a new conversation while Redis is still stopped
        late = client.completions.create(
            model=str(llama_dir),
            prompt=prompt_text(3),
            max_tokens=30,
            extra_body={"ignore_eos": True, "session_id": "during-outage"},
        )
        assert len(late.choices[0].text) > 0
        c.redis.proc.send_signal(signal.SIGCONT)

        coord = c.coord

        def caught_up(session: str, n: int) -> bool:
            own = coord.owner(session)
            if own is None or own.state is None:
                return False
            record = json.loads(own.state)
            return record["finished"] and len(record["output_token_ids"]) == n

        wait_until(lambda: caught_up("outage", 150), 30, "replication caught up")
        wait_until(lambda: caught_up("during-outage", 30), 30, "replication caught up")
        workers = c.workers.values()
        assert sum(w.metric("kvserve_replication_errors_total") for w in workers) > 0
        wait_until(
            lambda: sum(w.metric("kvserve_replication_lag_tokens") for w in workers) == 0,
            30,
            "no replication lag left",
        )


def test_router_errors_are_openai_shaped(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path, nodes=("a",)) as c:
        router = c.routers[0]
        req = urllib.request.Request(
            router.url + "/v1/completions", data=b"{not json", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
        assert json.loads(e.value.read())["error"]["type"] == "BadRequestError"
        for path, body, _ in BAD_BODIES:  # the router answers exactly as a worker does
            via_router = post_raw(router.url + path, body)
            direct = post_raw(c.workers["a"].url + path, body)
            assert via_router[0] == 400 and via_router == direct, body
        client = router_client(router)
        with pytest.raises(openai.NotFoundError):  # the worker's 404, relayed
            client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=str(llama_dir), prompt="x", max_tokens=100_000)
        models = client.models.list()
        assert [m.id for m in models.data] == [llama_dir.name]  # no filesystem path
        # a session id a header cannot carry is served, not a 500 (the echo is left out)
        raw = client.completions.with_raw_response.create(
            model=str(llama_dir), prompt="x", max_tokens=2, extra_body={"session_id": "日本"}
        )
        assert raw.status_code == 200 and "x-session-id" not in raw.headers

        c.workers["a"].stop(signal.SIGKILL)  # no worker left: refused, not hung
        wait_until(lambda: not router_view(router)["workers"], 30, "worker gone")
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=str(llama_dir), prompt="x", max_tokens=2)
        assert e.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(router.url + "/ready", timeout=10)
        assert e.value.code == 503


def test_direct_push_warms_the_standby_and_refuses_bad_blocks(llama_dir, tmp_path):
    from helpers import random_prompts

    from kvserve.ha.push import encode_push

    with cluster(llama_dir, tmp_path, worker_args=("--replicate-to", "standby")) as c:
        client = router_client(c.routers[0])
        prompt = random_prompts([40], seed=3)[0]
        raw = client.completions.with_raw_response.create(
            model=str(llama_dir),
            prompt=prompt,
            max_tokens=60,
            extra_body={"ignore_eos": True, "session_id": "pushed", "return_token_ids": True},
        )
        first = raw.parse()
        primary = c.workers[raw.headers["x-kvserve-worker"]]
        standby = c.workers["b" if primary is c.workers["a"] else "a"]
        blocks = (40 + 60 - 1) // 16
        received = 'verdict="accepted"'
        wait_until(
            lambda: standby.metric("kvserve_replication_received_blocks_total", received) >= blocks,
            20,
            "blocks pushed to the standby",
        )
        assert primary.metric("kvserve_replication_pushed_blocks_total") >= blocks
        # … and the verified blocks went on into its device pool, as pre-warmed blocks
        assert standby.metric("kvserve_replication_device_prewarmed_blocks_total") >= blocks

        # a push is authenticated, and a block that is not what the record says is refused
        record = SessionRecord(
            session_id="x",
            tenant="default",
            prompt_token_ids=prompt,
            params=SamplingParams(),
            seed=0,
        )
        header = {"session": "x", "epoch": 1, "record": msgspec.to_builtins(record)}
        bad = encode_push(header, [(0, b"\0" * 64)])
        for headers, status in (({}, 401), ({"X-Kvserve-Cluster-Secret": SECRET}, 200)):
            req = urllib.request.Request(
                standby.url + "/internal/replica", data=bad, headers=headers, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    got, answer = r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                got, answer = e.code, None
            assert got == status
        assert answer == {"accepted": 0, "refused": 1, "device": 0}

        # the primary dies; the next turn finds the history in the standby's device pool
        primary.proc.send_signal(signal.SIGKILL)
        primary.proc.wait(10)
        wait_until(
            lambda: sum(w["routable"] for w in router_view(c.routers[0])["workers"]) == 1,
            30,
            "router dropped the dead worker",
        )
        redis_hits = standby.metric("kvserve_kv_store_hits_total", 'tier="redis"')
        history = first.prompt_token_ids + first.choices[0].token_ids
        raw = client.completions.with_raw_response.create(
            model=str(llama_dir),
            prompt=history + random_prompts([8], seed=4)[0],
            max_tokens=8,
            extra_body={"session_id": "pushed"},
        )
        turn = raw.parse()
        assert c.workers[raw.headers["x-kvserve-worker"]] is standby
        # the whole pushed history was in the device pool already: no copy, no Redis read
        assert turn.usage.prompt_tokens_details.cached_tokens >= blocks * 16
        assert standby.metric("kvserve_kv_store_hits_total", 'tier="redis"') == redis_hits


def test_a_drained_worker_finishes_its_streams_and_gets_no_new_ones(llama_dir, tmp_path):
    with cluster(llama_dir, tmp_path) as c:
        router = c.routers[0]
        client = router_client(router)
        spec = workload_spec(0, str(llama_dir)) | {"max_tokens": 150}
        want = stream_via(client, spec)[1]
        raw = client.completions.with_raw_response.create(stream=True, **spec)
        busy = c.workers[raw.headers["x-kvserve-worker"]]
        other = next(n for n, w in c.workers.items() if w is not busy)

        def drain(on: bool, secret: str = SECRET) -> int:
            req = urllib.request.Request(
                busy.url + "/internal/drain",
                data=json.dumps({"drain": on}).encode(),
                headers={"X-Kvserve-Cluster-Secret": secret},
                method="POST",
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert drain(True, secret="wrong") == 401
        assert drain(True) == 200
        text = "".join(ch.choices[0].text for ch in raw.parse() if ch.choices)
        assert text == want  # the running stream finished where it was
        wait_until(
            lambda: (
                not next(
                    w["routable"] for w in router_view(router)["workers"] if w["url"] == busy.url
                )
            ),
            10,
            "router saw the drain",
        )
        for i in range(4):  # new conversations all go elsewhere
            r = client.completions.with_raw_response.create(
                model=str(llama_dir), prompt=prompt_text(i), max_tokens=4
            )
            r.parse()
            assert r.headers["x-kvserve-worker"] == other
        assert drain(False) == 200
        wait_until(
            lambda: all(w["routable"] for w in router_view(router)["workers"]), 10, "back in"
        )
