"""Many caches, one prompt: run the model over a long prompt once and fill every cache from what it computed.

A prefill is dense attention whatever the cache (hfkv scores and classifies the prompt *after* computing
its attention exactly), so the prompt's keys, values, last queries and next-token logits are the same for
every cache. On a CPU a 4k-token prompt costs ~30 s and a decode step ~0.15 s, so comparing twenty caches on
RULER is twenty times cheaper when the prompt runs once: :func:`run_prefill` captures what each layer's
attention saw, :func:`fill_from_prefill` puts it into a fresh cache (``TriStateLayer.ingest_prefill`` for
hfkv layers, ``cache.update`` for DynamicCache / QuantizedCache / sliding layers), and :func:`greedy` decodes.
``tests/test_shared_prefill.py`` checks that this is token-identical to ``model.generate`` with the cache.
(:func:`hfkv.evaluation.bench.fill_cache` is another thing: it runs the model's own prefill into a cache.)

The prefill may run in a different dtype than the decode (``run_prefill(prefill_model, ...)`` then
``fill_from_prefill(..., dtype=bf16)``): on a CPU without bf16 matrix units a bf16 prefill is ~4x slower than
fp32, while the cache must hold bf16 tensors for its bytes to mean what they mean on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hfkv.attention.interface import attn_configs
from hfkv.cache import TriStateLayer

CAPTURE = "hfkv_capture"
QUERY_ROWS = 64  # the largest observation window of a preset (diffkv); ingest_prefill checks it suffices

__all__ = ["Prefill", "fill_from_prefill", "greedy", "run_prefill"]


@dataclass
class Prefill:
    """What every layer's attention saw over one prompt (batch 1, no padding)."""

    keys: list[Tensor]  # per layer [1, H, T, D], after RoPE
    values: list[Tensor]
    queries: list[Tensor]  # per layer [1, Hq, min(QUERY_ROWS, T), D]: the prompt's last queries
    scaling: list[float]
    logits: Tensor  # [1, V] fp32, next-token logits after the prompt


_STORE: dict[int, tuple[Tensor, Tensor, Tensor, float]] = {}


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    _STORE[module.layer_idx] = (key, value, query[:, :, -QUERY_ROWS:].clone(), float(scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@contextlib.contextmanager
def _capturing(model: torch.nn.Module) -> Iterator[None]:
    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    before = [(c, c._attn_implementation) for c in attn_configs(model)]
    for c, _ in before:
        c._attn_implementation = CAPTURE
    _STORE.clear()
    try:
        yield
    finally:
        for c, name in before:
            c._attn_implementation = name


@torch.no_grad()
def run_prefill(model: torch.nn.Module, input_ids: Tensor) -> Prefill:
    """One dense forward over ``input_ids [1, T]`` without a cache, capturing each layer's K/V and last queries."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"run_prefill takes one prompt, input_ids [1, T]; got shape {tuple(input_ids.shape)}")
    with _capturing(model):
        out = model(input_ids=input_ids.to(model.device), use_cache=False, logits_to_keep=1)
        layers = sorted(_STORE)
        got = [_STORE[i] for i in layers]
        _STORE.clear()
    text = model.config.get_text_config(decoder=True)
    if layers != list(range(text.num_hidden_layers)):
        raise RuntimeError(f"captured attention of layers {layers}, expected all {text.num_hidden_layers}")
    return Prefill(
        keys=[g[0] for g in got],
        values=[g[1] for g in got],
        queries=[g[2] for g in got],
        scaling=[g[3] for g in got],
        logits=out.logits[:, -1].float(),
    )


def fill_from_prefill(cache, prefill: Prefill, dtype: torch.dtype | None = None):
    """Put a captured prompt into an empty cache, as the prefill forward of ``generate`` would have."""
    if len(cache.layers) != len(prefill.keys):
        raise ValueError(f"cache has {len(cache.layers)} layers, the prefill {len(prefill.keys)}")
    for i, layer in enumerate(cache.layers):
        k, v, q = prefill.keys[i], prefill.values[i], prefill.queries[i]
        if dtype is not None:
            k, v, q = k.to(dtype), v.to(dtype), q.to(dtype)
        if isinstance(layer, TriStateLayer):
            layer.ingest_prefill(k, v, q, prefill.scaling[i])
        else:
            cache.update(k, v, i)
    return cache


@torch.no_grad()
def greedy(
    model: torch.nn.Module,
    cache,
    prefill: Prefill,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy continuation of a filled cache: the first token from the prefill's logits, then one decode step
    per token; ends after an EOS id (returned, as ``generate`` returns it), after ``max_new_tokens``, or when
    ``stop(tokens so far)`` is true (checked after each token)."""
    eos = {int(e) for e in eos_ids}
    out: list[int] = []
    nxt = int(prefill.logits[0].argmax())
    device = model.device
    for step in range(max_new_tokens):
        out.append(nxt)
        if nxt in eos or step + 1 == max_new_tokens or (stop is not None and stop(out)):
            break
        logits = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=cache, use_cache=True).logits
        nxt = int(logits[0, -1].float().argmax())
    return out
