"""The memory-budget allocation on GPU tensors: :func:`hfkv.policy.budget.allocate`'s decisions in three Triton
launches around one sort (the torch function is the twin; ``hfkv.kernels.cpu.allocate`` is the CPU kernel).

A policy run on a GPU is bound by its launches (docs/kernels.md, "Runs on a GPU"): the torch allocation is some
sixty element-wise operations around its sort, each a launch of a few microseconds of host time over a few
hundred kilobytes. Here the element-wise work before the sort (floors, items, their sort keys, the bytes each
row holds) is one launch, whether everything fits (nothing moves: the one host read) one program, the scan after
the sort (exact cap, bytes spent, items taken) one program per row, and the decision per token one more. The sort
stays torch's (a stable radix sort of int32 keys: half the passes of int64 ones).

Exactness: every number the decisions compare is computed by the same IEEE-rounded fp32 / int64 operations as
in the twin (divisions by ``div_rn``, not the approximate fp32 division Triton emits for ``/``), and the present
items are put in the twin's order (its keys, shifted into 32 bits; absent items, which the scan skips, go first
instead of last), so the states are equal bit for bit (``tests/test_kernel_allocate.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from hfkv.kernels.grid import cdiv
from hfkv.policy.budget import Costs, check_tiers, item_tables
from hfkv.policy.unified import Sinks, check_shapes, head_row
from hfkv.states import EVICTED, ORIGINAL, TIER_NAMES

__all__ = ["allocate_triton"]

_BLOCK = 256  # tokens per program of the item and decision passes
_SCAN_BLOCK = 1024  # sorted items per iteration of a row's scan
_FITS_BLOCK = 128  # rows per iteration of the fast path's check
_EVICTED = tl.constexpr(EVICTED)  # the kernels' copies of the states
_ORIGINAL = tl.constexpr(ORIGINAL)
_ABSENT = tl.constexpr(-(2**31))  # an absent item's sort key (int32's least)


@triton.jit
def _is_sink(sink_ptr, pos_ptr, end_ptr, at, b, held, inside, SINK_POS: tl.constexpr):
    # a slot's sink flag (SINK_POS: held and below its row's end; padding lanes count as sinks: nothing moves them)
    if SINK_POS:
        return (~inside) | (held & (tl.load(pos_ptr + at, mask=inside, other=0) < tl.load(end_ptr + b)))
    return tl.load(sink_ptr + at, mask=inside, other=1) != 0


@triton.jit(do_not_specialize=["n", "prior", "length_s"])
def _items_kernel(
    scores_ptr, state_ptr, sink_ptr, pos_ptr, end_ptr, len_ptr, length_s, alpha_l_ptr, alpha_h_ptr, prior,
    present_ptr, rate_ptr, cost_ptr, new_ptr, key_ptr, sink_bytes_ptr, cand_bytes_ptr, exact_ptr, taken_ptr, n,
    H: tl.constexpr, K: tl.constexpr, ADAPTIVE: tl.constexpr, EXACT_ROW: tl.constexpr, BLOCK: tl.constexpr,
    SINK_POS: tl.constexpr, LEN_SCALAR: tl.constexpr,
):  # fmt: skip
    """One program per (row b * H + head, block of tokens): floors, then each token's K items as sort keys; each
    token's count of items taken (the scan's) starts at zero here, where it would be a memset of its own."""
    bh = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    at = bh * n + i
    s = tl.load(scores_ptr + at, mask=inside, other=0.0)
    state = tl.load(state_ptr + at, mask=inside, other=_EVICTED).to(tl.int32)
    sink = _is_sink(sink_ptr, pos_ptr, end_ptr, at, bh // H, state != _EVICTED, inside, SINK_POS)
    # The twin's thresholds alpha / N and prior term (prior / N = reciprocal(N) * prior in torch), IEEE-rounded.
    if LEN_SCALAR:  # every row's length, a launch argument
        length = tl.maximum(length_s, 1).to(tl.float32)
    else:
        length = tl.maximum(tl.load(len_ptr + bh // H), 1).to(tl.float32)
    lo = tl.math.div_rn(tl.load(alpha_l_ptr + bh % H), length)
    hi = tl.math.div_rn(tl.load(alpha_h_ptr + bh % H), length)
    add = tl.math.div_rn(1.0, length) * prior
    movable = (~sink) & inside
    new = tl.where(movable & (s < lo), _EVICTED, state)
    cand = movable & (new != _EVICTED)
    can_exact = cand & (new == _ORIGINAL)
    exact_only = can_exact & (s >= hi)
    tl.store(new_ptr + at, new.to(tl.int8), mask=inside)
    # Bytes held: by the sinks (taken from the room first) and by the candidates at their current tier.
    tier_cost = tl.load(cost_ptr + tl.minimum(new, _EVICTED))
    sink_held = tl.where(sink & inside, tier_cost, 0)
    tl.atomic_add(sink_bytes_ptr + bh, tl.sum(sink_held, 0))
    tl.atomic_add(cand_bytes_ptr + bh, tl.sum(tl.where(cand, tier_cost, 0), 0))
    tl.atomic_add(exact_ptr + bh, tl.sum(can_exact.to(tl.int64), 0))
    # Items, cheapest first: value per byte = (score + prior / N) * the hull's slope (exact-only tokens: the
    # exact tier's). The keys are 32-bit (a sort of half the passes of the twin's 64-bit ones): a present item's is
    # the twin's order of values, shifted into int32 (never its least value, which only a NaN would reach); an absent
    # one's is that least value, so it sorts first instead of last, which the scan (it skips them, taking nothing)
    # cannot tell: the present items keep the twin's order among themselves, ties by position as the stable sort.
    s_prior = s + add
    row = tl.minimum(new, EXACT_ROW - 1)  # the twin's clamp: an evicted token has no present item anyway
    cls = tl.where(exact_only, EXACT_ROW, row)  # the rate table's last row: the exact tier's rate
    b = bh // H
    head = bh % H
    for j in tl.static_range(K):
        present = cand & (tl.load(present_ptr + row * K + j) != 0)
        eff = tl.where(present, s_prior * tl.load(rate_ptr + cls * K + j), 0.0)
        eff = eff + 0.0  # -0.0 + 0.0 == +0.0: the twin's _ordered_key
        bits = eff.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        desc = 4294967295 - (ordered + 2147483648)  # the twin's key of a present item, in [0, 2**32)
        key = tl.where(present, desc - 2147483648, _ABSENT).to(tl.int32)
        if ADAPTIVE:  # one row per layer row b: items ordered (token, head, item)
            dst = b * (n * H * K) + (i.to(tl.int64) * H + head) * K + j
        else:  # one row per (b, head): (token, item)
            dst = bh * (n * K) + i.to(tl.int64) * K + j
        tl.store(key_ptr + dst, key, mask=inside)
    # the token's entry of the scan's counts, where _decide_kernel reads it
    if ADAPTIVE:
        tl.store(taken_ptr + b * (n * H) + i.to(tl.int64) * H + head, tl.zeros([BLOCK], tl.int32), mask=inside)
    else:
        tl.store(taken_ptr + at, tl.zeros([BLOCK], tl.int32), mask=inside)


@triton.jit(do_not_specialize=["rows", "room_s"])
def _fits_kernel(
    sums_ptr, room_ptr, room_s, cap_ptr, left_ptr, flag_ptr, rows, HEADS: tl.constexpr, HAS_CAP: tl.constexpr,
    BLOCK: tl.constexpr, ROOM_SCALAR: tl.constexpr,
):  # fmt: skip
    """One program: each row's room left past its sinks' bytes (the scan's room), and whether every row's candidates
    fit it (and its exact ones the cap): the fast path's flag, read back once. ``HEADS``: sums a row adds up (the
    KV heads when head-adaptive: a row is then a batch row, else 1)."""
    n = rows * HEADS  # entries of each of the three sums ([B, H])
    fits = tl.full((), 1, tl.int32)
    for r0 in range(0, rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        inside = r < rows
        sink = tl.zeros([BLOCK], tl.int64)
        cand = tl.zeros([BLOCK], tl.int64)
        exact = tl.zeros([BLOCK], tl.int64)
        for h in tl.static_range(HEADS):
            at = r * HEADS + h
            sink += tl.load(sums_ptr + at, mask=inside, other=0)
            cand += tl.load(sums_ptr + n + at, mask=inside, other=0)
            exact += tl.load(sums_ptr + 2 * n + at, mask=inside, other=0)
        if ROOM_SCALAR:  # every row's room, a launch argument
            left = room_s - sink
        else:
            left = tl.load(room_ptr + r, mask=inside, other=0) - sink
        tl.store(left_ptr + r, left, mask=inside)
        ok = cand <= left
        if HAS_CAP:
            ok = ok & (exact <= tl.load(cap_ptr + r, mask=inside, other=0))
        fits = tl.minimum(fits, tl.min(tl.where(inside & ~ok, 0, 1), 0))
    tl.store(flag_ptr, fits)


@triton.jit(do_not_specialize=["length"])
def _scan_kernel(
    sorted_ptr, order_ptr, step_cost_ptr, target_ptr, room_ptr, cap_ptr, taken_ptr, length,
    K: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per row: walk its items in sorted order, taking them while the bytes spent fit the room (the
    exact cap skipping upgrades past it); count each token's items taken."""
    r = tl.program_id(0).to(tl.int64)
    room = tl.load(room_ptr + r)
    cap = tl.load(cap_ptr + r)  # the room when there is no cap (unread)
    spent = tl.full((), 0, tl.int64)
    exact = tl.full((), 0, tl.int64)
    for start in range(0, length, BLOCK):
        o = start + tl.arange(0, BLOCK)
        inside = o < length
        key = tl.load(sorted_ptr + r * length + o, mask=inside, other=_ABSENT)
        idx = tl.load(order_ptr + r * length + o, mask=inside, other=0)
        j = idx % K
        allowed = inside & (key != _ABSENT)
        if HAS_CAP:
            to_exact = allowed & (tl.load(target_ptr + j) == _ORIGINAL)
            seen = exact + tl.cumsum(to_exact.to(tl.int64), 0)
            exact += tl.sum(to_exact.to(tl.int64), 0)
            allowed = allowed & ((~to_exact) | (seen <= cap))
        cost = tl.where(allowed, tl.load(step_cost_ptr + j), 0)
        running = spent + tl.cumsum(cost, 0)
        spent += tl.sum(cost, 0)
        taken = allowed & (running <= room)
        tl.atomic_add(taken_ptr + r * (length // K) + idx // K, 1, mask=taken)


@triton.jit(do_not_specialize=["n"])
def _decide_kernel(
    new_ptr, sink_ptr, pos_ptr, end_ptr, taken_ptr, target_ptr, out_ptr, n,
    H: tl.constexpr, ADAPTIVE: tl.constexpr, BLOCK: tl.constexpr, SINK_POS: tl.constexpr,
):  # fmt: skip
    """A token takes a prefix of its items (slopes fall along them): it ends in the tier its last one reaches."""
    bh = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    at = bh * n + i
    new = tl.load(new_ptr + at, mask=inside, other=_EVICTED)
    # a sink is held after the floors exactly where it was before them (floors never move a sink)
    sink = _is_sink(sink_ptr, pos_ptr, end_ptr, at, bh // H, new.to(tl.int32) != _EVICTED, inside, SINK_POS)
    if ADAPTIVE:
        m = tl.load(taken_ptr + (bh // H) * (n * H) + i.to(tl.int64) * H + bh % H, mask=inside, other=0)
    else:
        m = tl.load(taken_ptr + at, mask=inside, other=0)
    decided = tl.where(m > 0, tl.load(target_ptr + tl.maximum(m - 1, 0)), _EVICTED)
    cand = (~sink) & (new != _EVICTED)
    tl.store(out_ptr + at, tl.where(cand, decided, new).to(tl.int8), mask=inside)


@cache
def _tables(cost: tuple, fidelity: tuple, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The twin's item tables on ``device`` (one row per tier state), the rate table with one more row (the
    exact tier's rate for every item of an exact-only token), and each state's bytes (0 for EVICTED and tiers
    that are off)."""
    on = check_tiers(cost, fidelity)
    present, rate, step_cost, target = item_tables(cost, fidelity, on, device)
    exact = torch.tensor(float(fidelity[ORIGINAL]) / int(cost[ORIGINAL]), dtype=torch.float32, device=device)
    rate = torch.cat([rate, exact.expand(1, rate.shape[1])]).contiguous()
    per_state = [int(c) if c is not None else 0 for c in cost] + [0]  # ..., EVICTED
    state_cost = torch.tensor(per_state, dtype=torch.int64, device=device)
    return present.to(torch.uint8).contiguous(), rate, step_cost.contiguous(), target.contiguous(), state_cost


def allocate_triton(
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
    fast_path: bool = True,
) -> Tensor:
    """:func:`hfkv.policy.budget.allocate` (same arguments, same result) in Triton launches. Sinks given by position
    (:class:`Sinks`) are compared in the kernels and ints for ``logical_len`` / ``room`` go as launch arguments: a
    policy run makes no mask or filled tensor first.

    ``fast_path=False``: rank without first reading back whether everything fits (the same states either way),
    for a caller that knows some row does not (a cache over its budget: every run at a long context), so the
    run's allocation waits on nothing."""
    b, h, n = check_shapes(scores, state, sink)
    device = scores.device
    present_t, rate_t, step_cost_t, target_t, state_cost = _tables(tuple(cost), tuple(fidelity), device)
    k = step_cost_t.numel()
    rows = (b,) if head_adaptive else (b, h)
    if not isinstance(room, int) and tuple(room.shape) != rows:
        raise ValueError(f"room must have shape {rows}, got {tuple(room.shape)}")
    if exact_cap is not None and tuple(exact_cap.shape) != rows:
        raise ValueError(f"exact_cap must have shape {rows}, got {tuple(exact_cap.shape)}")
    state = state.to(torch.int8).contiguous()
    if n == 0:
        return state.clone()
    alpha_l, alpha_h = head_row(alpha_l, h, device), head_row(alpha_h, h, device)
    new = torch.empty((b, h, n), dtype=torch.int8, device=device)
    keys = torch.empty((b, h * n * k) if head_adaptive else (b * h, n * k), dtype=torch.int32, device=device)
    sums = torch.zeros(3, b, h, dtype=torch.int64, device=device)  # sink bytes, candidate bytes, exact
    taken = torch.empty((b, h * n) if head_adaptive else (b * h, n), dtype=torch.int32, device=device)  # zeroed below
    sink_pos = isinstance(sink, Sinks)
    if sink_pos:  # compared in the kernels (the mask's pointer is an unread stand-in)
        sink8, pos, end = state, sink.pos.to(torch.int64).contiguous(), sink.end.to(device, torch.int64).contiguous()
    else:
        sink8 = sink.to(torch.uint8).contiguous()
        pos = end = sink8
    len_scalar = isinstance(logical_len, int)
    lengths = state if len_scalar else logical_len.to(device=device, dtype=torch.int64).reshape(b)
    grid = (b * h, cdiv(n, _BLOCK))
    _items_kernel[grid](
        scores.to(torch.float32).contiguous(), state, sink8, pos, end, lengths, logical_len if len_scalar else 0,
        alpha_l, alpha_h, float(prior), present_t, rate_t, state_cost, new, keys, sums[0], sums[1], sums[2], taken,
        n, H=h, K=k, ADAPTIVE=head_adaptive, EXACT_ROW=len(TIER_NAMES), BLOCK=_BLOCK, SINK_POS=sink_pos,
        LEN_SCALAR=len_scalar,
        enable_fp_fusion=False,  # score + reciprocal(N) * prior rounded twice, as torch computes it (no FMA)
    )  # fmt: skip
    n_rows = keys.shape[0]
    left = torch.empty(n_rows, dtype=torch.int64, device=device)  # each row's room past its sinks
    flag = torch.empty(1, dtype=torch.int32, device=device)
    cap = exact_cap.to(device=device, dtype=torch.int64).reshape(-1).contiguous() if exact_cap is not None else left
    room_scalar = isinstance(room, int)
    room_t = left if room_scalar else room.to(device=device, dtype=torch.int64).reshape(-1).contiguous()
    _fits_kernel[(1,)](
        sums, room_t, room if room_scalar else 0, cap, left, flag, n_rows, HEADS=h if head_adaptive else 1,
        HAS_CAP=exact_cap is not None, BLOCK=_FITS_BLOCK, ROOM_SCALAR=room_scalar,
    )  # fmt: skip
    if fast_path and flag.item():  # the one host read: nothing moves
        return new
    sorted_keys, order = torch.sort(keys, dim=-1, stable=True)
    _scan_kernel[(n_rows,)](
        sorted_keys, order, step_cost_t, target_t, left, cap, taken, keys.shape[1],
        K=k, HAS_CAP=exact_cap is not None, BLOCK=_SCAN_BLOCK,
    )  # fmt: skip
    out = torch.empty_like(new)
    _decide_kernel[grid](new, sink8, pos, end, taken, target_t, out, n, H=h, ADAPTIVE=head_adaptive, BLOCK=_BLOCK,
                         SINK_POS=sink_pos)  # fmt: skip
    return out
