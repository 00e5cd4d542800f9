"""Bytes of memory actually held, read off tensors rather than computed from formulas."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the storage capacities behind ``tensors``, each storage counted once.

    Capacity (not ``numel``) is what the allocator holds: a pool grown to 2x its use counts 2x.
    """
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def dense_kv_bytes(batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype) -> int:
    """What DynamicCache holds for one layer: keys and values ``[B, H, length, D]`` in ``dtype``."""
    return 2 * batch * heads * length * head_dim * torch.empty((), dtype=dtype).element_size()


def dynamic_cache_bytes(cache) -> int:
    """Bytes a transformers ``DynamicCache`` holds, read from its layers' key and value tensors."""
    return sum(held_bytes([layer.keys, layer.values]) for layer in cache.layers if layer.keys is not None)


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """Plain tensors behind ``t``; tensor subclasses (quanto's packed codes, scales) are opened up."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [leaf for n in names for leaf in _leaves(getattr(t, n))]
    return [t]


def _tensors_of(obj) -> list[torch.Tensor]:
    return [leaf for v in vars(obj).values() if isinstance(v, torch.Tensor) for leaf in _leaves(v)]


def cache_bytes(cache) -> int:
    """KV bytes held by any transformers cache, read from its tensors (hfkv, Dynamic, Static, Quantized).

    Baselines are compared on what they hold, the same way ``CacheStats.kv_bytes`` is measured:
    a ``QuantizedCache`` counts its packed codes, scales, shifts and its full-precision residual.
    """
    if hasattr(cache, "stats") and hasattr(cache, "config"):
        return int(cache.stats().kv_bytes)
    return held_bytes(t for layer in cache.layers for t in _tensors_of(layer))
