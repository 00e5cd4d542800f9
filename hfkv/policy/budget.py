"""Memory-budget allocation: which tokens stay exact, which are quantized, which are evicted, so that
the bytes held fit a cap and the significance kept, weighted by each tier's fidelity, is largest.

A token budget makes quantization pointless: a quantized token costs as much budget as an exact
one, so under a budget quantization can only lose information. Counting bytes fixes that: a
K4V4 record costs ~30% of a bf16 token, so the same memory holds three quantized tokens or one
exact one, and the policy can trade between keeping more tokens and keeping them better.

**Objective.** Each kept token ``i`` of significance ``s_i`` (mean received attention) contributes
``s_i * f_t`` for the tier ``t`` it is kept in (``f_0`` exact, ``f_1`` quantized: the tier's
measured fidelity, 1 for the model dtype) at ``c_t`` bytes (its record, metadata included);
an evicted token contributes nothing. Maximise ``sum s_i f_t`` subject to ``sum c_t <= room``.

**Solution.** Split every exact-capable token into two items: *keep* (evicted -> quantized,
cost ``c_1``, value ``s f_1``) and *upgrade* (quantized -> exact, cost ``c_0 - c_1``, value
``s (f_0 - f_1)``). When quantizing is worth its bytes (``f_1 / c_1 >= f_0 / c_0``) an upgrade is
never more efficient than its own keep, so taking items in order of value per byte until the
room is used is the greedy solution of the LP relaxation, integral except for the item where it
stops: within one item of the optimum, and a prefix of one sort (a cumulative-sum scan), which is
what makes it vectorisable over rows and heads. When quantizing is not worth its bytes, both items
of a token are ranked at the exact tier's value per byte (the convex hull skips the quantized
point): tokens are then kept exact or dropped, and a token cut off between its two items keeps
its quantized copy. The same scan runs per (row, head), or per layer row across heads with
``head_adaptive`` (AdaKV-style sharing of the layer's bytes).

**A prior.** Attention received so far predicts attention to come only roughly: a token nobody
attends now may be the one a later step needs (the definition a chain of thought reaches next),
and an evicted token is gone while a quantized one is merely blurred. ``prior`` credits every
token with ``prior / N`` more significance (``1 / N`` is uniform attention) in the item values:
large priors keep as many tokens as the bytes allow before any is upgraded to exact, ``0`` is
the pure attention-mass objective.

**Inputs from the papers.** DiffKV's thresholds become floors, not a separate mechanism:
``score < alpha_l / N`` is evicted whatever the room (per-head dynamic sparsity); a token with
``score >= alpha_h / N`` is kept exact or not at all (both its items are ranked at the exact
tier's value per byte, as DiffKV keeps significant tokens in high precision). ARKV's OQ ratio
becomes a cap on the number of exact tokens (``exact_cap``): upgrades past the cap are skipped,
and their bytes go to keeping more tokens quantized.

**Constraints.** No promotion: a QUANTIZED token has only its keep item; EVICTED stays evicted.
Sinks never change state; their bytes are taken from the room first. Ties break by slot index,
then head (``head_adaptive``), then keep before upgrade — the loop reference in the tests uses the
same order.

Cost: O(N) elementwise work; one sort of ``2N`` items per row only when the tokens do not all fit
at their current state (the fast path needs one host sync to know that).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hfkv.policy.unified import _check_shapes, _lengths, _ordered_key, _per_head
from hfkv.states import EVICTED, ORIGINAL, QUANTIZED

__all__ = ["allocate", "held_bytes_of", "quantizing_pays"]


def quantizing_pays(cost: tuple[int, int], fidelity: tuple[float, float]) -> bool:
    """Whether a quantized token keeps at least as much value per byte as an exact one."""
    return fidelity[1] * cost[0] >= fidelity[0] * cost[1]


def held_bytes_of(state: Tensor, cost: tuple[int, int]) -> Tensor:
    """Bytes the tier slots in ``state [..., N]`` hold, per leading index (``[...]`` int64)."""
    return (state == ORIGINAL).sum(-1) * cost[0] + (state == QUANTIZED).sum(-1) * cost[1]


def _item_order(present: Tensor, eff: Tensor) -> Tensor:
    """Permutation of the last dim sorting present items by efficiency desc, absent ones last; ties keep
    their flattened order (slot, head, keep before upgrade), so a token's two items stay in order."""
    desc = ((1 << 32) - 1) - (_ordered_key(eff) + (1 << 31))
    return torch.sort((~present).to(torch.int64) << 33 | desc, dim=-1, stable=True).indices


def allocate(
    scores: Tensor,
    state: Tensor,
    sink: Tensor,
    logical_len: Tensor,
    alpha_h: Tensor,
    alpha_l: Tensor,
    room: Tensor,
    cost: tuple[int, int],
    fidelity: tuple[float, float],
    head_adaptive: bool,
    exact_cap: Tensor | None = None,
    prior: float = 0.0,
) -> Tensor:
    """New states ``[B, H, N]`` (int8) of the non-window slots of one layer under a byte budget.

    Args:
        scores: ``[B, H, N]`` fp32 significance (mean received attention).
        state: ``[B, H, N]`` int8 current state; tokens leaving the window come in as ``ORIGINAL``,
            empty or padding slots as ``EVICTED``.
        sink: ``[B, H, N]`` bool attention sinks (never change state; their bytes count).
        logical_len: ``[B]`` logical length ``N`` (thresholds are ``alpha / N``).
        alpha_h, alpha_l: ``[H]`` (or scalar) floors, may be ``inf``.
        room: bytes the non-window slots may hold: ``[B, H]``, or ``[B]`` with ``head_adaptive``.
        cost: bytes of one ``ORIGINAL`` / ``QUANTIZED`` record.
        fidelity: value kept by an ``ORIGINAL`` / ``QUANTIZED`` token (``f_0 >= f_1 >= 0``).
        head_adaptive: one scan per layer row across heads instead of one per head.
        exact_cap: most ``ORIGINAL`` non-sink tokens, shaped like ``room``, or None.
        prior: significance every token is credited with on top of its score, in units of ``1 / N``
            (uniform attention), in the item values only (floors use the raw score).

    Guarantees: the bytes held (``held_bytes_of``) are at most ``room`` wherever the sinks alone
    fit; no token is promoted.
    """
    b, h, n = _check_shapes(scores, state, sink)
    c0, c1 = int(cost[0]), int(cost[1])
    f0, f1 = float(fidelity[0]), float(fidelity[1])
    if not (c0 >= c1 > 0 and f0 >= f1 >= 0):
        raise ValueError(
            f"need costs c0 >= c1 > 0 (a quantized record no larger than an exact one) and fidelities "
            f"f0 >= f1 >= 0, got cost={cost}, fidelity={fidelity}"
        )
    rows = (b,) if head_adaptive else (b, h)
    if tuple(room.shape) != rows:
        raise ValueError(f"room must have shape {rows}, got {tuple(room.shape)}")
    device = scores.device
    state = state.to(torch.int8)
    if n == 0:
        return state.clone()
    scores = scores.to(torch.float32)
    sink = sink.to(torch.bool)
    movable = ~sink

    # Floors: below alpha_l / N is evicted whatever the room; at or above alpha_h / N is exact or nothing.
    length = _lengths(logical_len, device)
    evict = movable & (scores < _per_head(alpha_l, h, device) / length)
    new = torch.where(evict, torch.full_like(state, EVICTED), state)
    cand = movable & (new != EVICTED)
    can_exact = cand & (new == ORIGINAL)
    exact_only = can_exact & (scores >= _per_head(alpha_h, h, device) / length)

    def per_row(x: Tensor) -> Tensor:  # [B, H] -> rows
        return x.sum(1) if head_adaptive else x

    room = room.to(device=device, dtype=torch.int64) - per_row(held_bytes_of(torch.where(sink, new, EVICTED), cost))
    # Fast path: everything still fits as it is, and no cap is exceeded -> nothing moves.
    fits = per_row(held_bytes_of(torch.where(cand, new, EVICTED), cost)) <= room
    if exact_cap is not None:
        fits &= per_row(can_exact.sum(-1)) <= exact_cap.to(device)
    if bool(fits.all()):
        return new

    # Items: [B, H, N, 2] = (keep, upgrade); efficiency = value per byte.
    if prior:
        scores = scores + prior / length
    pays = quantizing_pays((c0, c1), (f0, f1))
    exact_rate = scores * (f0 / c0)
    # An already quantized token can only be kept quantized: its keep item is worth s * f1 whatever pays.
    keep_eff = torch.where(can_exact & (exact_only | (not pays)), exact_rate, scores * (f1 / c1))
    up_eff = exact_rate if not pays or c0 == c1 else scores * ((f0 - f1) / (c0 - c1))  # c0 == c1: a free upgrade
    up_eff = torch.where(exact_only, exact_rate, up_eff)
    eff = torch.stack([keep_eff, up_eff], -1)
    present = torch.stack([cand, can_exact], -1)
    item_cost = torch.tensor([c1, c0 - c1], device=device, dtype=torch.int64).expand(b, h, n, 2)
    # Flatten to rows: per head [B*H, N*2] (n-major, keep before upgrade); head-adaptive [B, N*H*2].
    if head_adaptive:
        flat = lambda x: x.permute(0, 2, 1, 3).reshape(b, n * h * 2)  # noqa: E731
    else:
        flat = lambda x: x.reshape(b * h, n * 2)  # noqa: E731
    eff_f, present_f, cost_f = flat(eff), flat(present), flat(item_cost)
    is_up = flat(torch.tensor([False, True], device=device).expand(b, h, n, 2))
    order = _item_order(present_f, torch.where(present_f, eff_f, 0.0))
    p_sorted = present_f.gather(-1, order)
    up_sorted = is_up.gather(-1, order)
    allowed = p_sorted
    if exact_cap is not None:
        cap = exact_cap.to(device=device, dtype=torch.int64).reshape(-1, 1)
        up_rank = torch.cumsum((up_sorted & p_sorted).to(torch.int64), -1)
        allowed = allowed & (~up_sorted | (up_rank <= cap))
    spent = torch.cumsum(torch.where(allowed, cost_f.gather(-1, order), 0), -1)
    taken_sorted = allowed & (spent <= room.reshape(-1, 1))
    taken = torch.zeros_like(taken_sorted).scatter_(-1, order, taken_sorted)
    if head_adaptive:
        taken = taken.view(b, n, h, 2).permute(0, 2, 1, 3)
    else:
        taken = taken.view(b, h, n, 2)
    kept = taken[..., 0] & cand
    exact = kept & taken[..., 1] & can_exact
    decided = torch.where(exact, ORIGINAL, torch.where(kept, QUANTIZED, EVICTED)).to(torch.int8)
    return torch.where(cand, decided, new)
