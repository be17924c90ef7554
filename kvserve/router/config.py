"""``kvserve router`` options (its flags are these fields, ``flags``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.flags import flag

ROUTING_CHOICES = ("auto", "prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class RouterConfig:
    """Each field is the flag of its name, with the help text here."""

    # the coordinator's Redis URL (redis://, rediss://, redis+sentinel://)
    cluster: str = flag(help="coordinator Redis URL (as the workers')")
    host: str = flag("127.0.0.1", "bind address")
    port: int = flag(8080, "listen port")
    cluster_secret: str | None = flag(
        None, "as the workers' (or env KVSERVE_CLUSTER_SECRET)", env="KVSERVE_CLUSTER_SECRET"
    )  # sent to workers' /internal/* endpoints
    health_interval: float = flag(0.5, "seconds between registry reads and /health probes")
    stall_timeout: float = flag(1.0, "silence from a worker before probing it")
    probe_timeout: float = flag(0.5, "/health probe deadline")
    max_failovers: int = flag(3, "resume attempts per request")
    # a standby whose /ready probe failed (say, on a loaded machine) may come back;
    # waiting uses no attempt
    failover_timeout: float = flag(
        10.0, "seconds a failed-over request waits for a routable standby"
    )
    registry_grace: float = flag(
        10.0, "seconds to keep routing to workers while the registry cannot be read"
    )
    graceful_timeout: float = flag(30.0, "seconds to finish streams")
    # placement of requests without a session owner (router.scoring); the workers'
    # tokenizers come from router.tokenizers
    routing: str = flag(
        "auto",
        "where a request without a session owner goes: prefix (the worker holding the "
        "most of its prompt, against load; with the workers' own tokenizer, fetched from "
        "them, or --tokenizer; least-loaded until the router has one), least-loaded, "
        "round-robin; auto: prefix",
        choices=ROUTING_CHOICES,
    )
    # a model directory: its tokenizer serves the workers with its fingerprint; the
    # others' tokenizers are still taken from the workers
    tokenizer: str | None = flag(
        None,
        "prefix routing: the model's directory (its tokenizer.json), used for the "
        "workers with its tokenizer instead of fetching theirs (default: fetch each "
        "model's tokenizer from its workers)",
        metavar="DIR",
    )
    routing_load_weight: float = flag(
        256.0, "prefix routing: prompt tokens one open request on a worker is worth"
    )
    routing_host_weight: float = flag(
        0.8, "prefix routing: a host-tier hit's worth against a device-pool hit, 0..1"
    )

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
