"""The worker: the only owner of KV tensors (model runner, swaps)."""
