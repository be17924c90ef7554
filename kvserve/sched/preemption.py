"""Who gets preempted, and how (swap or recompute).

Victim order (the first in this order goes first):

1. requests of tenants holding more than their reservation (a tenant within its
   reservation is only ever preempted by its own requests);
2. the lower priority class (tenant priority, then request priority);
3. among equals, ``victim="cost"``: the lowest restore cost per block it would free (a
   request whose blocks are all shared frees nothing and goes last);
   ``victim="latest"``: vLLM's rule, skip this step;
4. the latest arrival.

Mode per victim: ``recompute`` always re-prefills; ``swap`` copies the blocks to the host
swap space while it has room and recomputes otherwise; ``auto`` takes whichever the cost
model says is cheaper for this victim (swap only while it fits). A recompute's estimate
leaves out the leading blocks other running requests share with the victim (prefix
caching hands them back), so a victim that is mostly a shared system prompt is recomputed
rather than copied out and back as private, no longer shared blocks.
"""

from __future__ import annotations

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.swap import SwapSpace
from kvserve.request import Request
from kvserve.sched.cost import PreemptionCostModel


class PreemptionPolicy:
    def __init__(
        self,
        kv: KVCacheManager,
        cost: PreemptionCostModel,
        swap: SwapSpace | None,
        mode: str = "auto",
        victim: str = "cost",
    ):
        self.kv = kv
        self.cost = cost
        self.swap = swap
        self.mode = mode
        self.victim = victim

    def _estimates(self, req: Request) -> tuple[float | None, float]:
        """(swap seconds if the swap space can take it now, recompute seconds)."""
        live = self.kv.num_live_blocks(req.request_id)
        swap = None
        if self.swap is not None and self.swap.can_hold(live):
            swap = self.cost.swap_seconds(live, self.kv.block_size)
        shared = self.kv.num_shared_prefix_blocks(req.request_id) * self.kv.block_size
        return swap, self.cost.recompute_seconds(req.num_computed_tokens, shared)

    def mode_for(self, req: Request) -> str:
        """``swap`` or ``recompute`` for this victim, now."""
        if self.mode == "recompute" or req.num_computed_tokens == 0:
            return "recompute"
        swap, recompute = self._estimates(req)
        if swap is None:
            return "recompute"
        if self.mode == "swap":
            return "swap"
        return "swap" if swap < recompute else "recompute"

    def restore_cost(self, req: Request) -> float:
        """Seconds to bring ``req`` back under the mode it would be preempted with."""
        swap, recompute = self._estimates(req)
        if self.mode == "recompute" or swap is None:
            return recompute
        return swap if self.mode == "swap" else min(swap, recompute)

    def victim_key(self, req: Request) -> tuple:
        """Larger = preempted first."""
        ledger = self.kv.ledger
        budget = ledger.budget(req.tenant)
        key: tuple = (ledger.above_reservation(req.tenant), -budget.priority, -req.priority)
        if self.victim == "cost":
            freed = self.kv.num_exclusive_blocks(req.request_id)
            per_block = self.restore_cost(req) / freed if freed else float("inf")
            key += (-per_block,)
        return (*key, req.arrival_time)

    def pick(self, requester: Request, candidates: list[Request]) -> Request:
        """The victim among ``candidates`` (which must contain ``requester``): requests of
        other tenants within their reservation are exempt."""
        ledger = self.kv.ledger
        allowed = [
            c
            for c in candidates
            if c is requester or c.tenant == requester.tenant or ledger.above_reservation(c.tenant)
        ]
        return max(allowed, key=self.victim_key)
