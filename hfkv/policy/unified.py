"""The unified tri-state policy (docs/architecture.md, "Life of a token").

:func:`classify` decides, for every non-window slot of one layer, whether it stays ``ORIGINAL``,
becomes ``QUANTIZED`` or ``EVICTED``. ``evict``, ``quant``, ``streaming``, ``arkv`` and ``diffkv``
are special cases of its arguments.

Rules, applied in order to non-sink slots that are not ``EVICTED`` (``N`` = logical length):

1. **Thresholds** (DiffKV): proposed = ``EVICTED`` if ``score < alpha_l / N``, else ``ORIGINAL`` if
   ``score >= alpha_h / N``, else ``QUANTIZED``; new = ``max(current, proposed)`` (no promotion).
   Thresholds are computed in fp32 (``alpha / N``, ``N`` clamped to >= 1).
2. **Budget** (ARKV tailor, only if ``budget`` is set): ``held(b, h)`` = non-evicted slots (sinks
   included) + ``window_count[b]``. If ``held > budget`` the lowest-scored evictable slots are
   evicted until ``target = max(0, floor(slack * (budget - window)))`` non-evicted slots (sinks
   included) remain, or no evictable slot is left. With ``head_adaptive`` the comparison is per
   layer row (``sum_h held(b, h) > H * budget``) and the lowest-scored slots across all heads are
   evicted until ``H * target`` remain (AdaKV-style; heads keep different counts).
3. **OQ cap** (ARKV, only if ``rho`` and ``budget`` are set): ``cap = round(rho[b] * (budget -
   window))`` (fp32 product, round half to even, clamped to >= 0) per head, or ``H * cap`` per
   layer row with ``head_adaptive``; the lowest-scored surplus ``ORIGINAL`` non-sink slots become
   ``QUANTIZED``.

**Sinks** never change state (never demoted, evicted or promoted; an ``EVICTED`` sink slot, e.g. a
padding slot, stays evicted). They are excluded from the thresholds, from the eviction order and
from the OQ cap, but count as held tokens for the budget.

**Tie-break** (deterministic, shared with the brute-force reference in the tests): slots are
ordered by ``(score, n)`` within a head and by ``(score, n, h)`` across the heads of a row with
``head_adaptive``, where ``n`` is the slot index and ``h`` the head index; lower goes first. Scores
compare as fp32 values (``-0.0 == 0.0``).

Cost: rule 1 and the counts are O(N) elementwise work. A stable sort runs only when some row or
head actually needs an eviction or a demotion; each of rules 2 and 3 does at most one host sync
(the "anything over?" check). Everything is vectorised over B and H.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from hfkv.states import EVICTED, ORIGINAL, QUANTIZED

__all__ = ["Sinks", "budget_target", "classify", "expected_held_bound", "oq_cap", "sink_mask"]


class Sinks(NamedTuple):
    """Attention sinks by position, what a policy run has at hand: a held slot (``state != EVICTED``) whose position
    in ``pos [B, H, N]`` lies below its row's ``end [B]``. The Triton allocation compares them as it reads the
    slots (three launches fewer than a mask made first); elsewhere :func:`sink_mask` makes the mask."""

    pos: Tensor
    end: Tensor


def sink_mask(sink: Tensor | Sinks, state: Tensor) -> Tensor:
    """``[B, H, N]`` bool sinks from a mask (returned as bool) or from :class:`Sinks` and the slots' ``state``."""
    if isinstance(sink, Sinks):
        return (state != EVICTED) & (sink.pos < sink.end.to(sink.pos.device).view(-1, 1, 1))
    return sink.to(torch.bool)


def budget_target(budget: int, window: int, slack: float) -> int:
    """Non-evicted, non-window slots left per head after a tailor: ``max(0, floor(slack*(B-W)))``."""
    return max(0, math.floor(slack * (budget - window)))


def expected_held_bound(budget: int, window: int, slack: float) -> int:
    """Upper bound of the tokens a head holds right after a tailor (window full, sinks <= target).

    ``budget_target(budget, window, slack) + window``; it is ``<= budget`` whenever
    ``0 <= slack <= 1`` and ``budget >= window``.
    """
    return budget_target(budget, window, slack) + window


def oq_cap(rho: Tensor, budget: int, window: int) -> Tensor:
    """Per-head cap on ORIGINAL non-sink slots: ``round(rho * (budget - window))`` as int64, >= 0.

    The product is taken in fp32 and rounded half to even (``torch.round``).
    """
    prod = rho.to(torch.float32) * torch.tensor(float(budget - window), dtype=torch.float32, device=rho.device)
    return torch.round(prod).clamp(min=0).to(torch.int64)


def _ordered_key(scores: Tensor) -> Tensor:
    """int64 keys that sort like the fp32 scores (``-0.0`` and ``0.0`` map to the same key)."""
    s = scores.to(torch.float32) + 0.0  # -0.0 + 0.0 == +0.0
    bits = s.view(torch.int32)
    # Negative floats: flip the magnitude bits so that larger magnitudes sort lower.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(torch.int64)


_PARTIAL_SELECT_MAX = 16  # up to this many picks per row, a top-k (O(N)) replaces the sort


def _select_lowest(scores: Tensor, eligible: Tensor, k: Tensor) -> Tensor:
    """For each row of ``[R, M]`` select the ``k[r]`` lowest-scored eligible entries.

    Order: score, then column index. ``k`` must not exceed the number of eligible entries of the
    row. Returns a bool ``[R, M]``. The key ``(score, column)`` is packed into one unique int64,
    so a partial top-k gives exactly the stable sort's answer: during decode usually one token
    per step crosses a cap, and that must not cost a full re-sort.
    """
    m = scores.shape[-1]
    key = _ordered_key(scores) + (1 << 31)  # [0, 2^32)
    key = torch.where(eligible, key, torch.full_like(key, 1 << 32))  # ineligible after all eligible
    key = key * m + torch.arange(m, device=scores.device)
    kmax = int(k.max()) if k.numel() else 0
    if kmax <= _PARTIAL_SELECT_MAX:
        order = torch.topk(key, kmax, dim=-1, largest=False, sorted=True).indices
        take = torch.arange(kmax, device=scores.device) < k.unsqueeze(-1)
    else:
        order = torch.sort(key, dim=-1).indices
        take = torch.arange(m, device=scores.device) < k.unsqueeze(-1)  # [R, M] in sorted order
    sel = torch.zeros_like(eligible).scatter_(-1, order, take)
    return sel & eligible


def _apply_lowest(
    new: Tensor,
    scores: Tensor,
    eligible: Tensor,
    k: Tensor,
    head_adaptive: bool,
    to_state: int,
) -> Tensor:
    """Move the ``k`` lowest-scored eligible slots (per head, or per row across heads) to ``to_state``.

    ``k`` is ``[B, H]`` (per head) or ``[B]`` (``head_adaptive``).
    """
    b, h, n = scores.shape
    if head_adaptive:
        # Flatten (n, h) n-major so that the stable sort breaks ties by (n, h).
        sel = _select_lowest(
            scores.transpose(1, 2).reshape(b, n * h),
            eligible.transpose(1, 2).reshape(b, n * h),
            k,
        )
        sel = sel.view(b, n, h).transpose(1, 2)
    else:
        sel = _select_lowest(scores.reshape(b * h, n), eligible.reshape(b * h, n), k.reshape(b * h))
        sel = sel.view(b, h, n)
    return torch.where(sel, torch.full_like(new, to_state), new)


def check_shapes(scores: Tensor, state: Tensor, sink: Tensor | Sinks) -> tuple[int, int, int]:
    """``(B, H, N)`` of ``scores``, after checking that ``state`` and ``sink`` (or its positions) share it."""
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, H, N], got shape {tuple(scores.shape)}")
    b, h, n = scores.shape
    sinks = ("sink.pos", sink.pos) if isinstance(sink, Sinks) else ("sink", sink)
    for name, t in (("state", state), sinks):
        if tuple(t.shape) != (b, h, n):
            raise ValueError(f"{name} must have shape {(b, h, n)}, got {tuple(t.shape)}")
    if isinstance(sink, Sinks) and tuple(sink.end.shape) != (b,):
        raise ValueError(f"sink.end must have shape {(b,)}, got {tuple(sink.end.shape)}")
    return b, h, n


def _lengths(logical_len: Tensor | int, device: torch.device) -> Tensor:
    """Each row's logical length ``N`` as fp32 ``[B, 1, 1]`` (``[1, 1, 1]`` for one for all; at least 1): thresholds
    are ``alpha / N``."""
    if isinstance(logical_len, int):
        return torch.full((1, 1, 1), float(max(logical_len, 1)), device=device)
    return logical_len.to(device=device).clamp(min=1).to(torch.float32).view(-1, 1, 1)


def rows_of(x: Tensor | int, rows: tuple[int, ...], name: str, device: torch.device | None = None) -> Tensor:
    """``x`` as an int64 tensor shaped ``rows`` (an int is every row's), after checking a tensor's shape."""
    if isinstance(x, int):
        return torch.full(rows, x, dtype=torch.int64, device=device)
    if tuple(x.shape) != rows:
        raise ValueError(f"{name} must have shape {rows}, got {tuple(x.shape)}")
    return x.to(dtype=torch.int64, device=device if device is not None else x.device)


def _per_head(alpha: Tensor, h: int, device: torch.device) -> Tensor:
    a = torch.as_tensor(alpha, dtype=torch.float32, device=device).reshape(-1)
    if a.numel() == 1:
        a = a.expand(h)
    if a.numel() != h:
        raise ValueError(f"alpha must be a scalar or have one value per KV head ({h}), got {a.numel()}")
    return a.view(1, h, 1)


def head_row(alpha: Tensor, h: int, device: torch.device) -> Tensor:
    """A threshold per head as a contiguous fp32 ``[h]``, what the allocation kernels read: a layer's own thresholds
    are that already, and are passed as they are (every policy run would otherwise make them again, host work on a
    GPU's critical path)."""
    if (
        isinstance(alpha, Tensor)
        and alpha.dtype == torch.float32
        and alpha.shape == (h,)
        and alpha.device == device
        and alpha.is_contiguous()
    ):
        return alpha
    return _per_head(alpha, h, device).reshape(h).contiguous()


def classify(
    scores: Tensor,
    state: Tensor,
    sink: Tensor,
    logical_len: Tensor,
    window_count: Tensor,
    alpha_h: Tensor,
    alpha_l: Tensor,
    budget: int | None,
    window: int,
    slack: float,
    head_adaptive: bool,
    rho: Tensor | None,
) -> Tensor:
    """New states ``[B, H, N]`` (int8) of the non-window slots of one layer.

    Args:
        scores: ``[B, H, N]`` fp32 significance (mean or sum, per config).
        state: ``[B, H, N]`` int8 current state (``EVICTED`` also marks empty/padding slots).
        sink: ``[B, H, N]`` bool attention-sink slots (never change state; counted as held).
        logical_len: ``[B]`` int64 logical length ``N`` of each row (thresholds are ``alpha / N``).
        window_count: ``[B]`` int64 tokens in each row's dense window (counted against the budget).
        alpha_h, alpha_l: ``[H]`` fp32 (or scalars) thresholds, may contain ``inf``.
        budget: tokens per head, window included, or None (no budget, no OQ cap).
        window: the configured window size ``W`` (used in ``budget - W``).
        slack: ARKV's tailor slack (0.75 in the paper).
        head_adaptive: share the layer's budget (and OQ cap) across heads by score.
        rho: ``[B]`` OQ ratio of this layer per row, or None (OQ cap off).

    See the module docstring for the rules and the tie-break.
    """
    b, h, n = check_shapes(scores, state, sink)
    device = scores.device
    state = state.to(torch.int8)
    if n == 0:
        return state.clone()
    scores = scores.to(torch.float32)
    sink = sink_mask(sink, state)
    movable = ~sink

    # Rule 1: per-head thresholds alpha / N, no promotion; sinks untouched.
    length = _lengths(logical_len, device)
    thr_l = _per_head(alpha_l, h, device) / length
    thr_h = _per_head(alpha_h, h, device) / length
    proposed = torch.where(
        scores < thr_l,
        EVICTED,
        torch.where(scores >= thr_h, ORIGINAL, QUANTIZED),
    ).to(torch.int8)
    new = torch.where(movable, torch.maximum(state, proposed), state)

    if budget is None:
        return new
    budget = int(budget)
    window = int(window)
    wc = window_count.to(device=device, dtype=torch.int64)

    # Rule 2: budget tailor.
    target = budget_target(budget, window, slack)
    kept = new != EVICTED
    evictable = kept & movable
    kept_count = kept.sum(dim=-1)  # [B, H]
    evictable_count = evictable.sum(dim=-1)  # [B, H]
    if head_adaptive:
        kept_row = kept_count.sum(dim=1)  # [B]
        over = kept_row + h * wc > h * budget
        need = torch.minimum((kept_row - h * target).clamp(min=0), evictable_count.sum(dim=1))
    else:
        over = kept_count + wc.unsqueeze(-1) > budget
        need = torch.minimum((kept_count - target).clamp(min=0), evictable_count)
    need = torch.where(over, need, torch.zeros_like(need))
    if bool((need > 0).any()):
        new = _apply_lowest(new, scores, evictable, need, head_adaptive, EVICTED)

    # Rule 3: OQ cap on ORIGINAL non-sink slots.
    if rho is not None:
        cap = oq_cap(rho.to(device).reshape(b), budget, window)  # [B]
        orig = (new == ORIGINAL) & movable
        orig_count = orig.sum(dim=-1)  # [B, H]
        if head_adaptive:
            surplus = (orig_count.sum(dim=1) - h * cap).clamp(min=0)
        else:
            surplus = (orig_count - cap.unsqueeze(-1)).clamp(min=0)
        if bool((surplus > 0).any()):
            new = _apply_lowest(new, scores, orig, surplus, head_adaptive, QUANTIZED)
    return new
