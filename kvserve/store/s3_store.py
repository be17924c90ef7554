"""S3 (and S3-compatible: MinIO, Ceph RGW, …) backend of the ``KVStore`` contract (boto3).

URL (``S3Store.from_url``)::

    s3://BUCKET[/PREFIX]?endpoint_url=http://127.0.0.1:9000&region=us-east-1

One object per block, named ``{PREFIX}/{key.hex()}`` (PREFIX defaults to ``kvserve``).
Query parameters (all optional): ``endpoint_url`` (an S3-compatible server; path-style
addressing is then used unless ``addressing_style=virtual``), ``region``, ``timeout=SECONDS``
(connect and read timeout, default 5.0; also the longest one window of ``workers``
parallel requests waits, retries included: a stalled server costs one call that long),
``retries=N`` (botocore "standard" retries after the first attempt, default 1: an
unreachable store must fail fast, the tiered store then serves from its other tiers) and
``workers=N`` (parallel requests per batch, default 8).

Credentials come from the environment the way boto3 finds them (``AWS_ACCESS_KEY_ID``…,
profiles, instance roles). The bucket must exist.

Batches: S3 has no multi-get, so ``contains`` HEADs up to ``workers`` objects at a time
and stops after the first window with a miss (it still returns the *leading* count),
``get``/``put`` GET/PUT in parallel, ``delete`` uses ``DeleteObjects`` (1000 keys a call).

Eviction is not this backend's job: use a bucket lifecycle rule that expires objects under
the prefix after some days (S3 has no LRU). Grant ``s3:ListBucket`` too: without it S3
answers 403 instead of 404 for a missing object.

Errors: connection errors, timeouts, 5xx replies and throttling (``SlowDown``…) raise
``StoreUnavailable``; other client errors (403, ``NoSuchBucket``: configuration mistakes)
propagate as botocore's ``ClientError``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from kvserve.store.base import Key, KVStore, StoreUnavailable

DEFAULT_PREFIX = "kvserve"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRIES = 1
DEFAULT_WORKERS = 8
DELETE_CHUNK = 1000  # the DeleteObjects limit

_PARAMS = frozenset({"endpoint_url", "region", "timeout", "retries", "workers", "addressing_style"})
_MISS_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_BUSY_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable"}
)


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _is_miss(e: ClientError) -> bool:
    # HEAD replies carry no body: a missing object is just code "404"
    return _code(e) in _MISS_CODES or (_status(e) == 404 and _code(e) != "NoSuchBucket")


@contextlib.contextmanager
def _unavailable_on_error() -> Iterator[None]:
    try:
        yield
    except (BotoConnectionError, HTTPClientError) as e:  # refused, DNS, timeouts, resets
        raise StoreUnavailable(f"{type(e).__name__}: {e}") from e
    except ClientError as e:
        if _status(e) >= 500 or _code(e) in _BUSY_CODES:
            raise StoreUnavailable(f"{type(e).__name__}: {e}") from e
        raise


class S3Store(KVStore):
    """One object per block under ``bucket/prefix``; see the module docstring."""

    name = "s3"

    def __init__(
        self,
        client,
        bucket: str,
        prefix: str = DEFAULT_PREFIX,
        workers: int = DEFAULT_WORKERS,
        deadline: float | None = None,
    ):
        """``client``: a boto3 S3 client (thread-safe; used from ``workers`` threads).
        ``deadline``: the longest each window of ``workers`` requests may take (seconds;
        None: as long as botocore's timeouts and retries take) — past it the call raises
        ``StoreUnavailable`` while those requests finish in the background."""
        if not bucket:
            raise ValueError("s3 store: bucket must not be empty")
        if workers < 1:
            raise ValueError("s3 store: workers must be >= 1")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.workers = workers
        self.deadline = deadline
        self.delete_chunk = DELETE_CHUNK
        # reads and writes in pools of their own, so neither queues behind the other;
        # a pool whose window timed out is replaced (its stuck requests finish in the
        # background, within botocore's timeouts) so the next call does not queue behind
        # them either
        self._pools = {
            kind: ThreadPoolExecutor(workers, thread_name_prefix=f"kvserve-s3-{kind}")
            for kind in ("read", "write")
        }
        self._pools_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        """A store for ``s3://bucket/prefix?endpoint_url=…&region=…`` (see module doc)."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "s3":
            raise ValueError(f"s3 store URL: scheme must be s3://, got {url!r}")
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(params) - _PARAMS)
        if unknown:
            raise ValueError(f"s3 store URL: unknown parameters {unknown}")
        timeout = _number(params, "timeout", DEFAULT_TIMEOUT_S, float, minimum=0.0, strict=True)
        retries = _number(params, "retries", DEFAULT_RETRIES, int, minimum=0)
        workers = _number(params, "workers", DEFAULT_WORKERS, int, minimum=1)
        endpoint_url = params.get("endpoint_url") or None
        style = params.get("addressing_style", "path" if endpoint_url else "auto")
        if style not in ("auto", "path", "virtual"):
            raise ValueError(f"s3 store URL: addressing_style={style!r}")
        config = Config(
            connect_timeout=timeout,
            read_timeout=timeout,
            # botocore's "max_attempts" counts retries only; "total_max_attempts" all tries
            retries={"total_max_attempts": retries + 1, "mode": "standard"},
            max_pool_connections=max(10, workers),
            s3={"addressing_style": style},
            # boto3 >= 1.36 sends CRC checksums by default, which many S3-compatible
            # servers reject; only send/validate them where the API requires it
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=params.get("region") or None,
            config=config,
        )
        prefix = parts.path.strip("/") or DEFAULT_PREFIX
        return cls(client, parts.netloc, prefix, workers, deadline=timeout)

    def object_key(self, key: Key) -> str:
        """The object name that holds ``key``'s value."""
        return f"{self.prefix}/{key.hex()}" if self.prefix else key.hex()

    # ------------------------------------------------------------------ one object
    def _head(self, key: Key) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as e:
            if _is_miss(e):
                return False
            raise
        return True

    def _get(self, key: Key) -> bytes | None:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as e:
            if _is_miss(e):
                return None
            raise
        with contextlib.closing(reply["Body"]) as body:
            return body.read()

    def _put(self, item: tuple[Key, bytes]) -> None:
        key, value = item
        self.client.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=value)

    # ------------------------------------------------------------------ KVStore
    def _map(self, kind: str, fn: Callable[[Any], Any], items: Sequence[Any]) -> list:
        """``fn`` over ``items`` on the ``kind`` pool, ``workers`` at a time; each window's
        results within ``deadline`` or StoreUnavailable (its requests still running finish
        in the background) — a stalled server costs one call one deadline, a large healthy
        transfer is not cut short."""
        out: list = []
        for start in range(0, len(items), self.workers):
            window = items[start : start + self.workers]
            pool = self._pools[kind]
            try:
                out += pool.map(fn, window, timeout=self.deadline)
            except TimeoutError:
                self._replace(kind, pool)
                raise StoreUnavailable(f"S3 did not answer within {self.deadline} s") from None
            except RuntimeError:  # the pool was replaced under this call (by another)
                raise StoreUnavailable("S3 requests timed out meanwhile") from None
        return out

    def _replace(self, kind: str, stuck: ThreadPoolExecutor) -> None:
        """A fresh ``kind`` pool instead of ``stuck`` (unless another call replaced it)."""
        with self._pools_lock:
            if self._pools[kind] is stuck:
                self._pools[kind] = ThreadPoolExecutor(
                    self.workers, thread_name_prefix=f"kvserve-s3-{kind}"
                )
        stuck.shutdown(wait=False, cancel_futures=True)

    def contains(self, keys: Sequence[Key]) -> int:
        n = 0
        with _unavailable_on_error():
            for start in range(0, len(keys), self.workers):
                for hit in self._map("read", self._head, keys[start : start + self.workers]):
                    if not hit:
                        return n
                    n += 1
        return n

    def get(self, keys: Sequence[Key]) -> list[bytes | None]:
        with _unavailable_on_error():
            return self._map("read", self._get, keys)

    def put(self, items: Sequence[tuple[Key, bytes]]) -> None:
        with _unavailable_on_error():
            self._map("write", self._put, items)

    def delete(self, keys: Sequence[Key]) -> None:
        with _unavailable_on_error():
            for start in range(0, len(keys), self.delete_chunk):
                chunk = keys[start : start + self.delete_chunk]
                reply = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self.object_key(k)} for k in chunk], "Quiet": True},
                )
                errors = reply.get("Errors") or []
                if errors:  # absent keys are not errors in S3: these are real failures
                    first = errors[0]
                    raise StoreUnavailable(
                        f"DeleteObjects: {len(errors)} failed, first {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message')}"
                    )

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self.client.close()


def _number(params: dict[str, str], name: str, default, kind, *, minimum, strict=False):
    if name not in params:
        return default
    try:
        value = kind(params[name])
    except ValueError:
        raise ValueError(f"s3 store URL: {name}={params[name]!r} is not a number") from None
    if not value >= minimum or (strict and value == minimum) or not math.isfinite(value):
        raise ValueError(f"s3 store URL: {name}={params[name]!r} is out of range")
    return value
