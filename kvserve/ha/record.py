"""``SessionRecord``: the replicated state a standby resumes a stream from (one home).

Producers: the primary's replicator (``SessionRecord.of_request``, after the prompt, every
``--replicate-every`` tokens and at the end) and a worker resuming a stream its primary
never replicated (built from the client's original request). Readers: the resuming engine
(``LLMEngine.resume_request``), the pre-warmer, the standby pusher and its receiver, and
the S3 checkpointer. The JSON form (in Redis, pushes and S3) has the field names below;
``from_json`` raises ValueError for anything that is not a record, so a foreign or
corrupt value is refused, never half-read.
"""

from __future__ import annotations

import msgspec

from kvserve.request import Request
from kvserve.sampling import SamplingParams


class SessionRecord(msgspec.Struct, kw_only=True):
    session_id: str | None
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    cache_salt: str | None = None
    request_id: str | None = None
    output_token_ids: list[int] = []
    max_tokens: int | None = None
    # tokens whose KV blocks are in the shared store (whole blocks)
    stored_tokens: int = 0
    # the prompt was computed from this token on (its prefix came from the cache); None
    # for a record built from the client's request (nothing computed yet)
    prefill_from: int | None = None
    finished: bool = False
    ephemeral: bool = False
    standby: str | None = None  # the node a router chose to continue the session
    epoch: int | None = None  # the owner's epoch when written (the publisher sets it)

    @classmethod
    def of_request(cls, req: Request, block_size: int) -> SessionRecord:
        """The state of ``req`` now (without ``epoch``)."""
        return cls(
            session_id=req.session_id,
            request_id=req.request_id,
            tenant=req.tenant,
            cache_salt=req.cache_salt,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            params=req.params,
            seed=req.seed,
            max_tokens=req.max_tokens,
            stored_tokens=(req.num_computed_tokens // block_size) * block_size,
            prefill_from=req.num_cached_tokens,
            finished=req.is_finished,
            ephemeral=req.session_ephemeral,
            standby=req.standby,
        )

    def tokens(self) -> list[int]:
        """Prompt and output token ids, in order."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> SessionRecord:
        """Decode a record; raises ValueError when ``data`` is not one."""
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
            raise ValueError(f"not a session record: {e}") from None

    @classmethod
    def from_builtins(cls, obj: object) -> SessionRecord:
        """A record from decoded JSON (a dict); raises ValueError when it is not one."""
        try:
            return msgspec.convert(obj, cls)
        except (msgspec.ValidationError, TypeError) as e:
            raise ValueError(f"not a session record: {e}") from None

    def with_epoch(self, epoch: int | None) -> SessionRecord:
        return msgspec.structs.replace(self, epoch=epoch)
