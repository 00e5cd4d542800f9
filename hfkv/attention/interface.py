"""Hooking hfkv into transformers' attention: a compressing layer's attention call is handed to it, every other
call runs the model's own implementation, unchanged.

transformers never passes the cache to the attention function, so a compressing cache layer announces itself in
``update()`` (hfkv.layer.handoff) and the attention call that follows takes it. Every model's attention looks its
function up with ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, default)``; :func:`install`
makes that lookup return the model's own function wrapped in :func:`dispatch`. With nothing pending — DynamicCache,
StaticCache, no cache, sliding layers kept uncompressed, the ``full`` preset, a layer held dense — the wrapped
function is called with the arguments the model passed: bit for bit what it computed without hfkv, and traceable
by Dynamo (``torch.compile(fullgraph=True)``).

Why not an attention implementation of hfkv's own, as before: switching a model to it outlived the cache (a model
compiled later with a DynamicCache still ran it), and transformers accepts ``config.output_attentions = True`` only
under "eager". The model now keeps its implementation, eager included (docs/architecture.md, "Attention").
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from hfkv.layer.handoff import pending, set_pending
from hfkv.layer.masks import mask_rows

__all__ = ["dispatch", "enable", "hfkv_attention", "install", "is_enabled", "pending", "set_pending"]

_LOOKUP = AttentionInterface.get_interface  # transformers' own lookup, which the installed one wraps
_WRAPPED: dict[Any, functools.partial] = {}  # the model's function -> it wrapped in dispatch (one object each)


def dispatch(original, module, query, key, value, attention_mask, *args, **kwargs):
    """A model's attention call: the pending compressing layer attends, else ``original`` (the model's own) does."""
    layer = pending()
    if layer is None:
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    set_pending(None)
    stepped = layer.take_stepped()
    if stepped is not None:
        return _step_through(layer, stepped, original, module, query, attention_mask, *args, **kwargs)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layer.attends_densely():  # held as DynamicCache holds it: the model's own attention is DynamicCache's
        out, weights = original(module, query, key, value, attention_mask, *args, **kwargs)
        # attend() returns ``out`` itself (hfkv.graphs' capture returns where its replay writes)
        return layer.attend(module, query, key, value, attention_mask, scaling, computed=out), weights
    # A layer attending over its tiers materialises no probabilities: they are built only when asked for.
    if not (kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False)):
        return layer.attend(module, query, key, value, attention_mask, scaling), None
    weights, values = layer.attention_weights(query, attention_mask, scaling)
    out = layer.attend(module, query, key, value, attention_mask, scaling)
    if torch.is_grad_enabled() and query.requires_grad:  # gradients reach the weights (retain_grad) through it
        out = (weights @ values.to(weights.dtype)).transpose(1, 2).contiguous()
    return out, weights


def _step_through(layer, stepped, original, module, query, attention_mask, *args, **kwargs):
    """A chunk a layer recording its past attends a token at a time (hfkv.layer.rollback): each token through the
    layer's update() and this dispatch, as greedy decoding's steps would; the outputs joined as the chunk's, the
    weights (where asked for) zero past each token's own position."""
    keys, values = stepped
    q, start = query.shape[2], layer.get_seq_length()
    outs, weights = [], []
    for t in range(q):
        k, v = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        mask = mask_rows(attention_mask, t, t + 1, start + t + 1)
        out, w = dispatch(original, module, query[:, :, t : t + 1], k, v, mask, *args, **kwargs)
        outs.append(out)
        weights.append(w)
    if any(w is None for w in weights):
        return torch.cat(outs, 1), None
    return torch.cat(outs, 1), torch.cat([F.pad(w, (0, start + q - w.shape[-1])) for w in weights], 2)


def hfkv_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """:func:`dispatch` over SDPA: a step driven by hand (benchmarks, tests) calls this after ``cache.update``."""
    return dispatch(sdpa_attention_forward, module, query, key, value, attention_mask, *args, **kwargs)


def _lookup(self: AttentionInterface, attn_implementation: str, default):
    fn = _LOOKUP(self, attn_implementation, default)
    wrapped = _WRAPPED.get(fn)
    if wrapped is None:
        wrapped = _WRAPPED[fn] = functools.partial(dispatch, fn)
    return wrapped


def install() -> None:
    """Route every model's attention lookup through :func:`dispatch` (idempotent; done by every TriStateCache)."""
    if not is_enabled():
        ALL_ATTENTION_FUNCTIONS.get_interface = types.MethodType(_lookup, ALL_ATTENTION_FUNCTIONS)


def enable(model: torch.nn.Module | None = None) -> torch.nn.Module | None:
    """:func:`install`, kept for code written when a cache switched its model: the model keeps its attention
    implementation. Returns ``model`` for chaining."""
    install()
    return model


def is_enabled(model_or_config: Any = None) -> bool:
    """Whether attention calls reach hfkv's dispatch (for every model: the argument is accepted and not needed)."""
    current = ALL_ATTENTION_FUNCTIONS.__dict__.get("get_interface")
    return getattr(current, "__func__", None) is _lookup


def attn_configs(model: torch.nn.Module):
    """Every distinct config object of ``model`` that names an attention implementation (sub-configs too)."""
    seen = set()
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            yield cfg
