"""Hooking hfkv into transformers' attention and mask registries.

transformers never passes the cache to the attention function, so a compressing cache layer
announces itself in ``update()`` (hfkv.layer.handoff) and the ``"hfkv"`` attention function of
the same layer takes it. Anything else — DynamicCache, no cache (lm-eval
loglikelihood), sliding layers kept uncompressed, the ``full`` preset — finds nothing pending
and runs the model's previous implementation unchanged, with the mask that implementation
would have built. That keeps ``full`` token-identical to DynamicCache.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hfkv.layer.handoff import pending, set_pending, take_mask_request

NAME = "hfkv"

# id(config) -> the attention implementation the model had before hfkv.enable().
_DELEGATES: dict[int, str] = {}


def _delegate_name(config: Any) -> str:
    return _DELEGATES.get(id(config), "sdpa") if config is not None else "sdpa"


def _delegate_attention(module, query, key, value, attention_mask, **kwargs):
    name = _delegate_name(getattr(module, "config", None))
    boolean_4d = isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
    if name == "eager" and not boolean_4d:
        # Use the model's own eager function so results are bit-identical to running without hfkv.
        fn = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn(module, query, key, value, attention_mask, **kwargs)
    if name not in ("sdpa", "eager") and not boolean_4d and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name](module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def hfkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"hfkv"`` attention function: a pending compressing layer computes, else the delegate does."""
    layer = pending()
    if layer is None:
        return _delegate_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    set_pending(None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(module, query, key, value, attention_mask, scaling), None


def hfkv_mask(*args, **kwargs):
    """The ``"hfkv"`` mask: never skipped, boolean, logical coordinates — only when a compressing layer asks."""
    request = take_mask_request()
    if request:
        if request == "materialised":
            kwargs["allow_is_causal_skip"] = False
            kwargs["allow_is_bidirectional_skip"] = False
        return sdpa_mask(*args, **kwargs)
    name = _delegate_name(kwargs.get("config"))
    fn = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
    return fn(*args, **kwargs)


def _register() -> None:
    AttentionInterface.register(NAME, hfkv_attention)
    AttentionMaskInterface.register(NAME, hfkv_mask)


def attn_configs(model: torch.nn.Module):
    """Every distinct config object of ``model`` that names an attention implementation (sub-configs too)."""
    seen = set()
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            yield cfg


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` to hfkv attention, remembering its previous implementation as the delegate.

    Idempotent. Returns the model for chaining.
    """
    _register()
    for cfg in attn_configs(model):
        current = cfg._attn_implementation
        if current != NAME:
            _DELEGATES[id(cfg)] = current or "sdpa"
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    # Sub-configs (e.g. a text config inside a multimodal one) may be separate objects.
    for cfg in attn_configs(model):
        if cfg._attn_implementation != NAME:
            cfg._attn_implementation = NAME
    return model


def is_enabled(model_or_config: Any) -> bool:
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "_attn_implementation", None) == NAME
