"""Typed messages between the engine core and its clients (one home for each).

The engine core emits per-step *deltas* (``EngineCoreOutput``): the token ids a request
gained this step, their logprobs, and its finish reason once it ends; the client side
(``engine.output.OutputProcessor``) accumulates them, detokenizes incrementally and checks
stop strings. These are ``msgspec`` Structs, so the same objects travel in-process (the
offline ``LLM``) and over ZeroMQ (``kvserve serve``) as msgpack — never pickle.

Wire versioning: every frame the core process sends or receives starts with
``PROTOCOL_VERSION``; a client and core of different versions refuse each other at the
handshake instead of misreading a frame.
"""

from __future__ import annotations

import msgspec

from kvserve.engine.stats import EngineStats
from kvserve.ha.record import SessionRecord
from kvserve.kv.events import KVEvent
from kvserve.kv.tenant_ledger import Budget
from kvserve.sampling import Logprob, SamplingParams

PROTOCOL_VERSION = 4

# finish reasons (vLLM's names): RequestStatus.value of the finished states
FINISH_STOP, FINISH_ABORT = "stop", "abort"


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step.

    ``new_token_ids`` is empty for a request that only finished (aborted, fenced).
    ``prompt_logprobs`` comes once, with the first sampled token, when asked for.
    ``stop_reason`` is the stop token id, or None (EOS, length, abort).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ---- client → engine core ---------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """Queue one sequence (prompt already tokenized by the client). Answered by an
    ``AddResult`` with the same ``request_id``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None = None
    tenant: str = "default"
    cache_salt: str | None = None
    priority: int = 0
    session_id: str | None = None
    session_epoch: int | None = None
    ephemeral_session: bool = False
    standby: str | None = None


class ResumeRequest(msgspec.Struct, tag=True):
    """Continue a failed-over stream (``LLMEngine.resume_request``). Answered by an
    ``AddResult``."""

    request_id: str
    record: SessionRecord
    delivered: list[int]
    seen_epoch: int | None


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class FinishStopped(msgspec.Struct, tag=True):
    """A stop string ended the request after ``num_output_tokens`` output tokens."""

    request_id: str
    num_output_tokens: int


class ResetPrefixCache(msgspec.Struct, tag=True):
    """→ int: blocks evicted."""


class GetSession(msgspec.Struct, tag=True):
    """→ SessionInfo | None."""

    tenant: str
    session_id: str


class DeleteSession(msgspec.Struct, tag=True):
    """→ bool: whether it existed (and, with ``if_tokens``, held the tokens of that
    ``store.sessions.tokens_digest``: else it is kept)."""

    tenant: str
    session_id: str
    if_tokens: str | None = None


class SetTenantBudgets(msgspec.Struct, tag=True):
    """→ None. Reservations and limits in blocks of this pool."""

    budgets: dict[str, Budget]


class GetKVStats(msgspec.Struct, tag=True):
    """→ KVStats."""


class AcceptPush(msgspec.Struct, tag=True):
    """→ list[int] (accepted, refused, placed in the device pool as pre-warmed blocks):
    a primary's direct push (``ha.push``)."""

    body: bytes


class ReadCheckpoint(msgspec.Struct, tag=True):
    """→ SessionRecord | None: the session's checkpoint in the S3 tier."""

    session_id: str


class CheckIntegrity(msgspec.Struct, tag=True):
    """→ None: the engine's KV bookkeeping checked (``LLMEngine.check_integrity``); the
    call fails with the inconsistency found."""


class PutRecords(msgspec.Struct, tag=True):
    """→ None: small records (a stored response) written to every KV store tier before
    the answer (``TieredStore.put_now``), so another worker sharing a tier reads them at
    once. A worker without a KV store keeps none (the API server holds its own)."""

    items: list[tuple[bytes, bytes]]


class GetRecord(msgspec.Struct, tag=True):
    """→ bytes | None: a record from the first KV store tier that holds it."""

    key: bytes


class DeleteRecords(msgspec.Struct, tag=True):
    """→ None: records removed from every tier."""

    keys: list[bytes]


class Shutdown(msgspec.Struct, tag=True):
    """Stop: abort what runs, flush the KV store and replication, exit 0."""


UtilityCall = (
    ResetPrefixCache
    | GetSession
    | DeleteSession
    | SetTenantBudgets
    | GetKVStats
    | AcceptPush
    | ReadCheckpoint
    | PutRecords
    | GetRecord
    | DeleteRecords
    | CheckIntegrity
)


class Utility(msgspec.Struct, tag=True):
    """A call answered by a ``UtilityResult`` with the same ``call_id``."""

    call_id: int
    call: UtilityCall


ClientMessage = AddRequest | ResumeRequest | Abort | FinishStopped | Utility | Shutdown


# ---- engine core → client ---------------------------------------------------------------
class SessionInfo(msgspec.Struct):
    num_tokens: int
    num_blocks: int
    updated_at: float
    expires_at: float


class EngineInfo(msgspec.Struct, tag=True):
    """Sent once when the engine core is ready: what the client needs to know of it.
    A client refuses a core whose ``protocol_version`` is not its own."""

    protocol_version: int
    model: str  # --model as given (the served name derives from it)
    model_dir: str  # the HF directory loaded (a GGUF file's converted one)
    max_model_len: int
    num_blocks: int
    block_size: int
    bytes_per_block: int
    has_kv_store: bool
    cluster: str | None  # the coordinator URL when in a cluster
    node_id: str | None
    has_checkpointer: bool
    # what a router needs to name this engine's blocks (``kv.hashing``): the keys under
    # the root hash, and whether the tenant enters the salt
    cache_keys: list[str] = []
    tenant_isolation: bool = False
    kv_events: bool = False  # Outputs carry KV events


class StartupFailed(msgspec.Struct, tag=True):
    """The engine core could not start; ``message`` says why. ``config``: the model or the
    flags are at fault (a user's to fix), not the machine or a bug."""

    message: str
    config: bool = False


class AddResult(msgspec.Struct, tag=True, omit_defaults=True):
    """``error`` is the reason a request was refused (``EngineError``); else it is queued.
    ``internal``: the refusal is a bug in the engine, not the request's fault."""

    request_id: str
    error: str | None = None
    internal: bool = False


class UtilityResult(msgspec.Struct, tag=True, omit_defaults=True):
    call_id: int
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack of the result (nil: None)
    error: str | None = None


class Outputs(msgspec.Struct, tag=True):
    """One step's deltas (possibly none), the engine's stats after it, and the KV events
    since the last frame (``kv.events``; empty unless the engine publishes them)."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    kv_events: list[KVEvent] = []


CoreMessage = EngineInfo | StartupFailed | AddResult | UtilityResult | Outputs
