"""``kvserve router``: the OpenAI-compatible front of a cluster (session affinity, failover)."""
