"""Build stores from URLs (``--kv-store URL``, repeatable, fastest tier first).

- ``host://?capacity=8GiB``: in-process LRU (``HostStore``);
- ``file:///var/cache/kvserve?capacity=100GiB``: on-disk LRU (``FileStore``);
- ``redis://host:6379/0?ttl=3600&prefix=kvserve``, ``rediss://…``,
  ``unix:///run/redis.sock``, ``redis+cluster://h1:7000,h2:7001``,
  ``redis+sentinel://s1:26379,s2:26379/mymaster``: Redis (``RedisStore``);
- ``s3://bucket/prefix?endpoint_url=http://minio:9000``: S3-compatible object storage
  (``S3Store``).

Without a ``host://`` URL first, a ``host://?capacity=1GiB`` tier is put in front: the
first tier is where writes land synchronously and what the other tiers promote into.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

from kvserve.kv.events import KVEventLog
from kvserve.store.base import KVStore
from kvserve.store.file_store import FileStore
from kvserve.store.host import HostStore
from kvserve.store.tiered import TieredStore
from kvserve.utils import parse_size

DEFAULT_HOST_CAPACITY = "1GiB"
_REDIS_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+cluster",
    "rediss+cluster",
    "redis+sentinel",
    "rediss+sentinel",
)


def _query(url: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items()}


def with_namespace(url: str, namespace: str | None) -> str:
    """``url`` with a default key prefix naming what the blocks are (model fingerprint, KV
    dtype, block size), for shared tiers that do not set their own: Redis
    ``prefix=kvserve:<namespace>``, S3 path ``kvserve/<namespace>``. The keys are
    already hashes rooted in the same facts; the prefix lets an operator see and drop one
    model's blocks (``SCAN``/``UNLINK``, an S3 lifecycle rule) without touching others."""
    if not namespace:
        return url
    parts = urlsplit(url)
    if parts.scheme in _REDIS_SCHEMES and "prefix" not in _query(url):
        query = "&".join(q for q in (parts.query, "prefix=" + quote(f"kvserve:{namespace}")) if q)
        if parts.scheme == "unix":  # urlunsplit would drop the empty authority
            return f"unix://{parts.path}?{query}"
        return urlunsplit(parts._replace(query=query))
    if parts.scheme == "s3" and not parts.path.strip("/"):
        return urlunsplit(parts._replace(path=f"/kvserve/{namespace}"))
    return url


def open_store(url: str, events: KVEventLog | None = None) -> KVStore:
    """One tier from its URL (a host tier logs its keys to ``events``). Raises ValueError
    for an unknown scheme or bad parameters."""
    parts = urlsplit(url)
    q = _query(url)
    scheme = parts.scheme
    if scheme == "host":
        return HostStore(parse_size(q.get("capacity", DEFAULT_HOST_CAPACITY)), events=events)
    if scheme == "file":
        if not parts.path:
            raise ValueError(f"{url}: file:// needs a directory path (file:///var/cache/kv)")
        if "capacity" not in q:
            raise ValueError(f"{url}: file:// needs ?capacity= (e.g. 100GiB)")
        return FileStore(parts.path, parse_size(q["capacity"]))
    if scheme in _REDIS_SCHEMES:
        from kvserve.store.redis_store import RedisStore

        return RedisStore.from_url(url)
    if scheme == "s3":
        from kvserve.store.s3_store import S3Store

        return S3Store.from_url(url)
    raise ValueError(
        f"{url}: unknown KV store scheme {scheme!r}; use host://, file://, redis://, "
        "rediss://, unix://, redis+cluster://, redis+sentinel:// or s3://"
    )


def open_tiered(
    urls: Sequence[str],
    *,
    write_policy: str = "write-through",
    queue_size: int = 1024,
    namespace: str | None = None,
    events: KVEventLog | None = None,
) -> TieredStore:
    """The tiered store for ``urls`` in order (a host tier is added in front if missing;
    shared tiers get ``namespace`` as their default key prefix, see ``with_namespace``)."""
    urls = list(urls)
    if not urls or urlsplit(urls[0]).scheme != "host":
        urls.insert(0, f"host://?capacity={DEFAULT_HOST_CAPACITY}")
    if any(urlsplit(u).scheme == "host" for u in urls[1:]):
        raise ValueError("host:// can only be the first tier")
    return TieredStore(
        [open_store(with_namespace(u, namespace), events) for u in urls],
        write_policy=write_policy,
        queue_size=queue_size,
    )
