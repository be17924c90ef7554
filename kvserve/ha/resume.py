"""The failover resume's rules, in one home: which state a stream resumes from, at which
epoch, and how much of its stored KV the resuming engine may restore.

A router whose worker failed (``router.failover``) sends ``POST /internal/resume``
(``ha.wire.ResumeBody``: what the client has, the original request) to the session's
standby. The standby's
server (``server.routes_cluster``) builds the request's own record (``from_request``:
nothing generated yet), reads what the primary replicated (the coordinator's owner
state, else an S3 checkpoint) and resumes from ``choose_record``'s pick at
``seen_epoch``'s epoch; the engine (``LLMEngine.resume_request``) queues it as a replay
that restores at most ``restore_limit`` tokens of stored KV and recomputes the rest as the
primary computed it (the scheduler's ``_chunk``: the prompt's remainder in one chunk, each
delivered token as a decode step), so the stream goes on with exactly the tokens it would
have had.
"""

from __future__ import annotations

import secrets

from kvserve.ha.record import SessionRecord
from kvserve.sampling import SamplingParams


def from_request(
    session_id: str,
    tenant: str,
    cache_salt: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    ephemeral: bool,
) -> SessionRecord:
    """The record of a request as its primary started it (nothing generated): what a
    stream resumes from when its primary replicated nothing yet. A request without a
    seed gets a fresh one, so only a greedy one is then exact (routers always send one)."""
    return SessionRecord(
        session_id=session_id,
        tenant=tenant,
        cache_salt=cache_salt,
        prompt_token_ids=prompt_ids,
        params=params,
        seed=params.seed if params.seed is not None else secrets.randbits(63),
        ephemeral=ephemeral,
    )


def choose_record(request: SessionRecord, replicated: SessionRecord | None) -> SessionRecord:
    """The state to resume from: what the primary replicated when it is this very request
    (same prompt, parameters and tenant: its seed and stored tokens are the primary's),
    else the request's own record (another turn of the session, or nothing replicated)."""
    if replicated is not None and (
        replicated.prompt_token_ids == request.prompt_token_ids
        and replicated.params == request.params
        and replicated.tenant == request.tenant
    ):
        return replicated
    return request


def seen_epoch(given: int | None, owner_epoch: int | None) -> int:
    """The epoch the takeover is conditional on: the router's when it read one, else the
    coordinator's owner's now (0 when the session has no owner)."""
    if given is not None:
        return int(given)
    return owner_epoch if owner_epoch is not None else 0


def restore_limit(
    record: SessionRecord, num_prompt_tokens: int, block_size: int, batch_invariant: bool
) -> int | None:
    """How many tokens of stored KV the resumed request may restore (None: all it finds).

    Batch-invariant kernels give a row the same bits in any batch, so every stored block
    is exact. Otherwise only what the primary itself computed the same way: all of it
    when the stored blocks cover the prompt's end, else exactly the prefix the primary had
    from its cache (the prompt's tail went through other kernels than a replay's)."""
    if record.prefill_from is None or batch_invariant:
        return None
    if record.stored_tokens >= num_prompt_tokens:
        return record.stored_tokens
    return record.prefill_from // block_size * block_size
