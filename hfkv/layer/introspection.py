"""What a layer holds, as people and reports read it: per-position states and scores, statistics, held tensors.

Why a module of its own: none of this is on the decode path. It rebuilds maps over the logical sequence from the
storage (window positions, tier slot positions, score sums) for hfkv.inspect, notebooks and ``cache.stats()``,
and it counts from exactly what the layer holds, so the maps and the statistics agree with each other (padding
still in the window is WINDOW in both). A layer holding its sequence dense (hfkv.layer.dense) reports every real token
exact and its left padding evicted, and holds no window or tiers. Functions of the layer: they read it and change
nothing.
"""

from __future__ import annotations

import torch

from hfkv.quant.rotation import rotate
from hfkv.states import EVICTED, MID, ORIGINAL, QUANTIZED, TIER_NAMES, WINDOW
from hfkv.stats import LayerStats
from hfkv.storage import dense_kv_bytes, held_bytes


def describe(layer) -> str:
    """The layer's ``repr``: its counts per place."""
    if not layer.is_initialized or (layer.window is None and not layer.dense.active):
        return f"TriStateLayer({layer.layer_idx}, empty)"
    if layer.dense.active:
        return f"TriStateLayer({layer.layer_idx}, len={layer.length}, dense, all exact, backend={layer.backend})"
    c = layer.tiers.counts.sum((0, 1)).tolist()
    mid = f"mid={c[MID]}, " if layer.cfg.uses_mid_tier() else ""
    return (
        f"TriStateLayer({layer.layer_idx}, len={layer.length}, window={layer.window.count}, "
        f"original={c[ORIGINAL]}, {mid}quantized={c[QUANTIZED]}, backend={layer.backend})"
    )


def held_tensors(layer) -> list[torch.Tensor]:
    if not layer.is_initialized:
        return []
    stored = [*layer.window.held_tensors(), *layer.tiers.held_tensors()] if layer.window is not None else []
    return [*layer.dense.held_tensors(), *stored]


def held_kv(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, values, held)``: keys and values ``[B, H, logical length, D]`` in the layer's dtype, every held token at
    its position as attention reads it (dequantized, rotated back), evicted positions zero; ``held [B, H, length]``
    where a token is held. A chunk's window exits, between update() and attention, are held.

    Why: code written for DynamicCache reads ``layer.keys`` (shapes, dtypes, a look at the values), and
    ``output_attentions`` asks for weights over every position; a stored layer holds pages, so this is a copy built
    on each read, a full-length tensor the cache does not keep (nor count in its memory).
    """
    bsz, heads, dim = layer.kv_shape
    keys = torch.zeros(bsz, heads, layer.length, dim, dtype=layer.dtype, device=layer.device)
    values = torch.zeros_like(keys)
    held = torch.zeros(bsz, heads, layer.length, dtype=torch.bool, device=layer.device)
    if layer.window is None:  # reset, nothing held yet
        return keys, values, held
    tiers, window = layer.tiers, layer.window
    for tier in range(tiers.num_tiers):
        pos, _, valid = tiers.read_meta(tier)
        b, h, s = valid.nonzero(as_tuple=True)
        k, v, p, _ = tiers.gather_decoded(tier, b, h, s)
        keys[b, h, p], values[b, h, p], held[b, h, p] = k.to(layer.dtype), v.to(layer.dtype), True
    live = window.pos >= 0
    parts = [(window.k[:, :, live], window.v[:, :, live], window.pos[live])]
    if layer._exits is not None:
        parts.append(layer._exits[:3])
    for k, v, p in parts:
        keys[:, :, p], values[:, :, p], held[:, :, p] = k, v, True
    if layer.rotation is not None:  # stored rotated (TriStateLayer.update); the rotation is its own inverse
        keys, values = rotate(keys, layer.rotation), rotate(values, layer.rotation)
    return keys, values, held


def attention_weights(
    layer, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, values)``: the softmax ``[B, Hq, q, logical length]`` a chunk's queries (``query`` as the model made
    it, not rotated) give every position, zero where a token is not held, as eager attention returns them
    (``output_attentions``), and the values ``[B, Hq, length, D]`` they weigh (as held, repeated per query head).

    Called between update() and attention: a prompt is attended densely over its own keys, a later chunk over what
    the layer holds, its new tokens and window exits included (:func:`held_kv`)."""
    k, v, _ = layer._chunk
    if layer.length == k.shape[2]:  # a prompt
        keys, values = (k, v) if layer.rotation is None else (rotate(k, layer.rotation), rotate(v, layer.rotation))
        held = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
    else:
        keys, values, held = held_kv(layer)
    q, total = query.shape[2], keys.shape[2]
    g = query.shape[1] // keys.shape[1]
    logits = query.float() @ keys.float().repeat_interleave(g, 1).transpose(-1, -2) * scaling
    allowed = held.repeat_interleave(g, 1)[:, :, None, :]
    if mask is None:  # plain causal
        pos = torch.arange(total, device=keys.device)
        allowed = allowed & (pos[None, :] <= pos[total - q :, None])
    else:
        allowed = allowed & mask[..., :total]
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0).to(query.dtype)
    return weights, values.repeat_interleave(g, 1)


def token_states(layer) -> torch.Tensor:
    """``[B, H, logical length]`` int8 state of every logical position (``hfkv.states``; WINDOW = -1).

    Built from what the layer holds (window positions, tier slot positions), so its counts are
    the counts of :func:`layer_stats`: padding still in the window is WINDOW, like there.
    """
    if not layer.is_initialized:
        return torch.zeros(0, 0, 0, dtype=torch.int8)
    if layer.dense.active:
        return layer.dense.token_states().cpu()
    if layer.window is None:  # reset, nothing held yet
        return torch.zeros(*layer.kv_shape[:2], 0, dtype=torch.int8)
    tiers, window = layer.tiers, layer.window
    bsz, heads = tiers.counts.shape[:2]
    out = torch.full((bsz, heads, layer.length), EVICTED, dtype=torch.int8, device=layer.device)
    for tier in range(tiers.num_tiers):
        pos, _, valid = tiers.read_meta(tier)
        b, h, s = valid.nonzero(as_tuple=True)
        out[b, h, pos[b, h, s].long()] = tier
    wpos = window.pos[window.pos >= 0]
    out[:, :, wpos] = WINDOW
    return out.cpu()


def token_scores(layer) -> torch.Tensor:
    """``[B, H, logical length]`` fp32 significance the policy sees for every held token (NaN: evicted).

    The policy's own measure: score sums divided by observation counts (``score_mode='mean'``), or, ranking by
    learned retention, each held token's retention among the held ones (hfkv.policy.retention).
    """
    out = _mean_scores(layer)
    if not layer.retention.active or out.numel() == 0:
        return out
    held = ~out.isnan()  # the fields' values here (mean_over is None): what a policy run ranks them by
    pos = torch.arange(out.shape[-1]).expand_as(out)
    ranked = layer.retention.scores(out.nan_to_num(0.0), pos, held, layer.length)
    return ranked.masked_fill(~held, float("nan"))


def _mean_scores(layer) -> torch.Tensor:
    if not layer.is_initialized:
        return torch.zeros(0, 0, 0)
    if layer.dense.active:
        dense = layer.dense
        dense.observe()  # the queries not yet added (what the sums will hold at the next interval anyway)
        pos = torch.arange(layer.length, device=layer.device)
        out = layer.policy.mean_scores(dense.scores, pos)
        return out.masked_fill(~dense.key_valid[:, None], float("nan")).cpu()
    if layer.window is None:
        return torch.zeros(*layer.kv_shape[:2], 0)
    tiers, window, mean_scores = layer.tiers, layer.window, layer.policy.mean_scores
    bsz, heads = tiers.counts.shape[:2]
    out = torch.full((bsz, heads, layer.length), float("nan"), device=layer.device)
    for tier in range(tiers.num_tiers):
        pos, sums, valid = tiers.read_meta(tier)
        b, h, s = valid.nonzero(as_tuple=True)
        p = pos[b, h, s].long()
        out[b, h, p] = mean_scores(sums[b, h, s], p)
    live = window.pos >= 0
    wpos = window.pos[live]
    out[:, :, wpos] = mean_scores(window.score[:, :, live], wpos)
    return out.cpu()


def layer_stats(layer) -> LayerStats:
    if not layer.is_initialized:
        return LayerStats(layer.layer_idx, 0, 0, 0)
    bsz, heads, dim = layer.kv_shape
    if layer.dense.active or layer.window is None:  # every real token exact, none in a window
        real = layer.dense.key_valid.sum(-1).cpu() if layer.dense.key_valid is not None else torch.zeros(bsz)
        counts = torch.zeros(bsz, heads, len(TIER_NAMES), dtype=torch.int64)
        counts[..., ORIGINAL] = real.view(-1, 1).long()
        win = torch.zeros(bsz, heads, dtype=torch.int64)
    else:
        counts = layer.tiers.counts.cpu()
        win = torch.full((bsz, heads), layer.window.count, dtype=torch.int64)
    # Padding inside the window is not a kept token; it sits in the window until it leaves.
    evicted = layer.length - win - counts.sum(-1)
    budget = layer.budget
    return LayerStats(
        layer=layer.layer_idx,
        kv_bytes=held_bytes(layer.held_tensors()),
        dense_bytes=dense_kv_bytes(bsz, heads, layer.length, dim, layer.dtype),
        logical_length=layer.length,
        window=win.tolist(),
        original=counts[..., ORIGINAL].tolist(),
        mid=counts[..., MID].tolist(),
        quantized=counts[..., QUANTIZED].tolist(),
        evicted=evicted.tolist(),
        budget_bytes=budget.cap * bsz * heads if budget.memory_budget else None,
    )
