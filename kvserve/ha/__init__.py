"""High availability: coordination in Redis (registry, ownership, fencing)."""
