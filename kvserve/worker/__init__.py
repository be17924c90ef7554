"""The worker: the only owner of KV tensors — the model runner (forward, sampling), its
own copy of the requests (``requests``) and the inputs it builds from them (``inputs``),
its swaps (``swap``) and KV store transfers (``offload``), driven by ``SchedulerOutput``
deltas."""
