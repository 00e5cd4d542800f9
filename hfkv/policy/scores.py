"""Significance scores of cached tokens (docs/architecture.md, "Life of a token").

A token's significance (per batch row b, layer l, KV head h) is the mean attention probability it
has received from the queries that have seen it. Query heads of a GQA group are first reduced to
one value per KV head (``max`` as in DiffKV, ``mean`` or ``l2`` as in KV-Compress), then summed
over the observing queries. The cache stores the *sum* and the number of observations, so that

    mean score = score_sum / count.

**Prefill.** Only the last ``w = min(obs_window, T)`` queries (the observation window, at logical
positions ``T0 - w .. T0 - 1``) are used, and their probabilities are computed without
materialising the full ``T x T`` attention matrix (:func:`observation_probs`: ``w x T_k`` logits per
head). :func:`token_scores` turns them into per-KV-head sums and :func:`observation_counts` gives
the matching counts: key ``j`` has been seen by ``min(w, T0 - j)`` of the window queries.

**Decode.** Every decode step adds one GQA-reduced probability per stored token to its sum (the
hfkv attention function emits the probabilities as a by-product of computing attention), and the
count of every token grows by one. The count therefore never needs to be stored: for a token at
logical position ``pos`` of a layer whose prefill had ``T0`` tokens and observation window ``w``,
with ``N`` the current logical length (prompt + generated tokens seen so far),

    count = N - max(pos, T0 - w).

(Generated tokens, ``pos >= T0``, are observed by their own query and every later one.)

**ARKV variance term** (eq. 9, ``S = mu + gamma * sigma^2``): with ``gamma > 0`` the prefill sum
also receives ``gamma * var * count``, where ``var`` is the population variance of the raw
probabilities over (query heads of the group) x (observing queries). Dividing by the count gives
``mu + gamma * var`` at prefill; decode steps only add plain probabilities.

**Pooling** (SnapKV/ARKV use kernel 5): an average over neighbouring key positions, stride 1,
padding ``kernel // 2``, ``count_include_pad=False``, same length as the input.

Everything here is pure torch, device agnostic and free of Python loops over heads or tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "GQA_REDUCTIONS",
    "carry_forward",
    "observation_counts",
    "observation_probs",
    "observation_shape",
    "reduce_gqa",
    "smooth_scores",
    "token_scores",
]

GQA_REDUCTIONS = ("max", "mean", "l2")


def _group_size(num_query_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_query_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} must be positive and divide the number of query heads ({num_query_heads})"
        )
    return num_query_heads // num_kv_heads


def reduce_gqa(x: Tensor, num_kv_heads: int, how: str) -> Tensor:
    """Reduce the query heads of each GQA group to one value per KV head.

    ``x`` is ``[B, Hq, ...]``. Following the transformers ``repeat_kv`` convention, query heads
    ``h*g .. (h+1)*g - 1`` (``g = Hq // Hkv``) share KV head ``h``. Returns ``[B, Hkv, ...]``:

    - ``"max"``: the largest value of the group (DiffKV);
    - ``"mean"``: the arithmetic mean;
    - ``"l2"``: the root mean square ``sqrt(mean(x**2))``, i.e. the L2 norm divided by ``sqrt(g)``,
      so that it is on the same scale as ``mean`` and ``max`` (``mean <= l2 <= max`` for
      non-negative inputs, all equal when ``g == 1``).

    One reshape and one reduction (no copy when ``x`` is contiguous).
    """
    if x.dim() < 2:
        raise ValueError(f"reduce_gqa expects [B, Hq, ...], got shape {tuple(x.shape)}")
    g = _group_size(x.shape[1], num_kv_heads)
    grouped = x.unflatten(1, (num_kv_heads, g))
    if how == "max":
        return grouped.amax(dim=2)
    if how == "mean":
        return grouped.mean(dim=2)
    if how == "l2":
        return grouped.square().mean(dim=2).sqrt()
    raise ValueError(f"unknown GQA reduction {how!r}; expected one of {GQA_REDUCTIONS}")


def _allowed_from_mask(mask: Tensor, w: int, t_k: int) -> tuple[Tensor, Tensor | None]:
    """Last ``w`` query rows and first ``t_k`` key columns of a mask.

    Returns ``(allowed, bias)``: a boolean ``[.., .., w, t_k]`` tensor and, for a floating
    (additive) mask, the finite additive bias on the allowed entries (else None).
    """
    if mask.dim() != 4:
        raise ValueError(f"attention mask must be 4-D [B, 1, T, T_k], got shape {tuple(mask.shape)}")
    if mask.shape[-1] < t_k:
        raise ValueError(f"attention mask has {mask.shape[-1]} key columns, fewer than the {t_k} keys")
    m = mask[..., :t_k]
    if m.shape[-2] != 1:
        m = m[..., m.shape[-2] - w :, :]
    if m.dtype == torch.bool:
        return m, None
    # Additive float mask (0 / bias on allowed entries, -inf or dtype-min on masked ones).
    allowed = m > torch.finfo(m.dtype).min / 2
    bias = torch.where(allowed, m.float(), torch.zeros((), dtype=torch.float32, device=m.device))
    return allowed, bias


def observation_probs(
    query: Tensor,
    key: Tensor,
    scaling: float,
    mask: Tensor | None,
    obs_window: int,
) -> Tensor:
    """fp32 attention probabilities of the last ``w = min(obs_window, T)`` queries.

    Args:
        query: ``[B, Hq, T, D]``; the queries are the last ``T`` positions of the keys.
        key: ``[B, Hkv, T_k, D]`` un-repeated (GQA) keys, ``T_k >= T``.
        scaling: softmax scale (usually ``D ** -0.5``).
        mask: ``None`` for pure causal attention (query ``i`` of the window sits at key position
            ``T_k - w + i`` and sees keys ``<= T_k - w + i``), or a boolean ``[B, 1, T, T_k]``
            mask (True = may attend), possibly broadcastable in its first two dims and/or a
            slice of a wider mask (extra key columns on the right are ignored, as SDPA does). The
            given mask is used as is (it must contain the causal structure). A floating mask is
            treated as additive (entries at or below half the dtype minimum count as masked).
        obs_window: size of the observation window.

    Returns:
        ``[B, Hq, w, T_k]`` fp32 probabilities. Only ``w x T_k`` logits per head are
        materialised. Rows whose keys are all masked (left padding) are all zeros, never NaN.
    """
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            f"expected query [B, Hq, T, D] and key [B, Hkv, T_k, D], got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    b, hq, t, d = query.shape
    hkv, t_k = key.shape[1], key.shape[2]
    if t_k < t:
        raise ValueError(f"key length {t_k} is shorter than query length {t}")
    g = _group_size(hq, hkv)
    w = max(0, min(int(obs_window), t))

    # [B, Hq, w, D] -> [B, Hkv, g*w, D]: the g query heads of a group become extra rows, so the
    # un-repeated keys are used directly (no repeat_kv copy).
    # Scaled before the product: a pass over the w x T_k logits fewer (at 32k x 8 they are 1 GB a layer).
    q = (query[:, :, t - w :, :].to(torch.float32) * scaling).reshape(b, hkv, g * w, d)
    logits = torch.matmul(q, key.to(torch.float32).transpose(-1, -2))  # [B, Hkv, g*w, T_k]
    logits = logits.view(b, hq, w, t_k)

    if mask is None:
        qpos = torch.arange(t_k - w, t_k, device=query.device).unsqueeze(-1)
        allowed = torch.arange(t_k, device=query.device) <= qpos  # [w, T_k]
    else:
        allowed, bias = _allowed_from_mask(mask.to(query.device), w, t_k)
        if bias is not None:
            logits += bias
    logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # Fully masked rows give NaN in softmax; make them zeros.
    return probs.masked_fill_(~allowed.any(dim=-1, keepdim=True), 0.0)


def observation_shape(
    query: Tensor, key: Tensor, obs_window: int, reduction: str, where: str
) -> tuple[int, int, int, int, int, int]:
    """``(B, H, T, Tq, group, w)`` of an observation-window scores call (``query [B, Hq, Tq, D]``, ``key [B, H, T,
    D]``, ``T >= Tq``, the window the last ``w = min(obs_window, Tq)`` queries), the arguments checked by name for
    ``where`` (each backend's kernel wrapper)."""
    if reduction not in GQA_REDUCTIONS:
        raise ValueError(f"unknown GQA reduction {reduction!r}; expected one of {GQA_REDUCTIONS}")
    bsz, hq, tq, dim = query.shape
    heads, t = key.shape[1], key.shape[2]
    if hq % heads or t < tq or key.shape[3] != dim or key.shape[0] != bsz:
        raise ValueError(f"{where}: query {tuple(query.shape)} and key {tuple(key.shape)} do not match")
    return bsz, heads, t, tq, hq // heads, max(0, min(int(obs_window), tq))


def observation_counts(t_k: int, w: int, device: torch.device | str | None = None) -> Tensor:
    """``[T_k]`` int64: how many of the last ``w`` queries have seen each key.

    The window queries sit at positions ``T_k - w .. T_k - 1``; key ``j`` is seen by those at
    position ``>= j``: ``count_j = T_k - max(j, T_k - w) = min(w, T_k - j)``.
    """
    w = max(0, min(int(w), int(t_k)))
    j = torch.arange(int(t_k), device=device, dtype=torch.int64)
    return int(t_k) - torch.clamp(j, min=int(t_k) - w)


def token_scores(
    probs: Tensor,
    num_kv_heads: int,
    reduction: str = "max",
    gamma: float = 0.0,
    pool_kernel: int = 1,
    carry: float = 0.0,
) -> Tensor:
    """Per-KV-head score *sums* ``[B, Hkv, T_k]`` (fp32) from observation-window probabilities.

    ``probs`` is ``[B, Hq, w, T_k]`` from :func:`observation_probs`. The result is

    ``sum_q reduce_gqa(probs)[b, h, q, j]``  (+ ``gamma * var_j * count_j`` if ``gamma > 0``)

    where the reduction over the query heads of a group happens first, then the sum over the
    ``w`` window queries (causally masked pairs have probability 0, so this equals the sum over
    the observing queries), ``count_j`` is :func:`observation_counts` and ``var_j`` the population
    variance of the raw probabilities over the ``g * count_j`` (query head, observing query)
    pairs of the group. Divided by ``count_j``, this is ARKV's ``mu + gamma * sigma^2`` (eq. 9).

    If ``pool_kernel > 1`` the result is average-pooled over neighbouring key positions
    (stride 1, padding ``pool_kernel // 2``, ``count_include_pad=False``, output cut to ``T_k`` for
    even kernels); then carried forward (:func:`smooth_scores`).
    """
    if probs.dim() != 4:
        raise ValueError(f"probs must be [B, Hq, w, T_k], got shape {tuple(probs.shape)}")
    _check_smoothing(pool_kernel, carry)
    b, hq, w, t_k = probs.shape
    g = _group_size(hq, num_kv_heads)
    probs = probs.to(torch.float32)
    out = reduce_gqa(probs, num_kv_heads, reduction).sum(dim=2)  # [B, Hkv, T_k]

    if gamma > 0 and w > 0 and t_k > 0:
        count = observation_counts(t_k, w, probs.device).to(torch.float32)  # [T_k], >= 1
        qpos = torch.arange(t_k - w, t_k, device=probs.device).unsqueeze(-1)
        observed = torch.arange(t_k, device=probs.device) <= qpos  # [w, T_k]
        grouped = probs.unflatten(1, (num_kv_heads, g)) * observed  # [B, Hkv, g, w, T_k]
        n = g * count
        mean = grouped.sum(dim=(2, 3)) / n  # [B, Hkv, T_k]
        dev = (grouped - mean[:, :, None, None, :]) * observed
        var = dev.square().sum(dim=(2, 3)) / n
        out = out + gamma * var * count
    return smooth_scores(out, w, pool_kernel, carry)


def _check_smoothing(pool_kernel: int, carry: float) -> None:
    if pool_kernel < 1:
        raise ValueError(f"pool_kernel must be >= 1, got {pool_kernel}")
    if not 0 <= carry < 1:
        raise ValueError(f"carry must be a decay in [0, 1), got {carry}")


def smooth_scores(sums: Tensor, w: int, pool_kernel: int = 1, carry: float = 0.0) -> Tensor:
    """The pooling and carry of :func:`token_scores` on sums ``[B, Hkv, T_k]`` observed by ``w`` window queries
    (apart, so a kernel that computes the sums without the probabilities shares them)."""
    _check_smoothing(pool_kernel, carry)
    b, h, t_k = sums.shape
    out = sums
    if pool_kernel > 1 and t_k > 0:
        flat = out.reshape(b * h, 1, t_k)
        pooled = F.avg_pool1d(flat, pool_kernel, stride=1, padding=pool_kernel // 2, count_include_pad=False)
        out = pooled[..., :t_k].reshape(b, h, t_k)
    if carry > 0 and t_k > 0:
        out = carry_forward(out, observation_counts(t_k, w, sums.device), carry)
    return out


CARRY_UNFOLD_MAX = 1 << 26  # elements of carry_forward's windows (256 MB of fp32) past which it shifts instead
CARRY_FLOOR = 1e-2  # carried shares below this are dropped: the span a score reaches is log(0.01) / log(decay)


def carry_span(decay: float) -> int:
    """How many following tokens a score reaches with ``decay`` per token (0: none)."""
    if decay <= 0:
        return 0
    if decay >= 1:
        raise ValueError(f"carry decay must be < 1, got {decay}")
    return max(1, int(math.floor(math.log(CARRY_FLOOR) / math.log(decay))))


def carry_forward(sums: Tensor, count: Tensor, decay: float) -> Tensor:
    """Each token's mean score raised to ``decay ** d`` times the mean of the token ``d`` places before it (the
    largest over ``d``); returned as sums.

    A model that copies a span (the digits of a retrieved number, the value after a key) reads each token
    of it right after the one before, while a question attends only to where the span starts: the tokens that
    follow a heavy hitter inherit a decaying share of its significance so that they are kept with it. A
    geometric share keeps what follows a strong hitter (a needle's key, far above its neighbours) and barely
    lifts what follows the many moderate ones of a list. Means, not sums, are compared (a token inside the
    observation window has fewer observations).
    """
    span = carry_span(decay)
    t = sums.shape[-1]
    if span == 0 or t < 2:
        return sums
    c = count.to(sums.dtype).clamp(min=1)
    mean = sums / c
    n = min(span, t - 1)
    shares = [1.0]
    for _ in range(n):  # decay ** d by repeated products, each then an fp32 factor as a scalar operand would be
        shares.append(shares[-1] * decay)
    if mean.numel() * (n + 1) <= CARRY_UNFOLD_MAX:
        # One pass over windows of the n + 1 tokens ending at each token (a GPU prefill paid three launches per
        # shift, ~60 a layer): window element k is the token d = n - k places before, -inf before the first.
        factor = torch.tensor(shares[::-1], dtype=mean.dtype, device=mean.device)
        windows = F.pad(mean, (n, 0), value=float("-inf")).unfold(-1, n + 1, 1)  # [..., T, n + 1]
        return (windows * factor).amax(-1) * c
    out = mean.clone()
    for d in range(1, n + 1):  # a few shifts of the whole [B, H, T] tensor, not a loop over tokens
        out[..., d:] = torch.maximum(out[..., d:], mean[..., :-d] * shares[d])
    return out * c


def score_means(sums: torch.Tensor, pos: torch.Tensor, mean_over: tuple[int, int] | None) -> torch.Tensor:
    """Score sums as means over the queries that saw each token (``mean_over=(length, score_start)``), or as is."""
    if mean_over is None:
        return sums
    length, score_start = mean_over
    return sums / (length - torch.clamp(pos, min=score_start)).clamp_min(1)
