"""The cluster on Redis Sentinel (issue 8): workers, router, coordinator and the shared KV
tier all reach Redis through ``redis+sentinel://``. The master is killed while serving;
Sentinel promotes the replica; serving goes on and a worker killed afterwards is still
failed over exactly (its session state now lives on the promoted master)."""

from __future__ import annotations

import json
import signal
import threading

import openai
import redis
from router_client import router_client, session_spec, stream_via

from kvserve.testing.cluster import cluster
from kvserve.testing.procs import wait_until
from kvserve.testing.redis_procs import redis_sentinel


def test_serving_survives_a_sentinel_failover_of_redis(llama_dir, tmp_path):
    (tmp_path / "redis").mkdir()
    with (
        redis_sentinel(tmp_path / "redis") as sentinel,
        cluster(llama_dir, tmp_path, redis_url=sentinel.url) as c,
    ):
        client = router_client(c.routers[0])
        spec = session_spec(3, str(llama_dir), "reference", 150)  # chat, seeded sampling
        want = stream_via(client, spec)[1]

        # Redis' master dies while a stream is under way
        progress, result = [0], {}
        spec["extra_body"]["session_id"] = "during"
        t = threading.Thread(target=lambda: result.update(r=stream_via(client, spec, progress)))
        t.start()
        wait_until(lambda: progress[0] >= 5, 30, "stream under way")
        old_master = sentinel.master_port()
        sentinel.master.kill()
        t.join(60)
        assert result["r"][1] == want
        wait_until(lambda: sentinel.master_port() != old_master, 30, "Sentinel promoted")
        assert sentinel.master_port() == sentinel.replica.port

        coord = c.coord

        def owner(session: str):  # Sentinel may still be settling: retry, bounded
            try:
                return coord.owner(session)
            except redis.RedisError:
                return None

        def finished(session: str) -> bool:  # its last record (published asynchronously)
            own = owner(session)
            return own is not None and own.state is not None and json.loads(own.state)["finished"]

        # Workers write through the promoted master before the next stream starts: had its
        # claim waited on Sentinel, the stream could end before its worker is killed (then
        # nothing fails over, and a final record still in the publisher's retry is lost).
        wait_until(lambda: finished("during"), 30, "the first stream's final record")

        # on the promoted master: a stream whose worker is killed mid-way fails over exactly
        spec["extra_body"]["session_id"] = "after"
        progress, result = [0], {}
        t = threading.Thread(target=lambda: result.update(r=stream_via(client, spec, progress)))
        t.start()
        wait_until(lambda: owner("after") is not None, 30, "session claimed")
        wait_until(lambda: progress[0] >= 20, 60, "stream under way")
        primary = owner("after").node
        c.workers[primary].proc.send_signal(signal.SIGKILL)
        t.join(60)
        worker, text = result["r"]
        assert worker == primary and text == want

        wait_until(lambda: finished("after"), 10, "the standby's final record")
        assert owner("after").node != primary
        with sentinel.replica.client() as r:  # the state is on the promoted master
            assert r.exists("kvserve:ha:session:after")
        assert isinstance(client, openai.OpenAI)
