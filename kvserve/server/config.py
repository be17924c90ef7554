"""``kvserve serve`` options beyond the engine's (CLI flags map one-to-one)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.tools.parsers import PARSER_NAMES
from kvserve.tenants import TenantsConfig

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class ServerConfig:
    """``kvserve serve`` options beyond the engine's (CLI flags map one-to-one)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    max_waiting_requests: int = 1024
    # seconds a request may go without output (waiting, then its first prefill) before it
    # is aborted and refused with 429 (None: no deadline)
    queue_timeout: float | None = None
    graceful_timeout: float = 30.0
    tenants: TenantsConfig | None = None  # API key → tenant; overrides api_keys
    cluster_secret: str | None = None  # authenticates /internal/* (header X-Kvserve-Cluster-Secret)
    advertise_url: str | None = None  # how other cluster members reach this worker
    # what routers send here: both (whole requests), prefill (prompts, handed off after
    # the first token) or decode (the continuations); any worker can serve any request
    role: str = "both"
    # how tool calls are read out of a chat output: auto (from the chat template), hermes,
    # llama3_json or mistral
    tool_call_parser: str = "auto"
    # stored responses (/v1/responses with store): seconds each is kept, and how many one
    # tenant may keep on this worker (beyond: its oldest is removed)
    responses_ttl: float = 86400.0
    responses_max_per_tenant: int = 10000

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be positive, got {self.queue_timeout}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.responses_ttl <= 0:
            raise ValueError(f"responses_ttl must be positive, got {self.responses_ttl}")
        if self.responses_max_per_tenant < 1:
            raise ValueError("responses_max_per_tenant must be at least 1")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
