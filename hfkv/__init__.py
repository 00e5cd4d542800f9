"""hfkv: a drop-in tri-state KV cache for Hugging Face transformers.

Every cached token of every layer and KV head is kept in full precision, quantized, or evicted
(ARKV's per-layer OQ ratios and budgets + DiffKV's per-head thresholds, on paged storage).

    cfg = hfkv.TriStateConfig.from_preset("hfkv", budget=1024)
    cache = hfkv.TriStateCache(model, cfg)
    model.generate(**enc, past_key_values=cache)
    cache.stats()

    context = hfkv.compress(model, context_ids, cfg, tokenizer=tok)  # before any question; then
    model.generate(torch.cat([context_ids, question_ids], 1), past_key_values=context.fork())

The public names are imported on first use (PEP 562): ``import hfkv`` alone loads neither torch nor
transformers, so ``hfkv --help`` and ``hfkv --version`` answer at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfkv.lazy import lazy_names

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "enable": "hfkv.attention.interface",
    "is_enabled": "hfkv.attention.interface",
    "TriStateCache": "hfkv.cache",
    "TriStateLayer": "hfkv.cache",
    "compress": "hfkv.compress_once",
    "PRESETS": "hfkv.presets",
    "TierFormat": "hfkv.config",
    "TriStateConfig": "hfkv.config",
    "CacheStats": "hfkv.stats",
    "LayerStats": "hfkv.stats",
}

__all__ = [
    "PRESETS",
    "CacheStats",
    "LayerStats",
    "TierFormat",
    "TriStateCache",
    "TriStateConfig",
    "TriStateLayer",
    "compress",
    "enable",
    "is_enabled",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports them
    from hfkv.attention.interface import enable, is_enabled
    from hfkv.cache import TriStateCache, TriStateLayer
    from hfkv.compress_once import compress
    from hfkv.config import TierFormat, TriStateConfig
    from hfkv.presets import PRESETS
    from hfkv.stats import CacheStats, LayerStats


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)
