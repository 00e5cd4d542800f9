"""hfkv: a drop-in tri-state KV cache for Hugging Face transformers.

Every cached token of every layer and KV head is kept in full precision, quantized, or evicted
(ARKV's per-layer OQ ratios and budgets + DiffKV's per-head thresholds, on paged storage).

    cfg = hfkv.TriStateConfig.from_preset("hfkv", budget=1024)
    cache = hfkv.TriStateCache(model, cfg)
    model.generate(**enc, past_key_values=cache)
    cache.stats()

The public names are imported on first use (PEP 562): ``import hfkv`` alone loads neither torch nor
transformers, so ``hfkv --help`` and ``hfkv --version`` answer at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "enable": "hfkv.attention.interface",
    "is_enabled": "hfkv.attention.interface",
    "TriStateCache": "hfkv.cache",
    "TriStateLayer": "hfkv.cache",
    "PRESETS": "hfkv.config",
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
    "enable",
    "is_enabled",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports them
    from hfkv.attention.interface import enable, is_enabled
    from hfkv.cache import TriStateCache, TriStateLayer
    from hfkv.config import PRESETS, TierFormat, TriStateConfig
    from hfkv.stats import CacheStats, LayerStats


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for; ``hfkv.<submodule>`` too,
    because code written when this file imported them eagerly may reach ``hfkv.config`` without importing it."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
