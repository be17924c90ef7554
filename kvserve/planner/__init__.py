"""Capacity planning: KV and weight memory from model configs (``kvserve plan``)."""
