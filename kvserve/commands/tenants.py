"""``kvserve tenants hash-key`` and ``kvserve tenants check``: tenants-file helpers."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    tn = sub.add_parser("tenants", help="tenant file helpers")
    tn_sub = tn.add_subparsers(dest="tenants_command", required=True)
    hk = tn_sub.add_parser("hash-key", help="print the stored form of an API key")
    hk.add_argument("key")
    hk.set_defaults(func=hash_key)
    ck = tn_sub.add_parser("check", help="validate a tenants file against a KV pool size")
    ck.add_argument("file")
    ck.add_argument("--pool-blocks", type=int, required=True, help="KV blocks of the pool")
    ck.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ck.add_argument(
        "--bytes-per-block", type=int, required=True, help="bytes of one block (all layers)"
    )
    ck.set_defaults(func=check)


def hash_key(ns: argparse.Namespace) -> int:
    from kvserve.tenants import hash_key

    print(hash_key(ns.key))
    return 0


def check(ns: argparse.Namespace) -> int:
    """Print each tenant's resolved budget; raises ``ValueError`` for a bad file."""
    from kvserve.tenants import TenantsConfig

    budgets = TenantsConfig.load(ns.file).resolve(ns.pool_blocks, ns.block_size, ns.bytes_per_block)
    for b in budgets.values():
        print(
            f"{b.tenant.name}: priority {b.tenant.priority}, reservation "
            f"{b.reservation_blocks} blocks, limit {b.limit_blocks} blocks"
        )
    return 0
