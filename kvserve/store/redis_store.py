"""Redis (and Redis Cluster) backend of the ``KVStore`` contract (``redis-py``).

URLs (``RedisStore.from_url``):

- ``redis://[user:pass@]host:port/db`` and ``rediss://…`` (TLS; redis-py's ``ssl_*`` query
  parameters such as ``ssl_ca_certs``/``ssl_cert_reqs`` pass through),
- ``unix:///path/to.sock?db=N``,
- ``redis+cluster://host:port[,host:port…]`` (``rediss+cluster://`` for TLS): Redis Cluster
  through ``redis.cluster.RedisCluster``; the listed nodes are only the startup nodes, the
  rest of the topology is discovered.
- ``redis+sentinel://host:port[,host:port…]/SERVICE[/DB]`` (``rediss+sentinel://``): the
  master Redis Sentinel names for SERVICE, followed across Sentinel failovers
  (``sentinel_client``).

Query parameters understood here (all optional): ``ttl=SECONDS`` (expiry set on every put;
reads do not refresh it), ``prefix=STRING`` (key namespace, default ``kvserve``),
``timeout=SECONDS`` (socket connect and read timeout, default 2.0: the longest one call
waits on a stalled server — timeouts are not retried; except on ``redis+cluster://``,
whose client retries a timed-out command ``retries`` times whatever it is told: there a
stalled node costs up to ``retries + 1`` timeouts), ``retries=N`` (retries after a
connection error, default 1: enough to replace a pooled connection that a server restart
broke, few enough that an unreachable server fails fast — the tiered store then serves
from its other tiers) and, for a cluster, ``hash_tag=TAG`` (below).

Keys: ``{prefix}:{key.hex()}`` on a single server. On a cluster they are
``{prefix}:{{{tag}}}:{key.hex()}``: the hash tag (default: the prefix) puts every key of one
store on one slot, so a batch is one pipeline to one node. The trade-off: one slot per
prefix means *no sharding across the cluster* for that prefix — a single master holds (and
serves) all of it, the cluster only buys failover. ``hash_tag=none`` drops the tag: keys
spread over all slots and masters, and redis-py's cluster pipeline splits each batch into one
round trip per node involved. Use distinct prefixes/tags (e.g. one per model) to spread
several stores over the masters while keeping batches single-node.

Recommended server settings — Redis is a cache here, every value can be recomputed:

- ``maxmemory <size>`` and ``maxmemory-policy allkeys-lru``: eviction is Redis' job; this
  backend never deletes for capacity. With ``noeviction`` a full server rejects writes
  (``OOM command not allowed``), which surfaces as ``StoreUnavailable`` on ``put``.
- No persistence needed: ``save ""`` and ``appendonly no`` (a restart simply starts cold).
- Cluster: every master needs the same ``maxmemory``/policy; mind the hash-tag trade-off
  above (with the default tag one master holds the whole prefix).

Errors: connection errors, timeouts, cluster-down/unreachable-cluster errors and the
server-state errors that mean "cannot serve right now" (``OOM``, ``READONLY``, ``MISCONF``,
``LOADING``, ``MASTERDOWN``, ``TRYAGAIN``) raise ``StoreUnavailable``; other
``ResponseError``s (e.g. ``WRONGTYPE``: another application uses the namespace) are bugs and
propagate.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvserve.store.base import Key, KVStore, StoreUnavailable

DEFAULT_PREFIX = "kvserve"
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_RETRIES = 1

_PLAIN_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_OWN_PARAMS = frozenset({"ttl", "prefix", "timeout", "retries", "hash_tag"})
# query parameters passed on to RedisCluster (strings) for TLS clusters
_CLUSTER_PASSTHROUGH = frozenset(
    {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_ca_path"}
)

_UNAVAILABLE_ERRORS = (
    RedisConnectionError,  # includes BusyLoadingError (LOADING), MaxConnectionsError, auth errors
    RedisTimeoutError,
    ClusterError,  # includes ClusterDownError (CLUSTERDOWN) and MasterDownError (MASTERDOWN)
    RedisClusterException,  # cluster unreachable, slot not covered (not a RedisError!)
    OutOfMemoryError,  # OOM
    ReadOnlyError,  # READONLY: a replica after a failover
    TryAgainError,  # TRYAGAIN: slot migration in progress
)
_UNAVAILABLE_REPLY_PREFIXES = ("OOM", "MISCONF", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN")


@contextlib.contextmanager
def _unavailable_on_error() -> Iterator[None]:
    # redis-py strips the error code of the replies it maps to a class ("OOM command not
    # allowed…" becomes OutOfMemoryError("command not allowed…")), so the class name goes
    # into the message.
    try:
        yield
    except _UNAVAILABLE_ERRORS as e:
        raise StoreUnavailable(f"{type(e).__name__}: {e}") from e
    except ResponseError as e:
        # unmapped codes (MISCONF) stay in the text, after the pipeline's annotation
        # ("Command # 3 (SET …) of pipeline caused error: MISCONF …")
        reply = str(e).rsplit("caused error: ", 1)[-1]
        if reply.startswith(_UNAVAILABLE_REPLY_PREFIXES):
            raise StoreUnavailable(f"{type(e).__name__}: {e}") from e
        raise


def sentinel_client(url: str, timeout: float, retry: Retry | None = None) -> redis.Redis:
    """A client of the master that Redis Sentinel names for
    ``redis+sentinel://[user:pass@]host:port[,host:port…]/SERVICE[/DB][?sentinel_password=…]``
    (``rediss+sentinel://`` for TLS to the master). The hosts are sentinels; the client asks
    them for the current master on every (re)connection, so after a Sentinel failover it
    reconnects to the promoted replica by itself. Credentials in the URL are the master's;
    ``sentinel_password`` (query) authenticates to the sentinels. Other query parameters of
    the KV store URL are read by ``RedisStore.from_url``; unknown ones raise ValueError."""
    from redis.sentinel import Sentinel

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - _OWN_PARAMS - {"sentinel_password"})
    if unknown:
        raise ValueError(f"redis sentinel URL: unknown parameters {unknown}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for h in hosts.split(","):
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis sentinel URL: {h!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("redis sentinel URL: the path must be /SERVICE or /SERVICE/DB")
    sentinel_kwargs: dict[str, object] = dict(
        socket_timeout=timeout, socket_connect_timeout=timeout
    )
    if "sentinel_password" in query:
        sentinel_kwargs["password"] = query["sentinel_password"]
    master_kwargs: dict[str, object] = dict(
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        db=int(path[1]) if len(path) == 2 else 0,
        decode_responses=False,
    )
    if retry is not None:
        master_kwargs["retry"] = retry
    if username:
        master_kwargs["username"] = unquote(username)
    if password:
        master_kwargs["password"] = unquote(password)
    if parts.scheme.lower() == "rediss+sentinel":
        master_kwargs["ssl"] = True
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(path[0], **master_kwargs)


def _positive_float(name: str, value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"redis store URL: {name}={value!r} is not a number") from None
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"redis store URL: {name} must be > 0, got {value!r}")
    return x


class RedisStore(KVStore):
    """Blocks as plain Redis strings (binary values) under ``prefix``; see the module doc."""

    name = "redis"

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl: float | None = None,
        hash_tag: str | None = None,
    ):
        """``client`` must use ``decode_responses=False``. ``hash_tag`` applies to a
        ``RedisCluster`` client only (None: no tag)."""
        if not prefix:
            raise ValueError("redis store: prefix must not be empty")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.prefix = prefix
        self.ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self.hash_tag = hash_tag if self.cluster else None
        if self.cluster:
            self._check_cluster_names(prefix, hash_tag)
        if self.hash_tag is not None:
            self._key_head = f"{prefix}:{{{self.hash_tag}}}:".encode()
        else:
            self._key_head = f"{prefix}:".encode()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_url(cls, url: str) -> RedisStore:
        """A store for ``url`` (see the module docstring for schemes and parameters)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        own: dict[str, str] = {}
        rest: list[tuple[str, str]] = []
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k in _OWN_PARAMS:
                own[k] = v
            else:
                rest.append((k, v))
        ttl = _positive_float("ttl", own["ttl"]) if "ttl" in own else None
        timeout = (
            _positive_float("timeout", own["timeout"]) if "timeout" in own else DEFAULT_TIMEOUT_S
        )
        prefix = own.get("prefix", DEFAULT_PREFIX)
        try:
            retries = int(own.get("retries", DEFAULT_RETRIES))
        except ValueError:
            raise ValueError(f"redis store URL: retries={own['retries']!r}") from None
        if retries < 0:
            raise ValueError("redis store URL: retries must be >= 0")
        # a broken pooled connection is retried; a timeout is not (a stalled server will
        # not answer 10 ms later, and every retry would add a whole timeout to the wait)
        retry = Retry(
            ExponentialBackoff(cap=0.1, base=0.01),
            retries,
            supported_errors=(RedisConnectionError,),
        )
        common = dict(
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=retry,
            decode_responses=False,
        )

        if scheme in _PLAIN_SCHEMES:
            if "hash_tag" in own:
                raise ValueError("redis store URL: hash_tag applies to redis+cluster:// only")
            # not urlunsplit: it turns "unix:///path" into "unix:/path"
            head = url.split("?", 1)[0].split("#", 1)[0]
            client_url = head + (f"?{urlencode(rest)}" if rest else "")
            client = redis.Redis.from_url(client_url, **common)
            return cls(client, prefix=prefix, ttl=ttl)

        if scheme in _CLUSTER_SCHEMES:
            unknown = sorted({k for k, _ in rest} - _CLUSTER_PASSTHROUGH)
            if unknown:
                raise ValueError(f"redis cluster store URL: unknown parameters {unknown}")
            if parts.path not in ("", "/", "/0"):
                raise ValueError("redis cluster store URL: a cluster has only database 0")
            tag_param = own.get("hash_tag", prefix)
            hash_tag = None if tag_param.lower() == "none" else tag_param
            userinfo, _, hosts = parts.netloc.rpartition("@")
            username, _, password = userinfo.partition(":")
            nodes = [_cluster_node(h) for h in hosts.split(",") if h]
            if not nodes:
                raise ValueError("redis cluster store URL: no host:port given")
            kwargs: dict[str, object] = dict(common, **dict(rest))
            if username:
                kwargs["username"] = unquote(username)
            if password:
                kwargs["password"] = unquote(password)
            if scheme == "rediss+cluster":
                kwargs["ssl"] = True
            # validate the naming before connecting (the constructor connects)
            cls._check_cluster_names(prefix, hash_tag)
            with _unavailable_on_error():
                client = RedisCluster(startup_nodes=nodes, **kwargs)
            return cls(client, prefix=prefix, ttl=ttl, hash_tag=hash_tag)

        if scheme in _SENTINEL_SCHEMES:
            if "hash_tag" in own:
                raise ValueError("redis store URL: hash_tag applies to redis+cluster:// only")
            return cls(sentinel_client(url, timeout, retry), prefix=prefix, ttl=ttl)

        raise ValueError(
            f"redis store URL: unsupported scheme {parts.scheme!r} "
            f"(expected one of {_PLAIN_SCHEMES + _CLUSTER_SCHEMES + _SENTINEL_SCHEMES})"
        )

    @staticmethod
    def _check_cluster_names(prefix: str, hash_tag: str | None) -> None:
        for what, s in (("prefix", prefix), ("hash_tag", "x" if hash_tag is None else hash_tag)):
            if not s or "{" in s or "}" in s:
                raise ValueError(f"redis cluster store: {what}={s!r} (non-empty, no braces)")

    # ------------------------------------------------------------------ keys
    def redis_key(self, key: Key) -> bytes:
        """The Redis key that holds ``key``'s value."""
        return self._key_head + key.hex().encode()

    # ------------------------------------------------------------------ KVStore
    def contains(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        with _unavailable_on_error():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.redis_key(k))
            found = pipe.execute()
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    def get(self, keys: Sequence[Key]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self.redis_key(k) for k in keys]
        with _unavailable_on_error():
            if not self.cluster:
                return list(self.client.mget(names))
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return list(pipe.execute())

    def put(self, items: Sequence[tuple[Key, bytes]]) -> None:
        if not items:
            return
        with _unavailable_on_error():
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(self.redis_key(k), v, px=self.ttl_ms)
            pipe.execute()

    def delete(self, keys: Sequence[Key]) -> None:
        if not keys:
            return
        names = [self.redis_key(k) for k in keys]
        with _unavailable_on_error():
            if not self.cluster:
                self.client.unlink(*names)
                return
            pipe = self.client.pipeline(transaction=False)
            for name in names:  # per key: with hash_tag=none the keys span slots
                pipe.unlink(name)
            pipe.execute()

    def close(self) -> None:
        self.client.close()


def _cluster_node(hostport: str) -> ClusterNode:
    if hostport.startswith("["):  # [IPv6]:port or [IPv6]
        host, _, port = hostport[1:].partition("]")
        port = port.removeprefix(":") or "6379"
    else:
        host, sep, port = hostport.rpartition(":")
        if not sep or ":" in host:  # "host" alone, or a bare IPv6 address
            host, port = hostport, "6379"
    try:
        return ClusterNode(host, int(port))
    except ValueError:
        raise ValueError(f"redis cluster store URL: bad node {hostport!r}") from None
