"""torch.export support for TriStateCache, as transformers gives DynamicCache
(``transformers.integrations.executorch.register_dynamic_cache_export_support``).

torch.export takes a cache as a pytree: the tensors it holds, plus a context that rebuilds it around traced ones. An
uncompressed cache (the ``full`` preset) holds DynamicCache's layers, so it flattens to the same ``key_cache`` /
``value_cache`` lists and the same layout (each layer's sliding window). A compressing layer does not: its tokens
live in a pool of pages whose tables, tags and scores change shape at every policy run, and the policy runs on the
host between steps. An exported program of a compressing cache would need that storage at a fixed capacity
(StaticCache's model: a pool and tables sized for the budget at export time) and the policy as an exported function
of its own; until then flattening one raises, saying so. Registered for TriStateCache and each subclass
(``TriStateCache.__init_subclass__``): pytree looks nodes up by their exact type.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

_KEYS = ("key_cache", "value_cache")


def _check(cache: Any) -> None:
    if cache.config.compress:
        raise RuntimeError(
            f"torch.export takes TriStateCache with the uncompressed 'full' preset, not {cache.config.name!r}: a "
            "compressing layer's pages, tables and scores change shape at every policy run (hfkv.export)"
        )


def _tensors(cache: Any) -> tuple[list[list[torch.Tensor]], list[int | None]]:
    _check(cache)
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    layout = [getattr(layer, "sliding_window", None) for layer in cache.layers]
    return [[layer.keys for layer in layers], [layer.values for layer in layers]], layout


def _flatten(cache: Any):
    values, layout = _tensors(cache)
    return values, (_KEYS, layout)


def _flatten_with_keys(cache: Any):
    values, layout = _tensors(cache)
    return [(pytree.MappingKey(k), v) for k, v in zip(_KEYS, values, strict=True)], (_KEYS, layout)


def _flatten_spec(cache: Any, spec: pytree.TreeSpec) -> list:
    values, layout = _tensors(cache)
    if layout != spec.context[1]:
        raise ValueError(f"TriStateCache layout {layout} does not match the exported layout {spec.context[1]}")
    return values


def _unflatten(cls: type, base: type, values, context) -> Any:
    keys, values_ = values
    cache = cls.__new__(cls)
    base.__init__(cache, None, "full")  # the subclass's own __init__ may take other arguments
    cache.layers = [
        DynamicSlidingWindowLayer(sliding_window=window) if window is not None else DynamicLayer()
        for window in context[1]
    ]
    for layer, k, v in zip(cache.layers, keys, values_, strict=False):  # layers past the data stay empty
        layer.update(k, v)
    return cache


def register(cls: type, base: type) -> None:
    """Register ``cls`` (TriStateCache or a subclass of it, ``base``) with torch's pytree for torch.export."""
    if cls in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        cls,
        _flatten,
        lambda values, context: _unflatten(cls, base, values, context),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=_flatten_with_keys,
    )
    torch.fx._pytree.register_pytree_flatten_spec(cls, _flatten_spec)
