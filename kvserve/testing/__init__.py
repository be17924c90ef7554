"""The harness the tests' fixtures and the benchmarks share (sglang's ``sglang.test``
shape): real processes started and stopped with bounded waits — ``kvserve serve`` and
``kvserve router`` (``procs``, ``cluster``), ``redis-server``, a Redis Cluster and
Sentinel (``redis_procs``), the chaos run (``chaos``) — free loopback ports, and the
random-weight checkpoints of every supported family (``models``). Nothing in the engine
imports it; it needs the ``test`` extra (transformers, openai)."""
