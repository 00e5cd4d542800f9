"""A prompt's observation-window scores without its probabilities: two launches instead of ~90.

At prefill the policy needs, from the last ``w`` queries' attention over the prompt's ``T`` keys, each KV head's
score sums (the query heads of a group reduced, the ``w`` queries summed) and, for ARKV's OQ statistics, the
mass each key received over all heads and queries. The torch path (:func:`hfkv.policy.observation_probs`, then
:func:`hfkv.policy.token_scores` and the sum in :func:`hfkv.policy.oq.oq_score`) materialises the ``[B, Hq, w,
T]`` fp32 probabilities (268 MB a layer at 8k x 8 for Llama-3.1-8B, 1 GB at 32k x 8) and passes over them six
times; on an H200 that was ~2.5 ms of a layer's ~11 ms of prefill work (docs/kernels.md, eighth lease). Here one
pass computes each query row's softmax maximum and normaliser per split of the keys (at most ``MAX_SPLITS``),
and a second recomputes the logits block by block (the ``w x g`` query rows of a KV head against 64 keys, one
``tl.dot``) and reduces them to the two outputs in registers. Logits are the model-dtype product accumulated in
fp32 (products of bf16 values are exact in fp32), scaled after the product; fp32 models take IEEE products.
Plain causal prompts only (no mask: no padding), and without ARKV's variance term (``gamma = 0``), which needs
the probabilities themselves; the cache keeps the torch path for those.
:func:`observation_scores_reference` is the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfkv.kernels.environment import interpreter_on
from hfkv.kernels.grid import cdiv
from hfkv.policy.oq import UNIFORM_TOL
from hfkv.policy.scores import GQA_REDUCTIONS, observation_probs, observation_shape, reduce_gqa

__all__ = ["observation_scores", "observation_scores_reference", "oq_score_triton"]

SPLIT_T = 1024  # keys per program of the statistics pass, at least (its combine reads each split's partials)
MAX_SPLITS = 32  # past 32k keys the splits grow instead: the scores pass holds every split's partials in registers
BLOCK_T = 64  # keys per iteration (statistics) and per program (scores)


def observation_scores_reference(
    query: torch.Tensor, key: torch.Tensor, scaling: float, obs_window: int, reduction: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [B, H, T], mass [B, T])`` fp32 from the probabilities themselves (plain causal)."""
    probs = observation_probs(query, key, scaling, None, obs_window)
    return reduce_gqa(probs, key.shape[1], reduction).sum(dim=2), probs.sum(dim=(1, 2))


@triton.jit
def _rows(
    q_ptr, b, h, Tq, W, sqb, sqh, sqt, G: tl.constexpr, GP: tl.constexpr, WP: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    """The ``GP x WP`` query rows of KV head ``h`` (row ``j * WP + i``: head ``j`` of the group, window query
    ``i``), zeros where ``j >= G`` or ``i >= W``; and which rows are real."""
    r = tl.arange(0, GP * WP)
    j = r // WP
    i = r % WP
    ok = (j < G) & (i < W)
    d = tl.arange(0, BD)  # the head dim padded to a power of two (>= 16, tl.dot's least): zeros past D
    ptr = q_ptr + b * sqb + (h * G + j)[:, None].to(tl.int64) * sqh + (Tq - W + i)[:, None].to(tl.int64) * sqt
    q = tl.load(ptr + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
    return q, i, ok


@triton.jit
def _logits(q, k_ptr, b, h, t, T, skb, skh, skt, scaling, D: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):
    d = tl.arange(0, BD)
    ptr = k_ptr + b * skb + h * skh + t[:, None].to(tl.int64) * skt + d[None, :]
    k = tl.load(ptr, mask=(t < T)[:, None] & (d < D)[None, :], other=0.0)
    if IEEE:
        x = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        x = tl.dot(q, tl.trans(k))
    return x * scaling


@triton.jit(do_not_specialize=["T", "Tq", "W", "S", "SPLIT"])
def _stats_kernel(
    q_ptr, k_ptr, m_ptr, l_ptr, T, Tq, W, S, SPLIT, scaling,
    sqb, sqh, sqt, skb, skh, skt,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, WP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BLOCK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H
    h = bh % H
    q, i, ok = _rows(q_ptr, b, h, Tq, W, sqb, sqh, sqt, G, GP, WP, D, BD)
    qpos = T - W + i  # the query's position among the keys: it sees keys <= qpos
    m = tl.full([GP * WP], float("-inf"), tl.float32)
    acc = tl.zeros([GP * WP], tl.float32)
    end = tl.minimum(s * SPLIT + SPLIT, T)
    for t0 in range(s * SPLIT, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        x = _logits(q, k_ptr, b, h, t, T, skb, skh, skt, scaling, D, BD, IEEE)
        seen = ok[:, None] & (t[None, :] <= qpos[:, None])
        x = tl.where(seen, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - safe) + tl.sum(tl.where(seen, tl.exp(x - safe[:, None]), 0.0), 1)
        m = m_new
    out = (bh * S + s) * (GP * WP) + tl.arange(0, GP * WP)
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, acc)


@triton.jit(do_not_specialize=["T", "Tq", "W", "S"])
def _scores_kernel(
    q_ptr, k_ptr, m_ptr, l_ptr, sums_ptr, mass_ptr, T, Tq, W, S, scaling,
    sqb, sqh, sqt, skb, skh, skt,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, WP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    SP: tl.constexpr, BLOCK: tl.constexpr, REDUCE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    q, i, ok = _rows(q_ptr, b, h, Tq, W, sqb, sqh, sqt, G, GP, WP, D, BD)
    qpos = T - W + i
    # the splits' maxima and normalisers combined: each row's softmax over all its keys
    r = tl.arange(0, GP * WP)
    sp = tl.arange(0, SP)
    at = (bh * S + sp[:, None]) * (GP * WP) + r[None, :]
    ms = tl.load(m_ptr + at, mask=(sp < S)[:, None], other=float("-inf"))
    ls = tl.load(l_ptr + at, mask=(sp < S)[:, None], other=0.0)
    mx = tl.max(ms, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    norm = tl.sum(tl.where(ms == float("-inf"), 0.0, ls * tl.exp(ms - mx[None, :])), 0)
    norm = tl.where(norm > 0, norm, 1.0)  # a row that sees nothing has probabilities 0, not NaN
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = _logits(q, k_ptr, b, h, t, T, skb, skh, skt, scaling, D, BD, IEEE)
    seen = ok[:, None] & (t[None, :] <= qpos[:, None]) & (t < T)[None, :]
    p = tl.where(seen, tl.exp(x - mx[:, None]) / norm[:, None], 0.0)  # [GP * WP, BLOCK]
    grouped = tl.reshape(p, (GP, WP, BLOCK))
    if REDUCE == 0:  # max over the group's query heads (padding heads are 0, below any probability)
        per_query = tl.max(grouped, 0)
    elif REDUCE == 1:  # mean
        per_query = tl.sum(grouped, 0) / G
    else:  # l2: root mean square
        per_query = tl.sqrt(tl.sum(grouped * grouped, 0) / G)
    out = bh.to(tl.int64) * T + t
    tl.store(sums_ptr + out, tl.sum(per_query, 0), mask=t < T)
    tl.store(mass_ptr + out, tl.sum(p, 0), mask=t < T)


def observation_scores(
    query: torch.Tensor, key: torch.Tensor, scaling: float, obs_window: int, reduction: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`observation_scores_reference` in two launches (and one sum over heads for the mass).

    ``query [B, Hq, Tq, D]`` (the last ``w = min(obs_window, Tq)`` rows are the window), ``key [B, H, T, D]``
    with ``T >= Tq``, plain causal; last dimensions contiguous.
    """
    bsz, heads, t, tq, group, w = observation_shape(query, key, obs_window, reduction, "observation_scores")
    dim = query.shape[3]
    if not (bsz and t and w):  # nothing observed: zero scores and mass
        sums = torch.zeros(bsz, heads, t, dtype=torch.float32, device=key.device)
        return sums, sums.sum(1)
    sums = torch.empty(bsz, heads, t, dtype=torch.float32, device=key.device)  # every key written below
    mass = torch.empty_like(sums)
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    gp = triton.next_power_of_2(group)
    wp = max(triton.next_power_of_2(w), 16 // gp, 1)  # tl.dot needs >= 16 rows
    split = max(SPLIT_T, cdiv(cdiv(t, MAX_SPLITS), BLOCK_T) * BLOCK_T)
    splits = cdiv(t, split)
    m = torch.empty(bsz * heads, splits, gp * wp, dtype=torch.float32, device=key.device)
    l_ = torch.empty_like(m)
    # fp32 models: IEEE products; under the interpreter too, whose tl.dot misreads bf16 operands (the same
    # products: bf16 ones are exact in fp32)
    ieee = query.dtype == torch.float32 or interpreter_on()
    strides = (*query.stride()[:3], *key.stride()[:3])
    shape = dict(H=heads, G=group, GP=gp, WP=wp, D=dim, BD=max(16, triton.next_power_of_2(dim)), IEEE=ieee)
    _stats_kernel[(bsz * heads, splits)](
        query, key, m, l_, t, tq, w, splits, split, float(scaling), *strides, BLOCK=BLOCK_T, **shape
    )
    _scores_kernel[(bsz * heads, cdiv(t, BLOCK_T))](
        query, key, m, l_, sums, mass, t, tq, w, splits, float(scaling), *strides,
        SP=triton.next_power_of_2(splits), BLOCK=BLOCK_T, REDUCE=GQA_REDUCTIONS.index(reduction), **shape,
    )  # fmt: skip
    return sums, mass.sum(1)


# ------------------------------------------------------------------------------------------ OQ statistics
@triton.jit
def _oq_kernel(
    mass_ptr, keep_ptr, out_ptr, T, inv_t1, inv_t2, inv_t3, tol, BLOCK: tl.constexpr,
):  # fmt: skip
    """One batch row's ARKV OQ score from its keys' mass (``hfkv.policy.oq.oq_score_from_mass``), in four passes
    over the row: counts, total and heaviest key; entropy and mean; variance; kurtosis."""
    b = tl.program_id(0).to(tl.int64)
    row_m = mass_ptr + b * T
    row_k = keep_ptr + b * T
    n = 0.0
    z = 0.0
    top_v = -1.0
    top_i = 0
    for t0 in range(0, T, BLOCK):
        t, inside, keep, mass = _row_block(row_m, row_k, t0, T, BLOCK)
        n += tl.sum(keep.to(tl.float32), 0)
        z += tl.sum(mass, 0)
        v = tl.max(tl.where(inside, mass, -1.0), 0)
        first = tl.min(tl.where(inside & (mass == v), t, T), 0)  # torch's argmax: the first of equal maxima
        better = v > top_v
        top_i = tl.where(better, first, top_i)
        top_v = tl.where(better, v, top_v)
    nf = tl.maximum(n, 1.0)
    zs = tl.where(z > 0, z, 1.0)
    others = 0.0
    for t0 in range(0, T, BLOCK):
        t, inside, keep, mass = _row_block(row_m, row_k, t0, T, BLOCK)
        others += tl.sum(tl.where(t == top_i, 0.0, mass), 0)
    log_top = tl.log(1.0 - others / zs)  # log1p(-others / Z) to fp32 (1 - x is exact for x in [0.5, 1])
    log_top = tl.where(others / zs < 0.5, _log1p_neg(others / zs), log_top)
    entropy = 0.0
    total = 0.0
    for t0 in range(0, T, BLOCK):
        t, inside, keep, mass = _row_block(row_m, row_k, t0, T, BLOCK)
        p = mass / zs
        log_p = tl.where(t == top_i, log_top, tl.log(tl.where(p > 0, p, 1.0)))
        entropy -= tl.sum(tl.where(p > 0, p * log_p, 0.0), 0)
        total += tl.sum(p, 0)
    mean = total / nf
    var = 0.0
    for t0 in range(0, T, BLOCK):
        t, inside, keep, mass = _row_block(row_m, row_k, t0, T, BLOCK)
        p = mass / zs  # 0 on the keys not considered; the deviations there are masked below
        dev = tl.where(keep, p - mean, 0.0)
        var += tl.sum(dev * dev, 0)
    var = var / nf
    ok = (n >= 2) & (z > 0) & (var > (tol * mean) * (tol * mean))
    std = tl.sqrt(tl.where(ok, var, 1.0))
    kurt = 0.0
    for t0 in range(0, T, BLOCK):
        t, inside, keep, mass = _row_block(row_m, row_k, t0, T, BLOCK)
        p = mass / zs  # 0 on the keys not considered; the deviations there are masked below
        s = tl.where(keep, (p - mean) / std, 0.0)
        s2 = s * s
        kurt += tl.sum(s2 * s2, 0)
    kurt = kurt / nf
    q = _pow(tl.maximum(entropy, 0.0), inv_t1) * _pow(var, inv_t2) * _pow(kurt, inv_t3)
    tl.store(out_ptr + b, tl.where(ok, q, 0.0))


@triton.jit
def _row_block(row_m, row_k, t0, T, BLOCK: tl.constexpr):
    """Keys ``t0 .. t0 + BLOCK`` of a row: their indices, which exist, which are considered, and their mass (0 where
    not considered)."""
    t = t0 + tl.arange(0, BLOCK)
    inside = t < T
    keep = inside & (tl.load(row_k + t, mask=inside, other=0) != 0)
    return t, inside, keep, tl.where(keep, tl.load(row_m + t, mask=inside, other=0.0), 0.0)


@triton.jit
def _pow(x, e):
    """``x ** e`` for ``x >= 0`` (0 at 0, as torch's pow)."""
    return tl.where(x > 0, tl.exp(tl.log(tl.where(x > 0, x, 1.0)) * e), 0.0)


@triton.jit
def _log1p_neg(x):
    """``log(1 - x)`` for ``0 <= x < 0.5`` without cancelling ``1 - x`` (the series ``-x - x^2/2 - ...`` in its
    ``2 atanh`` form: ``log((1 - x) / 1) = 2 atanh(-x / (2 - x))``)."""
    y = -x / (2.0 - x)
    y2 = y * y
    s = 1.0 + y2 * (1.0 / 3 + y2 * (1.0 / 5 + y2 * (1.0 / 7 + y2 * (1.0 / 9 + y2 * (1.0 / 11 + y2 / 13)))))
    return 2.0 * y * s


def oq_score_triton(total: torch.Tensor, key_mask: torch.Tensor, tau) -> torch.Tensor:
    """:func:`hfkv.policy.oq.oq_score_from_mass` in one launch (one program per batch row): ~55 torch operations,
    each a launch on a GPU, where a prompt's admission is bound by its launches."""
    if total.dim() != 2 or tuple(key_mask.shape) != tuple(total.shape):
        raise ValueError(f"oq_score_triton: total [B, T] and key_mask of its shape, got {tuple(total.shape)} and "
                         f"{tuple(key_mask.shape)}")  # fmt: skip
    t1, t2, t3 = (float(t) for t in tau)
    if min(t1, t2, t3) <= 0:
        raise ValueError(f"tau must be three positive numbers, got {tuple(tau)}")
    bsz, t = total.shape
    out = torch.zeros(bsz, dtype=torch.float32, device=total.device)
    if bsz and t:
        keep = key_mask.to(device=total.device, dtype=torch.bool).contiguous().view(torch.uint8)
        _oq_kernel[(bsz,)](total.float().contiguous(), keep, out, t, 1 / t1, 1 / t2, 1 / t3, UNIFORM_TOL, BLOCK=1024)
    return out
