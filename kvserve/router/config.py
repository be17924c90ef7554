"""``kvserve router`` options (CLI flags map one-to-one to these fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    cluster: str  # the coordinator's Redis URL (redis://, rediss://, redis+sentinel://)
    host: str = "127.0.0.1"
    port: int = 8080
    cluster_secret: str | None = None  # sent to workers' /internal/* endpoints
    health_interval: float = 0.5  # seconds between registry reads and /health probes
    stall_timeout: float = 1.0  # no bytes from a worker for this long → probe it
    probe_timeout: float = 0.5  # a /health probe slower than this counts as failed
    max_failovers: int = 3  # resume attempts per request before giving up
    registry_grace: float = 10.0  # keep routing to a worker missing from an unreadable registry
    graceful_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("health_interval", "stall_timeout", "probe_timeout", "registry_grace"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_failovers < 0:
            raise ValueError("max_failovers must be >= 0")
