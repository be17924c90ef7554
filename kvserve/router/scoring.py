"""Where a request without a session owner goes: ``--routing prefix|least-loaded|round-robin``.

``prefix`` (the default) weighs what each worker already holds of the request's prompt
against how busy it is. For each routable worker ``w``::

    cost(w) = prompt_tokens - cached(w) + load_weight * load(w)
    cached(w) = block_size * (device_blocks(w) + host_weight * host_blocks(w))

``device_blocks`` / ``host_blocks``: the leading blocks of the prompt ``w`` holds in its
device pool / host tier (``PrefixIndex.match``, capped so one token is always computed);
``load(w)``: requests this router has open there plus the running and waiting counts it
last published. The cheapest worker wins; ties go by rendezvous hash of the session, so
routers with the same view agree. ``load_weight`` is in tokens: a request already there
costs as much as prefilling that many tokens (default 256); ``host_weight`` (default 0.8)
discounts a host-tier hit, which costs a copy into the device pool.

The prompt's token ids come per tokenizer fingerprint (``PromptInfo``): each worker is
matched with the ids of the tokenizer it registered (``tokenizer_fp``), so workers of
different models never share one; ``prompt_tokens`` is the longest of them (the same
for every worker, so only ``cached`` and ``load`` decide). A request with no ids at all
(no tokenizer for any candidate yet, or a body the router cannot read) is placed
least-loaded. A worker that publishes no KV events, is not synced yet, isolates its
prefix cache per tenant (the router does not know tenants), or whose tokenizer the
router does not have matches nothing and is placed by load alone.

``least-loaded``: the smallest ``load``; ``round-robin``: the next routable worker in id
order. Session affinity comes first under every policy (``relay``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.kv.events import seal
from kvserve.kv.hashing import hash_blocks, root_hash
from kvserve.router.index import PrefixIndex
from kvserve.router.workers import Worker, rendezvous

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: str  # prefix | load | least_loaded | round_robin
    predicted_cached: int = 0  # tokens the chosen worker is expected to serve from cache
    prompt_tokens: int = 0  # the prompt's length in the chosen worker's tokens (0: unknown)


@dataclass(frozen=True)
class PromptInfo:
    """What placement knows of a request: its prompt token ids per tokenizer fingerprint
    (empty: not tokenized) and its ``cache_salt``."""

    token_ids: Mapping[str, list[int]] = field(default_factory=dict)
    cache_salt: str | None = None

    def ids_for(self, w: Worker) -> list[int] | None:
        """The prompt in ``w``'s tokens (its registered ``tokenizer_fp``), or None."""
        fp = w.info.get("tokenizer_fp")
        return self.token_ids.get(fp) if isinstance(fp, str) else None


class Placement:
    def __init__(
        self,
        policy: str,
        index: PrefixIndex | None,
        load_weight: float = 256.0,
        host_weight: float = 0.8,
        events_key: bytes | None = None,
    ):
        """``events_key``: the key the workers seal their published hashes with (the
        cluster secret's, ``kv.events.events_key``)."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}")
        self.policy = policy
        self.index = index
        self.load_weight = load_weight
        self.host_weight = host_weight
        self.events_key = events_key
        self._rr = itertools.count()

    def choose(self, cands: Sequence[Worker], session: str, prompt: PromptInfo) -> Decision:
        """The worker for a request among ``cands`` (non-empty) and why."""
        if self.policy == "round-robin":
            ordered = sorted(cands, key=lambda w: w.node_id)
            return Decision(ordered[next(self._rr) % len(ordered)], "round_robin")
        if self.policy == "least-loaded" or not prompt.token_ids or self.index is None:
            w = min(cands, key=lambda w: (w.load, -rendezvous(session, w.node_id)))
            return Decision(w, "least_loaded")
        n = max(len(ids) for ids in prompt.token_ids.values())
        hashes: dict[tuple, list[bytes]] = {}  # (fingerprint, root keys, block size) → chain
        best: tuple[float, int, Worker, int] | None = None  # (cost, tie, worker, cached)
        for w in cands:
            device, host = self.cached_tokens(w, prompt, hashes)
            cost = n - device - self.host_weight * host + self.load_weight * w.load
            key = (cost, -rendezvous(session, w.node_id), w, device + host)
            if best is None or key[:2] < best[:2]:
                best = key
        assert best is not None
        _, _, w, cached = best
        ids = prompt.ids_for(w)
        return Decision(w, "prefix" if cached > 0 else "load", cached, len(ids or ()))

    def cached_tokens(
        self, w: Worker, prompt: PromptInfo, memo: dict[tuple, list[bytes]] | None = None
    ) -> tuple[int, int]:
        """Tokens of the prompt (in ``w``'s tokens) that ``w`` is expected to serve from
        its device pool and from its host tier; (0, 0) when ``w`` cannot be matched.
        ``memo`` keeps the hash chains of one request (workers with the same tokenizer
        and root keys share one)."""
        info = w.info
        keys, bs = info.get("cache_keys"), info.get("block_size")
        if not keys or not bs or info.get("tenant_isolation") or self.index is None:
            return 0, 0
        ids = prompt.ids_for(w)
        if ids is None:
            return 0, 0
        salt = prompt.cache_salt
        usable = (len(ids) - 1) // int(bs)  # at least one token is always computed
        if usable <= 0:
            return 0, 0
        memo = {} if memo is None else memo
        k = (info.get("tokenizer_fp"), tuple(keys), int(bs))
        chain = memo.get(k)
        if chain is None:
            root = root_hash(*keys, None if salt is None else f"salt={salt}")
            chain = hash_blocks(root, ids[: usable * int(bs)], int(bs))
            chain = memo[k] = seal(self.events_key, chain)
        m = self.index.match(w.node_id, chain)
        return int(bs) * m.device, int(bs) * m.host
