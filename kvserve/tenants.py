"""Tenants from a YAML file: who may use the server and how much KV each may hold.

```yaml
default_tenant: public        # requests without an API key; null refuses them (401)
tenants:
  - name: acme
    api_keys: ["sha256:<64 hex>"]   # hashes only: kvserve tenants hash-key KEY
    priority: 10                    # larger = more important
    reservation: 20%                # guaranteed KV: N | "N blocks" | "N tokens" | "4GiB" | "N%"
    limit: 60%                      # most KV it may hold (same units)
    max_concurrent_requests: 32     # optional
    max_waiting_requests: 64        # optional: its queue bound (else --max-waiting-requests)
  - name: public
    limit: 25%
```

Amounts resolve to blocks against a concrete pool (``resolve``): tokens round up to whole
blocks, bytes and percentages round down. The file is rejected with a message naming the
tenant and field when it is malformed, a reservation exceeds its limit, or the
reservations add up to more than the pool.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.kv.tenant_ledger import Budget
from kvserve.utils import cdiv, parse_size

_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_TENANT_FIELDS = {
    "name",
    "api_keys",
    "priority",
    "reservation",
    "limit",
    "max_concurrent_requests",
    "max_waiting_requests",
}


def hash_key(key: str) -> str:
    """The stored form of an API key."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Amount:
    """A KV amount as written: ``value`` in ``unit`` (blocks | tokens | bytes | percent)."""

    value: float
    unit: str

    @classmethod
    def parse(cls, raw: Any, where: str) -> Amount:
        if isinstance(raw, bool):
            raise ValueError(f"{where}: expected an amount, got {raw!r}")
        if isinstance(raw, int | float):
            if raw < 0:
                raise ValueError(f"{where}: must be non-negative, got {raw}")
            return cls(float(raw), "blocks")
        text = str(raw).strip()
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
        if m:
            pct = float(m[1])
            if pct > 100:
                raise ValueError(f"{where}: {text} is more than the pool")
            return cls(pct, "percent")
        m = re.fullmatch(r"(\d+)\s*(blocks?|tokens?)", text)
        if m:
            return cls(float(m[1]), "blocks" if m[2].startswith("block") else "tokens")
        try:
            return cls(float(parse_size(text)), "bytes")
        except ValueError:
            raise ValueError(
                f"{where}: {text!r} is not an amount (N, 'N blocks', 'N tokens', '4GiB', 'N%')"
            ) from None

    def blocks(self, pool_blocks: int, block_size: int, bytes_per_block: int) -> int:
        if self.unit == "blocks":
            return int(self.value)
        if self.unit == "tokens":
            return cdiv(int(self.value), block_size)
        if self.unit == "bytes":
            return int(self.value) // bytes_per_block
        return int(pool_blocks * self.value / 100)


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key_hashes: tuple[str, ...] = ()
    priority: int = 0
    reservation: Amount = Amount(0, "blocks")
    limit: Amount = Amount(100, "percent")
    max_concurrent_requests: int | None = None
    max_waiting_requests: int | None = None  # None: the server's --max-waiting-requests


@dataclass(frozen=True)
class TenantBudget:
    """A tenant's amounts in blocks of one concrete pool."""

    tenant: Tenant
    reservation_blocks: int
    limit_blocks: int


@dataclass(frozen=True)
class TenantsConfig:
    tenants: tuple[Tenant, ...]
    default_tenant: str | None
    source: str = "<config>"

    @classmethod
    def load(cls, path: str | Path) -> TenantsConfig:
        """Parse and check a tenants file (not yet against a pool: see ``resolve``)."""
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{path}: cannot read tenants ({e})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<config>") -> TenantsConfig:
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
            raise ValueError(f"{source}: expected a mapping with a 'tenants' list")
        unknown = set(data) - {"tenants", "default_tenant"}
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {sorted(unknown)}")
        tenants: list[Tenant] = []
        seen_keys: dict[str, str] = {}
        for i, raw in enumerate(data["tenants"]):
            where = f"{source}: tenants[{i}]"
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
                raise ValueError(f"{where}: each tenant needs a non-empty 'name'")
            where = f"{source}: tenant {raw['name']!r}"
            bad = set(raw) - _TENANT_FIELDS
            if bad:
                raise ValueError(f"{where}: unknown field(s) {sorted(bad)}")
            if any(t.name == raw["name"] for t in tenants):
                raise ValueError(f"{where}: defined twice")
            keys = tuple(raw.get("api_keys") or ())
            for k in keys:
                if not isinstance(k, str) or not _HASH.fullmatch(k):
                    raise ValueError(
                        f"{where}: api_keys must be hashes 'sha256:<64 hex>' "
                        "(kvserve tenants hash-key KEY), not keys"
                    )
                if k in seen_keys:
                    raise ValueError(f"{where}: an API key is also {seen_keys[k]!r}'s")
                seen_keys[k] = raw["name"]
            priority = raw.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise ValueError(f"{where}: priority must be an integer")
            counts = {}
            for name in ("max_concurrent_requests", "max_waiting_requests"):
                n = raw.get(name)
                if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                    raise ValueError(f"{where}: {name} must be a positive integer")
                counts[name] = n
            tenants.append(
                Tenant(
                    raw["name"],
                    keys,
                    priority,
                    Amount.parse(raw.get("reservation", 0), f"{where}: reservation"),
                    Amount.parse(raw.get("limit", "100%"), f"{where}: limit"),
                    counts["max_concurrent_requests"],
                    counts["max_waiting_requests"],
                )
            )
        default = data.get("default_tenant")
        if default is not None and not any(t.name == default for t in tenants):
            raise ValueError(f"{source}: default_tenant {default!r} is not a defined tenant")
        return cls(tuple(tenants), default, source)

    def resolve(
        self, pool_blocks: int, block_size: int, bytes_per_block: int
    ) -> dict[str, TenantBudget]:
        """Amounts in blocks of this pool. Raises ValueError when a reservation exceeds its
        limit or the reservations exceed the pool."""
        out = {}
        for t in self.tenants:
            res = t.reservation.blocks(pool_blocks, block_size, bytes_per_block)
            lim = min(t.limit.blocks(pool_blocks, block_size, bytes_per_block), pool_blocks)
            if res > lim:
                raise ValueError(
                    f"{self.source}: tenant {t.name!r}: reservation ({res} blocks) "
                    f"exceeds its limit ({lim} blocks)"
                )
            out[t.name] = TenantBudget(t, res, lim)
        total = sum(b.reservation_blocks for b in out.values())
        if total > pool_blocks:
            raise ValueError(
                f"{self.source}: reservations add up to {total} blocks but the KV pool has "
                f"{pool_blocks}; lower them or give the engine more KV memory"
            )
        return out

    def budgets(self, pool_blocks: int, block_size: int, bytes_per_block: int) -> dict[str, Budget]:
        """``resolve``d into the scheduler's budgets (same errors)."""
        return {
            name: Budget(
                b.reservation_blocks,
                b.limit_blocks,
                b.tenant.priority,
                b.tenant.max_concurrent_requests,
            )
            for name, b in self.resolve(pool_blocks, block_size, bytes_per_block).items()
        }

    def queue_bound(self, tenant: str, default: int) -> int:
        """``tenant``'s queue bound: its ``max_waiting_requests``, else ``default``."""
        t = next((t for t in self.tenants if t.name == tenant), None)
        return default if t is None or t.max_waiting_requests is None else t.max_waiting_requests

    def total_queue_bound(self, default: int) -> int:
        """The sum of every tenant's queue bound (what the engine may hold waiting)."""
        return sum(self.queue_bound(t.name, default) for t in self.tenants)

    def tenant_for_key(self, key: str | None) -> str | None:
        """The tenant owning API key ``key`` (compared as hashes, in constant time), the
        default tenant for no key, or None (refuse)."""
        if key is None:
            return self.default_tenant
        h = hash_key(key)
        for t in self.tenants:
            if any(hmac.compare_digest(h, k) for k in t.api_key_hashes):
                return t.name
        return None
