"""Each layer's share of a cache's room, from every layer's scores of one context (``TriStateConfig.layer_adaptive``).

Why: layers read a context very unequally. Asked to repeat a 4k-token document, SmolLM2-135M's reconstruction scores
put most of the context's highest-scored tokens in a third of its 30 layers (7, 14, 17, 18, 20, 23 and their
neighbours), while an even split gives every layer the same room. KVzip ranks its scores across layers and heads
together; hfkv keeps its per-layer tiers and budget arithmetic and moves only the room: a layer gets the share of the
context's top-scored tokens (over every layer, row, head and token, as many as an even split would keep exact) that
falls in it. Bounds keep every layer some room (a layer that scores low still serves the question's own tokens) and
no layer most of it; the total never exceeds the even split's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SHARE_BOUNDS", "layer_shares"]

# A layer's room is kept between a quarter and four times an even split's.
SHARE_BOUNDS = (0.25, 4.0)


def layer_shares(scores: Sequence[torch.Tensor], kept: int, bounds: tuple[float, float] = SHARE_BOUNDS) -> list[float]:
    """Room shares, one per layer of ``scores`` (each ``[B, H, T]``, on one scale across layers: a softmax
    probability each, as reconstruction scores are), averaging at most 1 over the layers' rows and heads.

    ``kept``: the tokens an even split keeps exact per row and head. The ``kept`` x (rows x heads) highest scores of
    all layers are counted per layer (``c_l`` per row and head); a layer's share is ``clamp(x * c_l, *bounds)`` with
    ``x`` the one that makes the mean 1 (water-filling). Where even the largest ``x`` leaves it below 1 (the top
    scores all in a few layers that reach the upper bound) the rest of the room is left unused."""
    if not scores:
        raise ValueError("layer_shares: no layer's scores given")
    lo, hi = bounds
    if not 0 < lo <= 1 <= hi:
        raise ValueError(f"layer_shares: bounds={bounds!r} must satisfy 0 < low <= 1 <= high")
    if kept < 1:
        raise ValueError(f"layer_shares: kept={kept!r} must be >= 1")
    rows = [s[..., 0].numel() for s in scores]  # rows x heads per layer
    flat = torch.cat([s.detach().float().flatten() for s in scores])
    k = min(flat.numel(), kept * sum(rows))
    bar = flat.kthvalue(flat.numel() - k + 1).values  # the k-th largest score
    counts = torch.stack([(s >= bar).sum() for s in scores]).tolist()  # one host read
    per = [c / r for c, r in zip(counts, rows, strict=True)]

    def shares(x: float) -> list[float]:
        return [min(max(x * p, lo), hi) for p in per]

    def mean(x: float) -> float:
        return sum(s * r for s, r in zip(shares(x), rows, strict=True)) / sum(rows)

    top = hi / min(p for p in per if p > 0)  # every counted layer at the upper bound
    if mean(top) <= 1:
        return shares(top)
    a, b = 0.0, top  # mean(a) <= 1 < mean(b); the mean grows with x
    for _ in range(64):
        a, b = ((a + b) / 2, b) if mean((a + b) / 2) <= 1 else (a, (a + b) / 2)
    return shares(a)
