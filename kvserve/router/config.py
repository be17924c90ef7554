"""``kvserve router`` options (CLI flags map one-to-one to these fields)."""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_CHOICES = ("auto", "prefix", "least-loaded", "round-robin")


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
    # seconds a failed-over request waits for a routable standby (one whose /ready probe
    # failed, say, on a loaded machine) before giving up; waiting uses no attempt
    failover_timeout: float = 10.0
    registry_grace: float = 10.0  # keep routing to a worker missing from an unreadable registry
    graceful_timeout: float = 30.0
    # placement of requests without a session owner (router.scoring); auto is prefix:
    # by prefix overlap for workers whose tokenizer the router has (--tokenizer, or taken
    # from the workers: router.tokenizers), least-loaded until it has one
    routing: str = "auto"
    # a model directory: its tokenizer serves the workers with its fingerprint (no fetch
    # from them); the others' tokenizers are still taken from the workers
    tokenizer: str | None = None
    routing_load_weight: float = 256.0  # tokens of prefill one open request is worth
    routing_host_weight: float = 0.8  # a host-tier hit's worth against a device-pool hit

    @property
    def routing_policy(self) -> str:
        """``routing`` with ``auto`` resolved (to ``prefix``: it needs no flag any more)."""
        return "prefix" if self.routing == "auto" else self.routing

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_CHOICES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_CHOICES)}")
        if self.routing_load_weight < 0 or not 0 <= self.routing_host_weight <= 1:
            raise ValueError("routing_load_weight must be >= 0, routing_host_weight in [0, 1]")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in (
            "health_interval",
            "stall_timeout",
            "probe_timeout",
            "registry_grace",
            "failover_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_failovers < 0:
            raise ValueError("max_failovers must be >= 0")
