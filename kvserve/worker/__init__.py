"""The worker: the only owner of KV tensors — the model runner (forward, sampling), its
swaps (``swap``) and KV store transfers (``offload``), driven by ``SchedulerOutput``."""
