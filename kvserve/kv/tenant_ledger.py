"""Per-tenant KV accounting: which blocks each tenant is charged for, against its budget.

Charging rule: a tenant is charged once for every distinct block its requests hold. A
block shared by requests of one tenant counts once for it; a block shared by two tenants
(a common prefix) counts in full for each. Sharing saves physical memory, not quota, so a
tenant's usage is exactly what it would hold alone and never moves because another tenant
started or stopped sharing with it. Cached-free blocks (held by no request) are charged to
nobody. Consequences the scheduler relies on:

- a tenant's usage grows only when one of its own requests takes a block, so checking the
  limit there is enough for the limit never to be exceeded;
- the pool's used blocks never exceed the sum of the tenants' usages, so when every other
  tenant is within its reservation, a tenant below its own finds free blocks up to it.

Blocks are only ever freed by the pool's reference counts; the ledger just counts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """A tenant's KV budget in blocks of this pool."""

    reservation: int = 0
    limit: int | None = None  # None: the whole pool
    priority: int = 0
    max_concurrent_requests: int | None = None


class TenantLedger:
    """Charged blocks per tenant and the budgets they are checked against."""

    def __init__(self, pool_blocks: int):
        self.pool_blocks = pool_blocks
        self.budgets: dict[str, Budget] = {}
        self._held: dict[str, dict[int, int]] = {}  # tenant → block → references

    def set_budgets(self, budgets: dict[str, Budget]) -> None:
        """Replace every budget (a reload). Current charges stay; a tenant now above its
        new limit cannot take more blocks until it is back under it."""
        self.budgets = dict(budgets)

    def budget(self, tenant: str) -> Budget:
        return self.budgets.get(tenant) or Budget()

    def limit(self, tenant: str) -> int:
        lim = self.budget(tenant).limit
        return self.pool_blocks if lim is None else min(lim, self.pool_blocks)

    def reservation(self, tenant: str) -> int:
        return self.budget(tenant).reservation

    def usage(self, tenant: str) -> int:
        """Distinct blocks charged to ``tenant``."""
        held = self._held.get(tenant)
        return len(held) if held else 0

    def headroom(self, tenant: str) -> int:
        """Blocks ``tenant`` may still take before reaching its limit (may be negative
        after a reload lowered the limit)."""
        return self.limit(tenant) - self.usage(tenant)

    def above_reservation(self, tenant: str) -> bool:
        """Whether the tenant holds more than its reservation (its blocks are fair game)."""
        return self.usage(tenant) > self.reservation(tenant)

    def new_charges(self, tenant: str, blocks: list[int]) -> int:
        """How many of ``blocks`` (distinct) the tenant is not yet charged for."""
        held = self._held.get(tenant, {})
        return sum(1 for b in set(blocks) if b not in held)

    def charge(self, tenant: str, blocks: list[int]) -> None:
        held = self._held.setdefault(tenant, {})
        for b in blocks:
            held[b] = held.get(b, 0) + 1

    def release(self, tenant: str, blocks: list[int]) -> None:
        """Drop one reference per block. Raises ValueError for a block never charged."""
        held = self._held.get(tenant, {})
        for b in blocks:
            n = held.get(b, 0)
            if n <= 0:
                raise ValueError(f"tenant {tenant!r} releases block {b} it was never charged")
            if n == 1:
                del held[b]
            else:
                held[b] = n - 1

    def usages(self) -> dict[str, int]:
        """Charged blocks of every tenant that holds any or has a budget."""
        names = set(self.budgets) | {t for t, h in self._held.items() if h}
        return {t: self.usage(t) for t in sorted(names)}

    def references(self, tenant: str) -> dict[int, int]:
        return dict(self._held.get(tenant, {}))
