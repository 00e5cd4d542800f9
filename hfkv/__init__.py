"""hfkv: a drop-in tri-state KV cache for Hugging Face transformers.

Every cached token of every layer and KV head is kept in full precision, quantized, or evicted
(ARKV's per-layer OQ ratios and budgets + DiffKV's per-head thresholds, on paged storage).

    cfg = hfkv.TriStateConfig.from_preset("hfkv", budget=1024)
    cache = hfkv.TriStateCache(model, cfg)
    model.generate(**enc, past_key_values=cache)
    cache.stats()
"""

from hfkv.attention.interface import enable, is_enabled
from hfkv.cache import TriStateCache, TriStateLayer
from hfkv.config import PRESETS, TierFormat, TriStateConfig
from hfkv.stats import CacheStats, LayerStats

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CacheStats",
    "LayerStats",
    "TierFormat",
    "TriStateCache",
    "TriStateConfig",
    "TriStateLayer",
    "enable",
    "is_enabled",
]
