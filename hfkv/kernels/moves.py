"""A policy run's moves planned on the device: which tokens enter which tier, in append order, in three launches.

After the allocation a run re-encodes the tokens it demotes and admits the window's exits it keeps, one append
per destination tier, each head's tokens in their order (demoted from each tier in tier order, then the exits).
Built in torch, that order was a ``nonzero`` per source (a host wait each), a concatenation, a stable sort by
destination and head, a count read back, and a gather per field: three dozen launches and three waits of a run's
~150 launches and ~12 waits per layer on a GPU, where a run is bound by them (docs/kernels.md, "Runs on a GPU").

Here the change count (:func:`hfkv.kernels.changes.launch_changes`) also counts what enters and leaves each tier per
head, one program turns those into the pages each tier's removal frees and its appends take (what the removal and
the appends read back one by one), the host reads all of it with the counts it already waited for, and one program
per head writes its movers straight to their places: ``(b, h, source, index)`` per token, destination after
destination, heads in order within one, candidates in order within a head. Then one launch per source reads and
decodes the tokens (``gather_decode`` with ``where=``, :func:`gather_exits`) into one buffer the appends slice.
:func:`plan_moves_reference` is the torch twin.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hfkv.kernels.changes import launch_changes, tier_changes_reference
from hfkv.kernels.grid import cdiv
from hfkv.states import EVICTED

__all__ = [
    "EXIT",
    "finish_plan_moves",
    "gather_exits",
    "launch_plan_moves",
    "place_moves",
    "plan_moves",
    "plan_moves_reference",
]

EXIT = 3  # a plan's source code of a window exit (tiers are 0..2)
_EVICTED = tl.constexpr(EVICTED)
_BLOCK = 256
_ROWS = 128
_BLOCK_N = 16

# (changes [(demoted, leaving)] per tier, entering [tokens] per tier, pages [(freed, width after the removal, new,
# width after the appends)] per tier (None without the counts), peak (the fullest row's held cost after the run;
# None without ``held``), b, h, source, index [total] int64 each, heads: per tier and head the count after the
# removal (int64) and the tokens entering (``[tiers, B * H]`` each; None without the counts))
Plan = tuple[list[tuple[int, int]], list[int], list[tuple[int, int, int, int]] | None, int | None, torch.Tensor,
             torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]  # fmt: skip


@triton.jit(do_not_specialize=["rows", "count_step", "tpp0", "tpp1", "tpp2", "cost0", "cost1", "cost2"])
def _pages_kernel(
    counts_ptr, count_step, per_head_ptr, rows, tpp0, tpp1, tpp2, cost0, cost1, cost2, out_ptr, kept_ptr,
    NT: tl.constexpr, PEAK: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: per tier, the pages the run's removal frees and the widest head's pages after it, then the pages
    its appends take and the widest head's after them (what ``release_pages`` and ``count_appends`` read back),
    from the counts before the run and what leaves and enters each head; each head's count after the removal is
    written to ``kept_ptr`` (``[NT, rows]``: what the appends start from, so they need not count). ``PEAK``: then
    the largest cost a row holds after the run (tokens times ``cost<t>`` summed over tiers and over ``GROUP``
    consecutive heads), as two words (31 low bits, the rest): what the cache reads back to know when the next
    run is due."""
    for t in tl.static_range(NT):
        tpp = tpp0 if t == 0 else (tpp1 if t == 1 else tpp2)
        freed = tl.full((), 0, tl.int64)
        kept_w = tl.full((), 0, tl.int64)
        taken = tl.full((), 0, tl.int64)
        wide = tl.full((), 0, tl.int64)
        for r0 in range(0, rows, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            ok = r < rows
            old = tl.load(counts_ptr + r.to(tl.int64) * count_step + t, mask=ok, other=0)
            enter = tl.load(per_head_ptr + t * rows + r, mask=ok, other=0).to(tl.int64)
            leave = tl.load(per_head_ptr + (NT + t) * rows + r, mask=ok, other=0).to(tl.int64)
            kept = old - leave
            tl.store(kept_ptr + t * rows + r, kept, mask=ok)
            pages, kept_pages, after = (old + tpp - 1) // tpp, (kept + tpp - 1) // tpp, (kept + enter + tpp - 1) // tpp
            freed += tl.sum(tl.where(ok, pages - kept_pages, 0), 0)
            kept_w = tl.maximum(kept_w, tl.max(tl.where(ok, kept_pages, 0), 0))
            taken += tl.sum(tl.where(ok, after - kept_pages, 0), 0)
            wide = tl.maximum(wide, tl.max(tl.where(ok, after, 0), 0))
        tl.store(out_ptr + 4 * t, freed.to(tl.int32))
        tl.store(out_ptr + 4 * t + 1, kept_w.to(tl.int32))
        tl.store(out_ptr + 4 * t + 2, taken.to(tl.int32))
        tl.store(out_ptr + 4 * t + 3, wide.to(tl.int32))
    if PEAK:
        groups = rows // GROUP
        peak = tl.full((), 0, tl.int64)
        for g0 in range(0, groups, BLOCK):
            g = g0 + tl.arange(0, BLOCK)
            ok = g < groups
            held = tl.zeros([BLOCK], tl.int64)
            for j in tl.static_range(GROUP):
                r = g * GROUP + j
                for t in tl.static_range(NT):
                    cost = (cost0 if t == 0 else (cost1 if t == 1 else cost2)).to(tl.int64)
                    old = tl.load(counts_ptr + r.to(tl.int64) * count_step + t, mask=ok, other=0)
                    enter = tl.load(per_head_ptr + t * rows + r, mask=ok, other=0).to(tl.int64)
                    leave = tl.load(per_head_ptr + (NT + t) * rows + r, mask=ok, other=0).to(tl.int64)
                    held += cost * (old - leave + enter)
            peak = tl.maximum(peak, tl.max(tl.where(ok, held, 0), 0))
        tl.store(out_ptr + 4 * NT, (peak & 0x7FFFFFFF).to(tl.int32))
        tl.store(out_ptr + 4 * NT + 1, (peak >> 31).to(tl.int32))


@triton.jit(do_not_specialize=["n", "end0", "end1", "end2", "rows", "heads", "base1", "base2"])
def _plan_kernel(
    new_ptr, valid_ptr, enter_ptr, n, end0, end1, end2, rows, heads, base1, base2, b_ptr, h_ptr, src_ptr, idx_ptr,
    NT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    dest = tl.arange(0, 4)  # destination tiers (NT <= 3), one lane spare
    # where this head's segment of each destination starts: the destination's base and the heads before it
    before = tl.zeros([4], tl.int64)
    for r0 in range(0, r, ROWS):
        rr = r0 + tl.arange(0, ROWS)
        m = (dest < NT)[:, None] & (rr < r)[None, :]
        before += tl.sum(tl.load(enter_ptr + dest[:, None] * rows + rr[None, :], mask=m, other=0).to(tl.int64), 1)
    at = before + tl.where(dest == 1, base1, tl.where(dest == 2, base2, 0)).to(tl.int64)
    row = r.to(tl.int64)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        inside = i < n
        new = tl.load(new_ptr + row * n + i, mask=inside, other=_EVICTED).to(tl.int32)
        ok = inside & (tl.load(valid_ptr + row * n + i, mask=inside, other=0) != 0)
        tier = tl.where(i < end0, 0, tl.where(i < end1, 1, tl.where(i < end2, 2, 3)))
        moving = inside & (new != _EVICTED) & ((tier == 3) | (ok & (new > tier)))
        sel = moving[None, :] & (new[None, :] == dest[:, None])  # [4, BLOCK]: at most one destination a column
        rank = tl.cumsum(sel.to(tl.int64), 1) - 1
        where = tl.sum(tl.where(sel, at[:, None] + rank, 0), 0)
        start = tl.where(tier == 0, 0, tl.where(tier == 1, end0, tl.where(tier == 2, end1, end2)))
        tl.store(b_ptr + where, row // heads, mask=moving)
        tl.store(h_ptr + where, row % heads, mask=moving)
        tl.store(src_ptr + where, tier.to(tl.int64), mask=moving)
        tl.store(idx_ptr + where, (i - start).to(tl.int64), mask=moving)
        at += tl.sum(sel.to(tl.int64), 1)


def plan_moves(
    new: torch.Tensor,
    valid: torch.Tensor,
    sizes: Sequence[int],
    counts: torch.Tensor | None = None,
    tpp: Sequence[int] | None = None,
    held: tuple[Sequence[int], int] | None = None,
) -> Plan:
    """What a run moves (``new, valid [B, H, N]``: the allocation's states of the candidates, every tier's slots
    (``sizes``) then the window's exits): ``(changes, entering, pages, peak, b, h, source, index, heads)``,
    ``changes`` as :func:`hfkv.kernels.changes.tier_changes` gives them, ``entering[t]`` the tokens tier ``t``
    takes, and per token, destination after destination, its head, its source (a tier, or :data:`EXIT`) and its slot
    there (or its exit index). With the tiers' ``counts [B, H, tiers]`` (int64, before the run) and records per page
    ``tpp``, ``pages[t]`` is what the run's removal and appends of tier ``t`` free and take: ``(freed, widest after
    the removal, new, widest after the appends)``, so neither reads them back, and ``heads`` each head's count after
    the removal and the tokens entering it, per tier (``[tiers, B * H]`` each: what the appends start from, so they
    need not count); with ``held = (cost per tier, group)`` too, ``peak`` is the largest ``sum(cost[t] * tokens of
    tier t)`` over the tiers and ``group`` consecutive heads after the run (the cache's tier peak, without a read of
    its own). Two or three launches and one host read: :func:`launch_plan_moves`, the read of its numbers, then
    :func:`finish_plan_moves` (a caller that can wait for the numbers later calls the two itself)."""
    launched = launch_plan_moves(new, valid, sizes, counts, tpp, held)
    return finish_plan_moves(new, valid, sizes, launched, launched[0].tolist())  # the run's one wait


def launch_plan_moves(
    new: torch.Tensor,
    valid: torch.Tensor,
    sizes: Sequence[int],
    counts: torch.Tensor | None = None,
    tpp: Sequence[int] | None = None,
    held: tuple[Sequence[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`plan_moves`' launches before its host read: ``(numbers, per_head, kept)``, ``numbers`` the int32
    device buffer the host reads (:func:`finish_plan_moves` takes it read), the other two what the appends start
    from (``kept`` None without the counts). One or two launches, no wait."""
    bsz, heads, _ = new.shape
    nt, rows = len(sizes), bsz * heads
    with_pages = counts is not None
    with_peak = with_pages and held is not None
    if with_peak and (len(held[0]) != nt or held[1] < 1 or rows % held[1]):
        raise ValueError(f"plan_moves: held={held} must be (one cost per tier ({nt}), a group dividing {rows} rows)")
    extra = 4 * nt + 2 * with_peak if with_pages else 0
    out, per_head = launch_changes(new, valid, sizes, entering=True, extra=extra)
    kept = torch.empty(nt, rows, dtype=torch.int64, device=new.device) if with_pages else None
    if with_pages and rows:
        tpps = [*tpp, *([1] * (3 - nt))]
        costs = [*(held[0] if with_peak else ()), *([0] * (3 - nt * with_peak))]
        _pages_kernel[(1,)](
            counts, counts.shape[-1], per_head, rows, *tpps, *costs, out[3 * nt :], kept, NT=nt, PEAK=with_peak,
            GROUP=held[1] if with_peak else 1, BLOCK=_ROWS,
        )  # fmt: skip
    return out, per_head, kept


def finish_plan_moves(
    new: torch.Tensor,
    valid: torch.Tensor,
    sizes: Sequence[int],
    launched: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    flat: Sequence[int],
) -> Plan:
    """:func:`plan_moves` from its launches (``launched``, :func:`launch_plan_moves`' for the same ``new, valid,
    sizes``) and their numbers read back (``flat``, the first of them as a list): the movers placed (one launch)."""
    nt = len(sizes)
    _, per_head, kept = launched
    with_pages = kept is not None
    extra = len(flat) - 3 * nt
    if extra not in ((0, 4 * nt, 4 * nt + 2) if with_pages else (0,)):
        raise ValueError(f"finish_plan_moves: {len(flat)} numbers read for {nt} tiers (with pages: {with_pages})")
    with_peak = extra == 4 * nt + 2
    changes = [(flat[2 * t], flat[2 * t + 1]) for t in range(nt)]
    entering = list(flat[2 * nt : 3 * nt])
    pages = [tuple(flat[3 * nt + 4 * t : 3 * nt + 4 * t + 4]) for t in range(nt)] if with_pages else None
    peak = flat[7 * nt] + (flat[7 * nt + 1] << 31) if with_peak else None
    heads_after = (kept, per_head[:nt]) if with_pages else None
    return changes, entering, pages, peak, *place_moves(new, valid, sizes, per_head, entering), heads_after


def place_moves(
    new: torch.Tensor, valid: torch.Tensor, sizes: Sequence[int], entering_rows: torch.Tensor, entering: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`plan_moves`' last launch: each mover's ``(b, h, source, index)`` at its place, from the tokens
    entering each tier per head (``entering_rows``' first ``tiers`` rows of ``B * H``) and in all (``entering``,
    on the host)."""
    bsz, heads, n = new.shape
    nt, rows, total = len(sizes), bsz * heads, sum(entering)
    b, h, src, idx = (torch.empty(total, dtype=torch.int64, device=new.device) for _ in range(4))
    if total:
        ends = [sum(sizes[: t + 1]) for t in range(nt)]
        ends += [ends[-1]] * (3 - len(ends))
        base1 = entering[0]
        base2 = base1 + (entering[1] if nt > 1 else 0)
        _plan_kernel[(rows,)](
            new.contiguous(), valid.contiguous().view(torch.uint8), entering_rows, n, *ends, rows, heads, base1, base2,
            b, h, src, idx, NT=nt, BLOCK=_BLOCK, ROWS=_ROWS,
        )  # fmt: skip
    return b, h, src, idx


def plan_moves_reference(
    new: torch.Tensor,
    valid: torch.Tensor,
    sizes: Sequence[int],
    counts: torch.Tensor | None = None,
    tpp: Sequence[int] | None = None,
    held: tuple[Sequence[int], int] | None = None,
) -> Plan:
    """Torch twin of :func:`plan_moves`: the movers found with ``nonzero`` and put in order by a stable sort, the
    pages from each head's counts after the removal and after the appends, the peak from the counts after both."""
    bsz, heads, n = new.shape
    nt = len(sizes)
    ends = [sum(sizes[: t + 1]) for t in range(nt)]
    tier = torch.full((n,), EXIT, dtype=torch.int64)
    for t in reversed(range(nt)):
        tier[: ends[t]] = t
    start = torch.tensor([[0, *ends][t] if t < nt else ends[-1] for t in range(EXIT + 1)])[tier]
    nw = new.long()
    moving = (nw != EVICTED) & ((tier == EXIT) | (valid & (nw > tier)))
    b, h, i = moving.nonzero(as_tuple=True)  # (b, h, i) order: heads in order, candidates in order
    dest = nw[b, h, i]
    order = torch.sort(dest, stable=True).indices
    entering = [int((dest == t).sum()) for t in range(nt)]
    pages = peak = heads_after = None
    if counts is not None:
        pages, after_run, kept_t, enter_t = [], [], [], []
        for t in range(nt):
            leaving = (valid & (tier == t) & (nw != t)).sum(-1)  # [B, H]
            entering_t = (moving & (nw == t)).sum(-1)
            old = counts[..., t]
            kept = old - leaving
            have, kept_pages, after = ((x + tpp[t] - 1) // tpp[t] for x in (old, kept, kept + entering_t))
            pages.append((int((have - kept_pages).sum()), int(kept_pages.max()), int((after - kept_pages).sum()),
                          int(after.max())))  # fmt: skip
            after_run.append(kept + entering_t)
            kept_t.append(kept.reshape(-1))
            enter_t.append(entering_t.reshape(-1).to(torch.int32))
        heads_after = (torch.stack(kept_t), torch.stack(enter_t))
        if held is not None:
            cost, group = held
            rows = sum(c * n for c, n in zip(cost, after_run, strict=True)).reshape(-1, group).sum(-1)
            peak = int(rows.max()) if rows.numel() else 0
    b, h, i = b[order], h[order], i[order]
    return tier_changes_reference(new, valid, sizes), entering, pages, peak, b, h, tier[i], i - start[i], heads_after


@triton.jit(do_not_specialize=["n", "skb", "skh", "skm", "skd", "svb", "svh", "svm", "svd", "ssb", "ssh", "ssm"])
def _exits_kernel(
    k_ptr, v_ptr, skb, skh, skm, skd, svb, svh, svm, svd, pos_ptr, score_ptr, ssb, ssh, ssm, b_ptr, h_ptr, src_ptr,
    idx_ptr, n, k_out, v_out, pos_out, score_out, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = j < n
    live = live & (tl.load(src_ptr + j, mask=live, other=0) == 3)
    b = tl.load(b_ptr + j, mask=live, other=0)
    h = tl.load(h_ptr + j, mask=live, other=0)
    i = tl.load(idx_ptr + j, mask=live, other=0)
    d = tl.arange(0, BLOCK_D)
    m = live[:, None] & (d < D)[None, :]
    out = j[:, None] * D + d[None, :]
    k = tl.load(k_ptr + (b * skb + h * skh + i * skm)[:, None] + d[None, :] * skd, mask=m, other=0.0)
    tl.store(k_out + out, k.to(tl.float32), mask=m)
    v = tl.load(v_ptr + (b * svb + h * svh + i * svm)[:, None] + d[None, :] * svd, mask=m, other=0.0)
    tl.store(v_out + out, v.to(tl.float32), mask=m)
    tl.store(pos_out + j, tl.load(pos_ptr + i, mask=live, other=0).to(tl.int64), mask=live)
    tl.store(score_out + j, tl.load(score_ptr + b * ssb + h * ssh + i * ssm, mask=live, other=0.0), mask=live)


def gather_exits(
    k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
    src: torch.Tensor, idx: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:  # fmt: skip
    """Write the plan's window exits (``src == EXIT``; ``k, v [B, H, m, D]``, ``pos [m]``, ``score [B, H, m]``)
    into ``out = (k, v [n, D] fp32, pos [n] int64, score [n] fp32)`` at their plan
    rows, ``k`` and ``v`` as fp32; other rows are left as they are. One launch."""
    n, dim = b.numel(), k.shape[-1]
    if n == 0:
        return
    _exits_kernel[(cdiv(n, _BLOCK_N),)](
        k, v, *k.stride(), *v.stride(), pos.contiguous(), score, *score.stride(), b, h, src, idx, n, *out,
        D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=_BLOCK_N,
    )  # fmt: skip
