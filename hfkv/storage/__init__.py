"""Storage of one layer: a dense window ring and paged tiers over one byte pool (records: hfkv.quant.record)."""

from hfkv.storage.memory import cache_bytes, dense_kv_bytes, dynamic_cache_bytes, held_bytes
from hfkv.storage.paged import PagedTiers
from hfkv.storage.pool import PagePool
from hfkv.storage.window import WindowRing

__all__ = [
    "PagePool",
    "PagedTiers",
    "WindowRing",
    "cache_bytes",
    "dense_kv_bytes",
    "dynamic_cache_bytes",
    "held_bytes",
]
