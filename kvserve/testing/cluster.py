"""A real cluster on loopback for HA tests: one ``redis-server`` (coordinator and shared KV
tier), ``kvserve serve`` workers and ``kvserve router`` processes. Every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.ha.coordination import Coordinator
from kvserve.testing.procs import ServerProcess, wait_until
from kvserve.testing.redis_procs import RedisServer, redis_server

SECRET = "cluster-s3cret"


@dataclass
class Cluster:
    redis: RedisServer | None
    url: str
    model: Path
    tmp: Path
    workers: dict[str, ServerProcess] = field(default_factory=dict)
    routers: list[ServerProcess] = field(default_factory=list)
    router_args: tuple[str, ...] = ()

    @property
    def coord(self) -> Coordinator:
        return Coordinator.from_url(self.url)

    def add_router(self, *extra: str) -> ServerProcess:
        """Start one more router (``router_args``, then ``extra``) and wait until it is
        ready (routes to at least one worker)."""
        n = len(self.routers)
        r = ServerProcess(
            None,
            "--cluster", self.url, "--cluster-secret", SECRET, *self.router_args, *extra,
            log=self.tmp / f"router{n}.log", command="router",
        )  # fmt: skip
        self.routers.append(r)
        r.wait_ready(60)
        return r


def router_view(router: ServerProcess) -> dict:
    with urllib.request.urlopen(router.url + "/router/workers", timeout=5) as r:
        return json.loads(r.read())


def _print_logs(tmp: Path, tail: int = 60) -> None:
    """The last ``tail`` lines of each process log under ``tmp`` (routers', workers')."""
    for log in sorted(tmp.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-tail:]
        print(f"----- {log.name} (last {len(lines)} lines)", *lines, sep="\n")


@contextlib.contextmanager
def cluster(
    model: Path,
    tmp: Path,
    nodes=("a", "b"),
    routers: int = 1,
    redis_url: str | None = None,
    worker_args: tuple[str, ...] = (),
    router_args: tuple[str, ...] = (),
    node_args: dict[str, tuple[str, ...]] | None = None,
) -> Iterator[Cluster]:
    """Workers ``nodes`` and ``routers`` routers on a fresh ``redis-server`` (or on
    ``redis_url``: then ``Cluster.redis`` is None); ``worker_args`` / ``router_args``
    come after the defaults (and override them), ``node_args[node]`` after those."""
    with contextlib.ExitStack() as stack:
        server = None if redis_url else stack.enter_context(redis_server(tmp))
        url = redis_url or f"redis://127.0.0.1:{server.port}/0"
        c = Cluster(server, url, model, tmp, router_args=router_args)
        args = (
            "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--cluster", url,
            "--kv-store", url, "--cluster-secret", SECRET, "--replicate-every", "16",
            "--dtype", "bfloat16",  # the serving default: exactness must hold in bf16
            *worker_args,
        )  # fmt: skip
        try:
            for n in nodes:
                extra = (node_args or {}).get(n, ())
                c.workers[n] = ServerProcess(
                    model, *args, *extra, "--node-id", n, log=tmp / f"{n}.log"
                )
            for w in c.workers.values():
                w.wait_ready()
            coord = c.coord
            wait_until(lambda: set(coord.nodes()) == set(nodes), 30, "workers registered")
            for _ in range(routers):
                r = c.add_router()
                wait_until(
                    lambda r=r: sum(w["routable"] for w in router_view(r)["workers"]) == len(nodes),
                    30,
                    "router sees every worker",
                )
            yield c
        except BaseException:
            _print_logs(tmp)  # pytest shows them with the failure: the only trace of a flake
            raise
        finally:
            for p in [*c.routers, *c.workers.values()]:
                if p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGCONT)  # a test may have stopped it
                p.stop(signal.SIGKILL)
