"""What a policy run's decisions change, per tier, in one launch and one host read.

After the allocation, a run must know for each tier whether any of its tokens moves to a lower tier (those are
decoded and re-encoded) and whether any leaves it (the tier is compacted). Asked tier by tier in torch, that is
four operations and one host read per question and tier, two dozen launches and six waits per run; on a GPU a
run is bound by its launches (docs/kernels.md, "Runs on a GPU"). :func:`tier_changes_reference` is the twin.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hfkv.kernels.grid import cdiv
from hfkv.states import EVICTED

__all__ = ["tier_changes", "tier_changes_reference"]

_BLOCK = 512
_EVICTED = tl.constexpr(EVICTED)


def tier_changes_reference(new: torch.Tensor, valid: torch.Tensor, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Per tier ``t`` (slots ``[sum(sizes[:t]), sum(sizes[:t + 1]))`` of ``new, valid [B, H, N]``): how many
    valid slots move to a lower tier they are kept in (``t < new != EVICTED``), and how many leave (``new != t``)."""
    out, start = [], 0
    for tier, n in enumerate(sizes):
        nw, ok = new[..., start : start + n], valid[..., start : start + n]
        out.append((int((ok & (nw > tier) & (nw != EVICTED)).sum()), int((ok & (nw != tier)).sum())))
        start += n
    return out


@triton.jit(do_not_specialize=["n", "end0", "end1", "end2", "rows"])
def _changes_kernel(
    new_ptr, valid_ptr, out_ptr, enter_ptr, rows, n, end0, end1, end2, NT: tl.constexpr, ENTER: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    new = tl.load(new_ptr + bh * n + i, mask=inside, other=0).to(tl.int32)
    ok = inside & (tl.load(valid_ptr + bh * n + i, mask=inside, other=0) != 0)
    tier = tl.where(i < end0, 0, tl.where(i < end1, 1, tl.where(i < end2, 2, 3)))  # 3: a window exit
    if ENTER:  # what enters each tier, per head: demoted tokens and the exits kept (moves.plan_moves' counts)
        moving = inside & (new != _EVICTED) & ((tier == 3) | (ok & (new > tier)))
        for t in tl.static_range(NT):
            entering = tl.sum((moving & (new == t)).to(tl.int32), 0)
            tl.atomic_add(enter_ptr + t * rows + bh, entering)
            tl.atomic_add(out_ptr + 2 * NT + t, entering)
    ok = ok & (i < end2)  # the last tier's end (ends past the tiers repeat it): the window's exits are not asked
    for t in tl.static_range(NT):
        mine = ok & (tier == t)
        demoted = tl.sum((mine & (new > t) & (new != _EVICTED)).to(tl.int32), 0)
        leaving = tl.sum((mine & (new != t)).to(tl.int32), 0)
        tl.atomic_add(out_ptr + 2 * t, demoted)
        tl.atomic_add(out_ptr + 2 * t + 1, leaving)
        if ENTER:  # and what leaves each tier, per head (the pages its removal frees)
            tl.atomic_add(enter_ptr + (NT + t) * rows + bh, leaving)


def launch_changes(
    new: torch.Tensor, valid: torch.Tensor, sizes: Sequence[int], entering: bool = False, extra: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The launch behind :func:`tier_changes` and ``moves.plan_moves``, its counts left on the device: an int32
    buffer of ``[demoted, leaving] * tiers``, with ``entering`` then the tokens entering each tier (demoted ones and
    kept window exits), then ``extra`` zeros for the caller; and with ``entering`` the per-head counts, ``[2 *
    tiers, B * H]`` (what enters each tier, then what leaves it)."""
    if not 1 <= len(sizes) <= 3:
        raise ValueError(f"tier_changes: between 1 and 3 tiers, got sizes={list(sizes)}")
    bsz, heads, n = new.shape
    nt, rows = len(sizes), bsz * heads
    counts = (3 if entering else 2) * nt + extra
    buf = torch.zeros(counts + (2 * nt * rows if entering else 0), dtype=torch.int32, device=new.device)  # 1 memset
    per_head = buf[counts:].view(2 * nt, rows) if entering else None
    if n and rows:
        ends = [sum(sizes[: t + 1]) for t in range(nt)]
        ends += [ends[-1]] * (3 - len(ends))
        _changes_kernel[(rows, cdiv(n, _BLOCK))](
            new.contiguous(), valid.contiguous().view(torch.uint8), buf, buf if per_head is None else per_head, rows,
            n, *ends, NT=nt, ENTER=entering, BLOCK=_BLOCK,
        )  # fmt: skip
    return buf[:counts], per_head


def tier_changes(new: torch.Tensor, valid: torch.Tensor, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """:func:`tier_changes_reference` in one launch (``new`` int8, ``valid`` bool, both ``[B, H, N]`` contiguous;
    slots past the tiers' are ignored); at most three tiers."""
    flat = launch_changes(new, valid, sizes)[0].tolist()  # the run's one wait for what changed
    return [(flat[2 * t], flat[2 * t + 1]) for t in range(len(sizes))]
