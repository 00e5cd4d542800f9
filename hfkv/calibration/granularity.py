"""Per-layer and per-head thresholds that a small search can still tune.

A ``[layer][head]`` table of alphas has 2 x layers x heads free values (180 for SmolLM2, 2048 for
Llama-3-8B): far too many for a few dozen Optuna trials. DiffKV compares a token's mean received
attention ``s`` with ``alpha / N``; heads differ in how concentrated their attention is, so the
same alpha quantizes most of a sparse head but only some of a diffuse one. We measure that
difference once, on the calibration data, and let the search decide how much to follow it:

    z[l][h]  = centred median of log(N * s) over the tokens of head (l, h)   (probe, once per study)
    d[l]     = depth of layer l, from -1 (first) to +1 (last)
    alpha_h[l][h] = alpha_h * exp(beta_h * z[l][h] + delta * d[l])
    alpha_l[l][h] = min(alpha_l * exp(beta_l * z[l][h] + delta * d[l]), alpha_h[l][h])

``beta = 0, delta = 0`` is the global policy, so the per-head space contains it. ``beta = 1``
scales each head's threshold with its typical score (every head then quantizes a similar share of
its tokens); ``beta < 0`` exaggerates the differences; ``delta`` tilts thresholds with depth
(PyramidKV-style). ``layer`` granularity uses the head-mean of ``z`` per layer. Five searched
numbers (alpha_h, alpha_l, beta_h, beta_l, delta) whatever the model size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from hfkv import TriStateCache
from hfkv.config import TriStateConfig
from hfkv.states import WINDOW

GRANULARITIES = ("global", "layer", "head")
_FLOOR = 1e-6  # normalised scores below this count as this (log of an evicted-looking token)


def probe_config(base: TriStateConfig) -> TriStateConfig:
    """The base config with nothing quantized or evicted: every token's score stays readable, and the
    scoring settings (reduction, pooling, gamma, window) are the ones the policy will use."""
    return dataclasses.replace(
        base, name="probe", alpha_h=0.0, alpha_l=0.0, budget=None, oq_ratios=False, head_adaptive=False
    )


@torch.inference_mode()
def head_statistics(model, items: Sequence, base: TriStateConfig, chunk: int = 1, progress: bool = False) -> dict:
    """Median of log(N * s) per (layer, KV head) over the non-window tokens of every calibration sequence.

    ``items`` are :class:`hfkv.calibration.objectives.Encoded` (prompt + reference solution). Layers the
    cache does not compress (sliding-window layers) get the overall median (z = 0: the global alpha).
    Returns ``{"median_log_score": [[...]], "tokens": int}``, YAML/JSON-safe for the study's attributes.
    """
    cfg = probe_config(base)
    per_head: dict[tuple[int, int], list[torch.Tensor]] = {}
    n_layers = n_heads = 0
    for it in tqdm(items, desc="head statistics", leave=False, disable=not progress, unit="problem"):
        cache = TriStateCache(model, cfg)
        ids = it.ids.to(model.device)
        model(input_ids=ids[:, : it.prompt_len], past_key_values=cache, use_cache=True)
        for s in range(it.prompt_len, ids.shape[1], chunk):
            model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True)
        n_layers = len(cache.layers)
        for layer in range(n_layers):
            try:
                scores = cache.token_scores(layer)[0]  # [H, N]
                states = cache.token_states(layer)[0]
            except ValueError:  # an uncompressed layer
                continue
            n_heads = scores.shape[0]
            length = scores.shape[1]
            keep = (states != WINDOW) & torch.isfinite(scores)
            for h in range(n_heads):
                x = (scores[h][keep[h]] * length).clamp_min(_FLOOR).log()
                per_head.setdefault((layer, h), []).append(x)
    if not per_head:
        raise ValueError("head statistics: no compressed layer held a token outside the window; use longer problems")
    med = {k: float(torch.cat(v).median()) for k, v in per_head.items()}
    fill = float(torch.tensor(list(med.values())).median())
    table = [[round(med.get((layer, h), fill), 6) for h in range(n_heads)] for layer in range(n_layers)]
    tokens = sum(int(sum(t.numel() for t in v)) for v in per_head.values())
    return {"median_log_score": table, "tokens": tokens}


def centred(stats: dict, granularity: str) -> list[list[float]] | list[float]:
    """z per head (``head``) or per layer (``layer``): the statistic minus its mean over the model."""
    table = torch.tensor(stats["median_log_score"], dtype=torch.float64)
    z = table - table.mean()
    if granularity == "head":
        return z.tolist()
    if granularity == "layer":
        return z.mean(1).tolist()
    raise ValueError(f"--granularity={granularity!r}: centred statistics exist for 'layer' and 'head'")


def _depth(n_layers: int) -> list[float]:
    return [0.0] if n_layers == 1 else [-1.0 + 2.0 * i / (n_layers - 1) for i in range(n_layers)]


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def alpha_tables(
    granularity: str,
    alpha_h: float,
    alpha_l: float,
    stats: dict | None = None,
    beta_h: float = 0.0,
    beta_l: float = 0.0,
    delta: float = 0.0,
) -> tuple:
    """``(alpha_h, alpha_l)`` for the config: scalars (``global``), per-layer lists or [layer][head] tables.

    ``alpha_l <= alpha_h`` holds elementwise by construction (clipped after rounding), so every
    sampled point is a valid config: the constraint costs no trial.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"--granularity={granularity!r} must be one of {GRANULARITIES}")
    if granularity == "global":
        h = _round(alpha_h)
        return h, min(_round(alpha_l), h)
    if stats is None:
        raise ValueError(f"--granularity {granularity} needs the head statistics of the study")
    z = centred(stats, granularity)
    depth = _depth(len(z))

    def pair(zz: float, d: float) -> tuple[float, float]:
        h = _round(alpha_h * math.exp(beta_h * zz + delta * d))
        return h, min(_round(alpha_l * math.exp(beta_l * zz + delta * d)), h)

    if granularity == "layer":
        pairs = [pair(zz, d) for zz, d in zip(z, depth, strict=True)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    rows = [[pair(zz, d) for zz in row] for row, d in zip(z, depth, strict=True)]
    return [[p[0] for p in r] for r in rows], [[p[1] for p in r] for r in rows]
