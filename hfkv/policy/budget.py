"""Memory-budget allocation: which tokens stay exact, which are quantized (in which format), which are
evicted, so that the bytes held fit a cap and the significance kept, weighted by each tier's fidelity,
is largest.

A token budget makes quantization pointless: a quantized token costs as much budget as an exact
one, so under a budget quantization can only lose information. Counting bytes fixes that: a
K4V2 record costs ~27% of a bf16 token, so the same memory holds about four quantized tokens or one
exact one, and the policy can trade between keeping more tokens and keeping them better.

**Tiers.** Up to three storage tiers, indexed by state: ``ORIGINAL`` (exact), ``MID`` (a precise
quantized format, DiffKV's K8V4) and ``QUANTIZED`` (a coarse one, K4V2); ``cost[t] is None``
switches a tier off. A tier with fewer bytes must not be more precise.

**Objective.** Each kept token ``i`` of significance ``s_i`` (mean received attention) contributes
``s_i * f_t`` for the tier ``t`` it is kept in (``f_t`` the tier's measured fidelity, 1 for the
model dtype) at ``c_t`` bytes (its record, metadata included); an evicted token contributes
nothing. Maximise ``sum s_i f_t`` subject to ``sum c_t <= room``.

**Solution.** A token's options, cheapest first (evicted, then each tier it may still be in), are
points ``(c_t, f_t)``; moving from one to the next is an *item* (cost ``c_t - c_prev``). Each item
is ranked at ``s`` times the slope of the upper concave hull of those points over its interval:
along the hull, value per byte falls from one item to the next, so taking items of all tokens in
order of value per byte until the room is used is the greedy solution of the LP relaxation
(a fractional knapsack over concave curves), integral except for the token where it stops: within
one token of the optimum, and a prefix of one sort (a cumulative-sum scan), which is what makes it
vectorisable over rows and heads. A tier below the hull (not worth its bytes) shares the slope of
the hull segment over it, so a token cut off inside that segment still keeps the cheaper copy. The
same scan runs per (row, head), or per layer row across heads with ``head_adaptive`` (AdaKV-style
sharing of the layer's bytes).

With K8V4 between exact and K4V2, the hull's slopes at bf16 head_dim 64 fall from ``0.64/72``
(keep in K4V2) to ``0.30/48`` (refine to K8V4) to ``0.06/144`` (upgrade to exact): the budget first
keeps tokens, then refines them, and spends on exact copies only when everything kept is K8V4.

**A prior.** Attention received so far predicts attention to come only roughly: a token nobody
attends now may be the one a later step needs (the definition a chain of thought reaches next),
and an evicted token is gone while a quantized one is merely blurred. ``prior`` credits every
token with ``prior / N`` more significance (``1 / N`` is uniform attention) in the item values:
large priors keep as many tokens as the bytes allow before any is refined, ``0`` is the pure
attention-mass objective.

**Inputs from the papers.** DiffKV's thresholds become floors, not a separate mechanism:
``score < alpha_l / N`` is evicted whatever the room (per-head dynamic sparsity); a token with
``score >= alpha_h / N`` is kept exact or not at all (all its items are ranked at the exact
tier's value per byte, as DiffKV keeps significant tokens in high precision). ARKV's OQ ratio
becomes a cap on the number of exact tokens (``exact_cap``): upgrades to exact past the cap are
skipped, and their bytes go to keeping more tokens quantized.

**Constraints.** No promotion: a token's items only reach tiers at or below its current one
(``MID`` can go to ``QUANTIZED``, never back); EVICTED stays evicted. Sinks never change state;
their bytes are taken from the room first. Ties break by slot index, then head (``head_adaptive``),
then item (cheapest first) — the loop reference in the tests uses the same order.

Cost: O(N) elementwise work; one sort of up to ``3N`` items per row only when the tokens do not all
fit at their current state (the fast path needs one host sync to know that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hfkv.policy.unified import Sinks, _lengths, _ordered_key, _per_head, check_shapes, rows_of, sink_mask
from hfkv.states import EVICTED, ORIGINAL, TIER_NAMES

__all__ = ["allocate", "held_bytes_of", "hull_slopes"]

Costs = Sequence[int | None]  # bytes of one record per tier, indexed by state; None: tier off


def held_bytes_of(state: Tensor, cost: Costs) -> Tensor:
    """Bytes the tier slots in ``state [..., N]`` hold, per leading index (``[...]`` int64)."""
    out = torch.zeros(state.shape[:-1], dtype=torch.int64, device=state.device)
    for tier, c in enumerate(cost):
        if c is not None:
            out += (state == tier).sum(-1) * int(c)
    return out


def hull_slopes(points: Sequence[tuple[float, float]]) -> list[float]:
    """Value per byte of each step between ``(0, 0)`` and ``points`` (``(cost, value)``, cheapest first):
    the slope of their upper concave hull over the step. A zero-cost step takes the previous step's slope
    (it is taken right after it, for free).

    The hull's slope over ``[x_{i-1}, x_i]`` is ``min_{a < i} max_{b >= i} slope(a, b)`` (the least concave
    majorant); with at most four points it is cheapest written out.
    """
    xs = [0.0, *(float(c) for c, _ in points)]
    fs = [0.0, *(float(f) for _, f in points)]
    slopes: list[float] = []
    for i in range(1, len(xs)):
        if xs[i] == xs[i - 1]:
            slopes.append(slopes[-1] if slopes else float("inf"))
            continue
        slopes.append(min(max((fs[b] - fs[a]) / (xs[b] - xs[a]) for b in range(i, len(xs))) for a in range(i)))
    return slopes


def check_tiers(cost: Costs, fidelity: Sequence[float | None]) -> list[int]:
    """The enabled tiers (state order), after checking that fewer bytes never buy more precision."""
    if len(cost) != len(TIER_NAMES) or len(fidelity) != len(TIER_NAMES):
        raise ValueError(
            f"need one cost and one fidelity per tier {TIER_NAMES} (None: tier off), got cost={tuple(cost)}, "
            f"fidelity={tuple(fidelity)}"
        )
    on = [t for t, c in enumerate(cost) if c is not None]
    if ORIGINAL not in on or any(fidelity[t] is None for t in on):
        raise ValueError(
            f"the original tier needs a cost and every tier on a fidelity, got cost={tuple(cost)}, "
            f"fidelity={tuple(fidelity)}"
        )
    cs, fs = [int(cost[t]) for t in on], [float(fidelity[t]) for t in on]
    ordered = cs == sorted(cs, reverse=True) and fs == sorted(fs, reverse=True)
    if not (ordered and cs[-1] > 0 and fs[-1] >= 0):
        raise ValueError(
            f"need costs > 0 and fidelities >= 0 that do not grow from tier to tier {TIER_NAMES} (a cheaper "
            f"record is never more precise), got cost={tuple(cost)}, fidelity={tuple(fidelity)}"
        )
    return on


def item_tables(cost: Costs, fidelity: Sequence[float | None], on: list[int], device: torch.device):
    """Per current state (rows) and item (columns, cheapest first): present, rate, cost; and the tier each
    item reaches. Built on the host: a handful of numbers per layer."""
    order = on[::-1]  # cheapest first: quantized, mid, original
    k = len(order)
    step_cost = [int(cost[t]) - (int(cost[order[j - 1]]) if j else 0) for j, t in enumerate(order)]
    present, rate = [], []
    for state in range(len(TIER_NAMES)):
        allowed = [t for t in order if t >= state]  # no promotion: tiers at or below the current one
        slopes = hull_slopes([(cost[t], fidelity[t]) for t in allowed])
        present.append([j < len(allowed) for j in range(k)])
        rate.append([slopes[j] if j < len(allowed) else 0.0 for j in range(k)])
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return (
        as_t(present, torch.bool),
        as_t(rate, torch.float32),
        as_t(step_cost, torch.int64),
        as_t(order, torch.int8),
    )


def _item_order(present: Tensor, eff: Tensor) -> Tensor:
    """Permutation of the last dim sorting present items by efficiency desc, absent ones last; ties keep
    their flattened order (slot, head, item), so a token's items stay in order."""
    desc = ((1 << 32) - 1) - (_ordered_key(eff) + (1 << 31))
    return torch.sort((~present).to(torch.int64) << 33 | desc, dim=-1, stable=True).indices


def allocate(
    scores: Tensor,
    state: Tensor,
    sink: Tensor | Sinks,
    logical_len: Tensor | int,
    alpha_h: Tensor,
    alpha_l: Tensor,
    room: Tensor | int,
    cost: Costs,
    fidelity: Sequence[float | None],
    head_adaptive: bool,
    exact_cap: Tensor | None = None,
    prior: float = 0.0,
) -> Tensor:
    """New states ``[B, H, N]`` (int8) of the non-window slots of one layer under a byte budget.

    Args:
        scores: ``[B, H, N]`` fp32 significance (mean received attention).
        state: ``[B, H, N]`` int8 current state; tokens leaving the window come in as ``ORIGINAL``,
            empty or padding slots as ``EVICTED``.
        sink: ``[B, H, N]`` bool attention sinks (never change state; their bytes count), or :class:`Sinks`.
        logical_len: ``[B]`` logical length ``N`` (thresholds are ``alpha / N``), or one int for every row.
        alpha_h, alpha_l: ``[H]`` (or scalar) floors, may be ``inf``.
        room: bytes the non-window slots may hold: ``[B, H]``, or ``[B]`` with ``head_adaptive``; or one int.
        cost: bytes of one record of each tier ``(ORIGINAL, MID, QUANTIZED)``; None switches a tier off.
        fidelity: value kept by a token of each tier (``None`` for a tier that is off).
        head_adaptive: one scan per layer row across heads instead of one per head.
        exact_cap: most ``ORIGINAL`` non-sink tokens, shaped like ``room``, or None.
        prior: significance every token is credited with on top of its score, in units of ``1 / N``
            (uniform attention), in the item values only (floors use the raw score).

    Guarantees: the bytes held (``held_bytes_of``) are at most ``room`` wherever the sinks alone
    fit; no token is promoted.
    """
    b, h, n = check_shapes(scores, state, sink)
    on = check_tiers(cost, fidelity)
    rows = (b,) if head_adaptive else (b, h)
    device = scores.device
    room = rows_of(room, rows, "room", device)
    state = state.to(torch.int8)
    if n == 0:
        return state.clone()
    scores = scores.to(torch.float32)
    sink = sink_mask(sink, state)
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

    # Items [B, H, N, K], cheapest first; efficiency = value per byte along the token's hull.
    present_t, rate_t, cost_t, target_t = item_tables(cost, fidelity, on, device)
    k = cost_t.numel()
    if prior:
        scores = scores + prior / length
    cls = new.clamp(max=len(TIER_NAMES) - 1).long()
    rate = torch.where(exact_only.unsqueeze(-1), float(fidelity[ORIGINAL]) / int(cost[ORIGINAL]), rate_t[cls])
    eff = scores.unsqueeze(-1) * rate
    present = present_t[cls] & cand.unsqueeze(-1)
    # Flatten to rows: per head [B*H, N*K] (n-major, items cheapest first); head-adaptive [B, N*H*K].
    if head_adaptive:
        flat = lambda x: x.permute(0, 2, 1, 3).reshape(b, n * h * k)  # noqa: E731
    else:
        flat = lambda x: x.reshape(b * h, n * k)  # noqa: E731
    eff_f, present_f = flat(eff), flat(present)
    cost_f = flat(cost_t.expand(b, h, n, k))
    order = _item_order(present_f, torch.where(present_f, eff_f, 0.0))
    allowed = present_f.gather(-1, order)
    if exact_cap is not None:
        to_exact = flat((target_t == ORIGINAL).expand(b, h, n, k)).gather(-1, order) & allowed
        cap = exact_cap.to(device=device, dtype=torch.int64).reshape(-1, 1)
        allowed = allowed & (~to_exact | (torch.cumsum(to_exact.to(torch.int64), -1) <= cap))
    spent = torch.cumsum(torch.where(allowed, cost_f.gather(-1, order), 0), -1)
    taken_sorted = allowed & (spent <= room.reshape(-1, 1))
    taken = torch.zeros_like(taken_sorted).scatter_(-1, order, taken_sorted)
    if head_adaptive:
        taken = taken.view(b, n, h, k).permute(0, 2, 1, 3)
    else:
        taken = taken.view(b, h, n, k)
    # A token takes a prefix of its items (slopes fall along them, ties keep item order): it ends in the
    # tier its last item reaches.
    m = taken.sum(-1)
    decided = torch.where(m > 0, target_t[(m - 1).clamp(min=0)], EVICTED).to(torch.int8)
    return torch.where(cand, decided, new)
