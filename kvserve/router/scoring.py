"""Where a request without a session owner goes: ``--routing prefix|least-loaded|round-robin``.

``prefix`` (the default with ``--tokenizer``) weighs what each worker already holds of
the request's prompt against how busy it is. For each routable worker ``w``::

    cost(w) = prompt_tokens - cached(w) + load_weight * load(w)
    cached(w) = block_size * (device_blocks(w) + host_weight * host_blocks(w))

``device_blocks`` / ``host_blocks``: the leading blocks of the prompt ``w`` holds in its
device pool / host tier (``PrefixIndex.match``, capped so one token is always computed);
``load(w)``: requests this router has open there plus the running and waiting counts it
last published. The cheapest worker wins; ties go by rendezvous hash of the session, so
routers with the same view agree. ``load_weight`` is in tokens: a request already there
costs as much as prefilling that many tokens (default 256); ``host_weight`` (default 0.8)
discounts a host-tier hit, which costs a copy into the device pool.

A worker that publishes no KV events, is not synced yet, isolates its prefix cache per
tenant (the router does not know tenants), or tokenizes differently from the router
(fingerprints differ) matches nothing and is placed by load alone.

``least-loaded``: the smallest ``load``; ``round-robin``: the next routable worker in id
order. Session affinity comes first under every policy (``relay``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.hashing import hash_blocks, root_hash
from kvserve.router.index import PrefixIndex
from kvserve.router.workers import Worker, rendezvous

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: str  # prefix | load | least_loaded | round_robin
    predicted_cached: int = 0  # tokens the chosen worker is expected to serve from cache


@dataclass(frozen=True)
class PromptInfo:
    """What placement knows of a request: its prompt token ids (None: not tokenized)
    and its ``cache_salt``."""

    token_ids: list[int] | None
    cache_salt: str | None = None


class Placement:
    def __init__(
        self,
        policy: str,
        index: PrefixIndex | None,
        tokenizer_fp: str | None,
        load_weight: float = 256.0,
        host_weight: float = 0.8,
    ):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}")
        self.policy = policy
        self.index = index
        self.tokenizer_fp = tokenizer_fp
        self.load_weight = load_weight
        self.host_weight = host_weight
        self._rr = itertools.count()

    def choose(self, cands: Sequence[Worker], session: str, prompt: PromptInfo) -> Decision:
        """The worker for a request among ``cands`` (non-empty) and why."""
        if self.policy == "round-robin":
            ordered = sorted(cands, key=lambda w: w.node_id)
            return Decision(ordered[next(self._rr) % len(ordered)], "round_robin")
        if self.policy == "least-loaded" or prompt.token_ids is None or self.index is None:
            w = min(cands, key=lambda w: (w.load, -rendezvous(session, w.node_id)))
            return Decision(w, "least_loaded")
        ids = prompt.token_ids
        hashes: dict[tuple, list[bytes]] = {}  # (root keys, block size) → chain
        best: tuple[float, int, Worker, int] | None = None  # (cost, tie, worker, cached)
        for w in cands:
            device, host = self.cached_tokens(w, ids, prompt.cache_salt, hashes)
            cost = len(ids) - device - self.host_weight * host + self.load_weight * w.load
            key = (cost, -rendezvous(session, w.node_id), w, device + host)
            if best is None or key[:2] < best[:2]:
                best = key
        assert best is not None
        _, _, w, cached = best
        return Decision(w, "prefix" if cached > 0 else "load", cached)

    def cached_tokens(
        self,
        w: Worker,
        ids: list[int],
        salt: str | None,
        memo: dict[tuple, list[bytes]] | None = None,
    ) -> tuple[int, int]:
        """Tokens of ``ids`` that ``w`` is expected to serve from its device pool and
        from its host tier; (0, 0) when ``w`` cannot be matched. ``memo`` keeps the
        hash chains of one request (workers with the same root keys share one)."""
        info = w.info
        keys, bs = info.get("cache_keys"), info.get("block_size")
        if not keys or not bs or info.get("tenant_isolation") or self.index is None:
            return 0, 0
        if self.tokenizer_fp is None or info.get("tokenizer_fp") != self.tokenizer_fp:
            return 0, 0
        usable = (len(ids) - 1) // int(bs)  # at least one token is always computed
        if usable <= 0:
            return 0, 0
        memo = {} if memo is None else memo
        k = (tuple(keys), int(bs))
        chain = memo.get(k)
        if chain is None:
            root = root_hash(*keys, None if salt is None else f"salt={salt}")
            chain = memo[k] = hash_blocks(root, ids[: usable * int(bs)], int(bs))
        m = self.index.match(w.node_id, chain)
        return int(bs) * m.device, int(bs) * m.host
