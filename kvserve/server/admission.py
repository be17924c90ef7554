"""What every generating endpoint does before its first token: admit the request (not
draining, engine up, a known model, room in the queue), check a structured-output
constraint, and add its sequences to the engine."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from fastapi import Request

from kvserve.engine.async_llm import RequestStream
from kvserve.errors import EngineDeadError, EngineError, QueueTimeout
from kvserve.sampling import SamplingParams, child_seed
from kvserve.sampling.guided import check_spec
from kvserve.server.auth import Principal
from kvserve.server.errors import APIError, bad_request, retry_after, unavailable
from kvserve.server.state import ServerState


@dataclass(frozen=True)
class Placement:
    """Where a request's KV goes: its session (None: none), prefix-cache salt, priority."""

    session_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0


def admit(state: ServerState, model: str | None, tenant: str | None = None) -> None:
    """Raise the APIError that refuses a new request now (503, 404, 429), or return.
    The queue bound (``--max-waiting-requests``) is the whole engine's — or, with a
    tenants file, each tenant's own (its requests without output yet; the tenant's
    ``max_waiting_requests`` when the file sets one): one tenant's flood is refused
    without refusing the others. A 429's ``Retry-After`` is the time the
    requests beyond the bound take to finish at the recent completion rate (1–60 s)."""
    if state.draining:
        raise unavailable("the server is shutting down")
    if not state.engine.is_running:
        raise unavailable("the engine is not running")
    if model is not None and model not in state.model_aliases:
        raise APIError(
            404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found"
        )
    bound, tenants = state.config.max_waiting_requests, state.config.tenants
    if tenants is not None and tenant is not None:
        bound = tenants.queue_bound(tenant, bound)
        waiting, whose = state.engine.queued(tenant), f"tenant {tenant!r}'s requests"
    else:
        waiting, whose = state.engine.stats().waiting, "requests"
    if waiting >= bound:
        wait = retry_after(waiting - bound + 1, state.engine.completion_rate())
        raise APIError(
            429,
            f"too many {whose} are waiting ({waiting}); retry later",
            "RateLimitError",
            headers={"Retry-After": str(wait)},
        )


async def check_structured(params: SamplingParams, field: str) -> None:
    """Raise ValueError naming ``field``, before any token, when the structured output
    cannot be enforced (checked off the event loop: a large schema takes milliseconds)."""
    if params.structured is None:
        return
    try:
        await asyncio.to_thread(check_spec, params.structured)
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith(field) else f"{field}: {e}") from None


async def start(
    state: ServerState,
    prompts: list[str | list[int]],
    params: SamplingParams,
    principal: Principal,
    where: Placement,
    request: Request,
) -> list[RequestStream]:
    """Add every (prompt, n) sequence; on any rejection abort the rest → 400 (503 when
    the engine died). A router adds ``X-Kvserve-Session-Epoch`` (and
    ``X-Kvserve-Ephemeral-Session: 1`` for an id it made up for a request that had none;
    ``X-Kvserve-Standby``: the node to pre-warm)."""
    try:  # the session's epoch when the router routed it (the claim's condition)
        epoch = int(request.headers["x-kvserve-session-epoch"])
    except (KeyError, ValueError):
        epoch = None
    ephemeral = request.headers.get("x-kvserve-ephemeral-session") == "1"
    base = f"{uuid.uuid4().hex[:24]}"
    streams: list[RequestStream] = []
    try:
        for p_idx, prompt in enumerate(prompts):
            for i in range(params.n):
                streams.append(
                    await state.engine.add_request(
                        f"{base}-{p_idx}-{i}",
                        prompt,
                        params,
                        child_seed(params.seed, i),
                        tenant=principal.tenant,
                        cache_salt=where.cache_salt,
                        priority=where.priority,
                        session_id=where.session_id,
                        session_epoch=epoch,
                        ephemeral_session=ephemeral,
                        standby=request.headers.get("x-kvserve-standby"),
                        first_output_timeout=state.config.queue_timeout,
                    )
                )
    except EngineError as e:
        for s in streams:
            s.abort()
        raise bad_request(str(e), "prompt") from None
    except EngineDeadError as e:
        for s in streams:
            s.abort()
        raise unavailable(str(e)) from None
    return streams


def queue_timeout_error(e: QueueTimeout, state: ServerState) -> APIError:
    """The 429 of a request aborted by ``--queue-timeout``."""
    return APIError(
        429,
        str(e),
        "RateLimitError",
        code="queue_timeout",
        headers={"Retry-After": str(retry_after(1, state.engine.completion_rate()))},
    )
