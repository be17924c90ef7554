"""``kvserve serve`` options beyond the engine's (its flags are these fields, ``flags``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.flags import flag
from kvserve.server.tools.parsers import PARSER_NAMES
from kvserve.tenants import TenantsConfig

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class ServerConfig:
    """``kvserve serve`` options beyond the engine's; each field is the flag of its name
    (``--api-key`` for ``api_keys``) with the help text here."""

    host: str = flag("127.0.0.1", "bind address")
    port: int = flag(8000, "listen port")
    served_model_name: str | None = flag(None, "model id in the API")
    api_keys: tuple[str, ...] = flag(
        (), "accepted Bearer key (repeatable; none = open)", name="--api-key", repeat=True,
        metavar="KEY",
    )  # fmt: skip
    admin_key: str | None = flag(None, "Bearer key for /admin/* endpoints")
    max_waiting_requests: int = flag(
        1024,
        "queue bound (with --tenants: each tenant's, unless its max_waiting_requests says); "
        "beyond: 429 with Retry-After",
    )
    # seconds a request may go without output (waiting, then its first prefill) before it
    # is aborted and refused with 429 (None: no deadline)
    queue_timeout: float | None = flag(
        None,
        "seconds a request may wait for its first output; past them it is aborted and "
        "refused with 429 (default: no deadline)",
        kind=float,
    )
    graceful_timeout: float = flag(30.0, "seconds to finish streams")
    # API key → tenant; overrides api_keys
    tenants: TenantsConfig | None = flag(
        None, "tenants YAML: API key hashes → tenant", parse=TenantsConfig.load, metavar="FILE"
    )
    # authenticates /internal/* (header X-Kvserve-Cluster-Secret)
    cluster_secret: str | None = flag(
        None, "secret for /internal/* (or env KVSERVE_CLUSTER_SECRET)",
        env="KVSERVE_CLUSTER_SECRET",
    )  # fmt: skip
    advertise_url: str | None = flag(None, "URL other cluster members reach this worker at")
    # any worker can serve any request; the role says what routers send it
    role: str = flag(
        "both",
        "in a cluster, what routers send here: both (whole requests), prefill (prompts, "
        "handed to a decode worker after the first token) or decode",
        choices=ROLES,
    )
    tool_call_parser: str = flag(
        "auto",
        "how tool calls are read out of chat outputs with tool_choice auto: hermes "
        "(<tool_call> JSON, Qwen/Hermes), llama3_json, mistral ([TOOL_CALLS]), or auto: "
        "chosen from the chat template",
        choices=PARSER_NAMES,
    )
    # stored responses (/v1/responses with store): seconds each is kept, and how many one
    # tenant may keep on this worker (beyond: its oldest is removed)
    responses_ttl: float = flag(
        86400.0, "seconds a stored response (/v1/responses, store: true) and its KV are kept"
    )
    responses_max_per_tenant: int = flag(
        10000, "stored responses a tenant keeps on this worker; beyond, its oldest goes"
    )

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
