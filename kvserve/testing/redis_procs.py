"""Real ``redis-server`` processes for tests: one server (TCP or unix socket) that can be
killed and restarted on its port, and a 3-master Redis Cluster. Every wait is bounded; a
missing binary fails the test (``apt-get install redis-server``), never skips it."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvserve.testing.procs import free_port, kill_process, stop_process, wait_until

READY_TIMEOUT_S = 20.0
CLUSTER_TIMEOUT_S = 40.0


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open while choosing)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install it with `apt-get install redis-server`")
    return path


def _raw(port: int | None = None, unix: Path | None = None, db: int = 0) -> redis.Redis:
    kw: dict = dict(db=db, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))
    if unix is not None:
        return redis.Redis(unix_socket_path=str(unix), **kw)
    return redis.Redis(host="127.0.0.1", port=port, **kw)


class RedisServer:
    """One ``redis-server`` subprocess (TCP on loopback, or a unix socket with ``port=0``)."""

    def __init__(
        self, workdir: Path, *args: str, port: int | None = None, unix: Path | None = None
    ):
        self.workdir = workdir
        self.args = args
        self.unix = unix
        self.port = 0 if unix is not None else port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"redis-{uuid.uuid4().hex[:8]}.log"
        self.start()

    def start(self) -> None:
        """Start (again, on the same port) and wait until it answers PING."""
        cmd = [
            _binary("redis-server"),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
            *self.args,
        ]
        if self.unix is not None:
            cmd += ["--unixsocket", str(self.unix), "--unixsocketperm", "700"]
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        client = self.client()
        try:
            wait_until(self._ready(client), READY_TIMEOUT_S, f"redis-server ready ({self.log})")
        finally:
            client.close()

    def _ready(self, client: redis.Redis) -> Callable[[], bool]:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited:\n{self.log.read_text()[-3000:]}")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        return ready

    def client(self, db: int = 0) -> redis.Redis:
        return _raw(self.port, self.unix, db)

    def kill(self) -> None:
        kill_process(self.proc)

    def stop(self) -> None:
        stop_process(self.proc)


@contextlib.contextmanager
def redis_server(
    workdir: Path, *args: str, port: int | None = None, unix: Path | None = None
) -> Iterator[RedisServer]:
    server = RedisServer(workdir, *args, port=port, unix=unix)
    try:
        yield server
    finally:
        server.stop()


class Cluster:
    def __init__(self, nodes: list[RedisServer]):
        self.nodes = nodes
        self.ports = [n.port for n in nodes]

    def url(self, query: str = "") -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])  # 2 of 3 as startup nodes
        return f"redis+cluster://{hosts}" + (f"?{query}" if query else "")

    def raw(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=2)

    def flushall(self) -> None:
        for node in self.nodes:
            with contextlib.closing(node.client()) as c:
                c.flushall()

    def dbsizes(self) -> list[int]:
        sizes = []
        for node in self.nodes:
            with contextlib.closing(node.client()) as c:
                sizes.append(c.dbsize())
        return sizes


def _cluster_ok(nodes: list[RedisServer]) -> bool:
    for node in nodes:
        with contextlib.closing(node.client()) as c:
            try:
                if c.execute_command("CLUSTER", "INFO").find(b"cluster_state:ok") < 0:
                    return False
            except redis.RedisError:
                return False
    return True


@contextlib.contextmanager
def redis_cluster(workdir: Path) -> Iterator[Cluster]:
    """Three masters on loopback, created with redis-cli, ready (cluster_state:ok)."""
    ports = free_ports(6)  # 3 client ports, 3 cluster bus ports
    with contextlib.ExitStack() as stack:
        nodes = []
        for i in range(3):
            node_dir = workdir / f"n{i}"
            node_dir.mkdir()
            node = stack.enter_context(
                redis_server(
                    node_dir,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(node_dir / f"nodes-{i}.conf"),
                    # explicit bus port: the default (port + 10000) may be taken or > 65535
                    "--cluster-port",
                    str(ports[3 + i]),
                    "--cluster-node-timeout",
                    "5000",
                    port=ports[i],
                )
            )
            nodes.append(node)
        create = subprocess.run(
            [
                _binary("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=CLUSTER_TIMEOUT_S,
        )
        assert create.returncode == 0, create.stdout + create.stderr
        wait_until(lambda: _cluster_ok(nodes), CLUSTER_TIMEOUT_S, "cluster_state:ok on all nodes")
        yield Cluster(nodes)


class Sentinel:
    """A master, its replica and one Sentinel (quorum 1) watching them as ``mymaster``."""

    SERVICE = "mymaster"

    def __init__(self, master: RedisServer, replica: RedisServer, port: int):
        self.master, self.replica, self.port = master, replica, port

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.SERVICE}"

    def client(self) -> redis.Redis:
        return _raw(self.port)

    def master_port(self) -> int:
        with contextlib.closing(self.client()) as c:
            _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
        return int(port)

    def knows_replica(self) -> bool:
        with contextlib.closing(self.client()) as c:
            try:
                replicas = c.execute_command("SENTINEL", "REPLICAS", self.SERVICE)
            except redis.RedisError:
                return False
        for r in replicas:
            info = dict(zip(r[::2], r[1::2], strict=False)) if isinstance(r, list) else r
            port = info.get(b"port") or info.get("port")
            flags = info.get(b"flags") or info.get("flags") or b""
            flags = flags.decode() if isinstance(flags, bytes) else flags
            if int(port) == self.replica.port and "down" not in flags:
                return True
        return False


def _in_sync(replica: RedisServer) -> bool:
    with contextlib.closing(replica.client()) as c:
        return c.info("replication").get("master_link_status") == "up"


@contextlib.contextmanager
def redis_sentinel(workdir: Path) -> Iterator[Sentinel]:
    """A replicated master watched by a Sentinel that fails over within ~1 s of the
    master going down (``down-after-milliseconds 500``)."""
    with contextlib.ExitStack() as stack:
        mdir, rdir = workdir / "master", workdir / "replica"
        mdir.mkdir()
        rdir.mkdir()
        master = stack.enter_context(redis_server(mdir, "--repl-diskless-sync-delay", "0"))
        replica = stack.enter_context(
            redis_server(rdir, "--replicaof", "127.0.0.1", str(master.port))
        )
        wait_until(lambda: _in_sync(replica), READY_TIMEOUT_S, "replica in sync")
        port = free_port()
        conf = workdir / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
            f"sentinel monitor {Sentinel.SERVICE} 127.0.0.1 {master.port} 1\n"
            f"sentinel down-after-milliseconds {Sentinel.SERVICE} 500\n"
            f"sentinel failover-timeout {Sentinel.SERVICE} 5000\n"
        )
        log = (workdir / "sentinel.log").open("w")
        stack.callback(log.close)
        proc = subprocess.Popen(
            [_binary("redis-server"), str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
        )
        stack.callback(kill_process, proc)
        s = Sentinel(master, replica, port)

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError((workdir / "sentinel.log").read_text()[-2000:])
            try:
                return s.knows_replica()
            except redis.RedisError:
                return False

        wait_until(ready, CLUSTER_TIMEOUT_S, "sentinel sees the replica")
        yield s
