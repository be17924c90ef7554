"""KV store tiers: host RAM, local disk, Redis (and Redis Cluster), S3-compatible storage."""
