"""ARKV per-layer Original-Quantization (OQ) ratios (ARKV §IV-C/IV-D, eqs. 3-7).

At prefill, each layer's observation-window attention is aggregated over heads and window
queries into a distribution ``p`` over the considered keys (outside the dense window, not
padding). Its entropy ``H``, variance ``V`` and kurtosis ``K`` give the layer's OQ score

    q_l = H^(1/tau1) * V^(1/tau2) * K^(1/tau3)

and the OQ ratio ``rho_l = q_l / max_k q_k`` (per batch row) caps how many tokens of the layer may
stay in full precision (``round(rho_l * (B - W))`` per head, see :mod:`hfkv.policy.unified`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ARKV_TAU", "oq_ratios", "oq_score", "oq_score_from_mass"]

#: ARKV paper values of (tau1, tau2, tau3).
ARKV_TAU = (7.774, 5.407, 5.528)

# A variance below (UNIFORM_TOL * mean)^2 is rounding noise of an exactly uniform distribution
# (fp32 epsilon ~ 1.2e-7); it is treated as 0.
UNIFORM_TOL = 4 * torch.finfo(torch.float32).eps


def oq_score(probs: Tensor, key_mask: Tensor, tau: Sequence[float]) -> Tensor:
    """ARKV OQ score of one layer for every batch row.

    Args:
        probs: ``[B, Hq, w, T_k]`` observation-window probabilities (``observation_probs``).
        key_mask: ``[B, T_k]`` bool, the keys considered (non-window, non-padding).
        tau: ``(tau1, tau2, tau3)`` temperatures (positive).

    Returns:
        ``[B]`` fp32 ``H^(1/tau1) * V^(1/tau2) * K^(1/tau3)`` where, with ``p_k`` the attention mass
        on considered key ``k`` summed over heads and window queries and normalised to sum 1,
        ``H = -sum p log p`` (natural log, ``0 log 0 = 0``), ``V`` the population variance of ``p``
        over the ``n`` considered keys and ``K = E[(p - mean)^4] / V^2`` (Pearson, non-excess).
        Degenerate rows give 0 (never NaN): fewer than 2 considered keys, zero total mass, or
        ``V == 0`` (a distribution uniform to fp32 precision counts as ``V == 0``).
    """
    if probs.dim() != 4:
        raise ValueError(f"probs must be [B, Hq, w, T_k], got shape {tuple(probs.shape)}")
    return oq_score_from_mass(probs.to(torch.float32).sum(dim=(1, 2)), key_mask, tau)


def oq_score_from_mass(total: Tensor, key_mask: Tensor, tau: Sequence[float]) -> Tensor:
    """:func:`oq_score` from the attention mass on each key, ``total [B, T_k]`` fp32 (the probabilities summed
    over heads and window queries), as a kernel that never holds the probabilities gives it."""
    if total.dim() != 2:
        raise ValueError(f"total must be [B, T_k], got shape {tuple(total.shape)}")
    b, t_k = total.shape
    if tuple(key_mask.shape) != (b, t_k):
        raise ValueError(f"key_mask must be [B, T_k] = {(b, t_k)}, got {tuple(key_mask.shape)}")
    t1, t2, t3 = (float(t) for t in tau)
    if min(t1, t2, t3) <= 0:
        raise ValueError(f"tau must be three positive numbers, got {tuple(tau)}")

    if t_k == 0:
        return torch.zeros(b, dtype=torch.float32, device=total.device)
    m = key_mask.to(device=total.device, dtype=torch.bool)
    zero = torch.zeros((), dtype=torch.float32, device=total.device)
    mass = torch.where(m, total, zero)  # [B, T_k]
    n = m.sum(dim=-1)  # [B]
    nf = n.clamp(min=1).to(torch.float32)
    z = mass.sum(dim=-1)  # [B]
    ok = (n >= 2) & (z > 0)
    p = mass / torch.where(z > 0, z, 1.0).unsqueeze(-1)

    pos = p > 0
    log_p = torch.log(torch.where(pos, p, 1.0))
    # The heaviest key may carry almost all the mass, where log(p) ~ -(1 - p) and 1 - p is lost to
    # fp32 rounding: use log1p(-(mass of the other keys) / Z) for it instead.
    is_top = torch.zeros_like(m).scatter_(-1, p.argmax(dim=-1, keepdim=True), True)
    others = torch.where(is_top, zero, mass).sum(dim=-1)
    log_top = torch.log1p(-others / torch.where(z > 0, z, 1.0))
    log_p = torch.where(is_top, log_top.unsqueeze(-1), log_p)
    entropy = -torch.where(pos, p * log_p, zero).sum(dim=-1)
    mean = p.sum(dim=-1) / nf
    dev = torch.where(m, p - mean.unsqueeze(-1), zero)
    var = dev.square().sum(dim=-1) / nf
    ok = ok & (var > (UNIFORM_TOL * mean).square())
    # Kurtosis from standardised deviations (no V^2 underflow for long prompts).
    std = torch.where(ok, var, 1.0).sqrt()
    kurt = (dev / std.unsqueeze(-1)).pow(4).sum(dim=-1) / nf

    q = entropy.clamp(min=0).pow(1.0 / t1) * var.pow(1.0 / t2) * kurt.pow(1.0 / t3)
    return torch.where(ok, q, zero)


def oq_ratios(q: Tensor) -> Tensor:
    """OQ ratios ``rho[l, b] = q[l, b] / max_k q[k, b]`` from scores ``q`` of shape ``[L, B]``.

    Where the maximum over layers is 0 (a degenerate prompt), every layer of that row gets
    ``rho = 1`` so that nothing is demoted because of it. ``rho`` is final only after the last
    layer's prefill (the maximum runs over all layers), so the original/quantized split can only
    be enforced from the first decode step on.
    """
    if q.dim() != 2:
        raise ValueError(f"q must be [L, B], got shape {tuple(q.shape)}")
    q = q.to(torch.float32)
    mx = q.amax(dim=0, keepdim=True) if q.shape[0] > 0 else q.new_zeros((1, q.shape[1]))
    good = mx > 0
    return torch.where(good, q / torch.where(good, mx, 1.0), torch.ones((), dtype=q.dtype, device=q.device))
