"""Slot metadata of a tier in one launch: :meth:`hfkv.storage.paged.PagedTiers.read_meta`'s contract on the Triton
backend (the torch path of ``read_meta`` is its twin; ``hfkv.kernels.cpu.meta`` is the CPU kernel's).

A policy run reads the position and score sum of every slot of every tier. The torch path builds slot indices,
page lookups, masks and two strided gathers per tier, about a dozen launches; on a GPU a policy run is bound by
its launches (docs/kernels.md, "Runs on a GPU"), so here it is one per tier. :func:`read_candidates_triton` writes
a run's whole candidate list (every tier's slots, then the window's exits, with their states) in one launch, where
the torch composition concatenates and selects in ten more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hfkv.kernels.encode import check_pool
from hfkv.kernels.grid import cdiv
from hfkv.kernels.reference import check_candidates
from hfkv.quant.record import RecordLayout
from hfkv.states import EVICTED, ORIGINAL

__all__ = ["read_candidates_triton", "read_meta_triton"]

_BLOCK = 256
_EVICTED = tl.constexpr(EVICTED)
_ORIGINAL = tl.constexpr(ORIGINAL)


@triton.jit
def _mean(score, pos, length, score_start):
    """A score sum over the queries that saw the token: ``cache._mean_scores``' division, IEEE-rounded as torch's."""
    count = tl.maximum(length - tl.maximum(pos, score_start), 1)
    return tl.math.div_rn(score, count.to(tl.float32))


@triton.jit
def _tier_block(
    words_ptr, table_ptr, table_w, counts_ptr, count_step, m, page_words, tpp, pos_ptr, score_ptr, valid_ptr,
    state_ptr, row, col0, tier, length, start, bh, blk, REC_W: tl.constexpr, STATE: tl.constexpr, MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # block `blk` of one tier's slots of head `bh`: positions, scores (or their means), validity (and states)
    s = blk * BLOCK + tl.arange(0, BLOCK)
    inside = s < m
    live = inside & (s < tl.load(counts_ptr + bh * count_step))
    page = tl.load(table_ptr + bh * table_w + s // tpp, mask=live, other=0).to(tl.int64)
    at = page * page_words + tpp * REC_W + s % tpp  # the tag in the page's tag region, the score past it
    tag = tl.load(words_ptr + at, mask=live, other=0)  # slots past the count: as the null page reads
    score = tl.load(words_ptr.to(tl.pointer_type(tl.float32)) + at + tpp, mask=live, other=0.0)
    out = bh * row + col0 + s  # rows of ``row`` entries, this tier's from ``col0`` (read_meta_triton: m and 0)
    tl.store(pos_ptr + out, (tag - 1).to(pos_ptr.dtype.element_ty), mask=inside)
    if MEAN:
        score = _mean(score, (tag - 1).to(tl.int64), length, start)
    tl.store(score_ptr + out, score, mask=inside)
    tl.store(valid_ptr + out, live.to(tl.uint8), mask=inside)
    if STATE:  # a candidate's state: its tier where live, else evicted
        tl.store(state_ptr + out, tl.where(live, tier, _EVICTED).to(tl.int8), mask=inside)


@triton.jit(
    do_not_specialize=["table_w", "count_step", "m", "page_words", "tpp", "row", "col0", "tier", "length", "start"]
)
def _read_meta_kernel(
    words_ptr, table_ptr, table_w, counts_ptr, count_step, m, page_words, tpp, pos_ptr, score_ptr, valid_ptr,
    state_ptr, row, col0, tier, length, start, REC_W: tl.constexpr, STATE: tl.constexpr, MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    _tier_block(
        words_ptr, table_ptr, table_w, counts_ptr, count_step, m, page_words, tpp, pos_ptr, score_ptr, valid_ptr,
        state_ptr, row, col0, tier, length, start, tl.program_id(0).to(tl.int64), tl.program_id(1), REC_W, STATE,
        MEAN, BLOCK,
    )  # fmt: skip


@triton.jit
def _exit_block(
    exit_pos_ptr, exit_score_ptr, ssb, ssh, ssm, pad_end_ptr, m, heads, pos_ptr, score_ptr, valid_ptr, state_ptr,
    row, col0, length, start, bh, blk, MEAN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # block `blk` of the window's exits of head `bh`: candidates for the original tier (padding: evicted)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    inside = i < m
    b, h = bh // heads, bh % heads
    pos = tl.load(exit_pos_ptr + i, mask=inside, other=0).to(tl.int64)
    live = inside & (pos >= tl.load(pad_end_ptr + b).to(tl.int64))  # an exit below its row's padding end: padding
    out = bh * row + col0 + i
    tl.store(pos_ptr + out, pos, mask=inside)
    score = tl.load(exit_score_ptr + b * ssb + h * ssh + i * ssm, mask=inside).to(tl.float32)
    if MEAN:
        score = _mean(score, pos, length, start)
    tl.store(score_ptr + out, score, mask=inside)
    tl.store(valid_ptr + out, live.to(tl.uint8), mask=inside)
    tl.store(state_ptr + out, tl.where(live, _ORIGINAL, _EVICTED).to(tl.int8), mask=inside)


@triton.jit(
    do_not_specialize=[
        "tw0", "tw1", "tw2", "m0", "m1", "m2", "tpp0", "tpp1", "tpp2", "count_step", "page_words", "ssb", "ssh", "ssm",
        "n_exit", "heads", "row", "length", "start",
    ]
)  # fmt: skip
def _candidates_kernel(
    words_ptr, table0, table1, table2, tw0, tw1, tw2, m0, m1, m2, tpp0, tpp1, tpp2, counts_ptr, count_step,
    page_words, exit_pos_ptr, exit_score_ptr, ssb, ssh, ssm, pad_end_ptr, n_exit, heads, pos_ptr, score_ptr,
    valid_ptr, state_ptr, row, length, start, REC_W0: tl.constexpr, REC_W1: tl.constexpr, REC_W2: tl.constexpr,
    MEAN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Every tier's slots and the window's exits of a run's candidates in one launch: program (head, block), the
    blocks numbered across the parts in order (a tier's, up to three, then the exits')."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    e1 = tl.cdiv(m0, BLOCK)
    e2 = e1 + tl.cdiv(m1, BLOCK)
    e3 = e2 + tl.cdiv(m2, BLOCK)
    if blk < e1:
        _tier_block(words_ptr, table0, tw0, counts_ptr, count_step, m0, page_words, tpp0, pos_ptr, score_ptr,
                    valid_ptr, state_ptr, row, 0, 0, length, start, bh, blk, REC_W0, True, MEAN, BLOCK)  # fmt: skip
    elif blk < e2:
        _tier_block(words_ptr, table1, tw1, counts_ptr + 1, count_step, m1, page_words, tpp1, pos_ptr, score_ptr,
                    valid_ptr, state_ptr, row, m0, 1, length, start, bh, blk - e1, REC_W1, True, MEAN,
                    BLOCK)  # fmt: skip
    elif blk < e3:
        _tier_block(words_ptr, table2, tw2, counts_ptr + 2, count_step, m2, page_words, tpp2, pos_ptr, score_ptr,
                    valid_ptr, state_ptr, row, m0 + m1, 2, length, start, bh, blk - e2, REC_W2, True, MEAN,
                    BLOCK)  # fmt: skip
    else:
        _exit_block(exit_pos_ptr, exit_score_ptr, ssb, ssh, ssm, pad_end_ptr, n_exit, heads, pos_ptr, score_ptr,
                    valid_ptr, state_ptr, row, m0 + m1 + m2, length, start, bh, blk - e3, MEAN, BLOCK)  # fmt: skip


def read_meta_triton(
    pool: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, tpp: int, layout: RecordLayout, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pos int32, score fp32, valid bool)``, each ``[B, H, m]``, of slots ``[0, m)`` of every head of one tier:
    ``read_meta_cpu``'s contract (``pool [pages, page_bytes]`` uint8, ``table [B, H, W]``, ``counts [B, H]``)."""
    check_pool(pool, "read_meta_triton")
    bsz, heads, width = table.shape
    pos = torch.empty(bsz, heads, m, dtype=torch.int32, device=pool.device)
    score = torch.empty(bsz, heads, m, dtype=torch.float32, device=pool.device)
    valid = torch.empty(bsz, heads, m, dtype=torch.uint8, device=pool.device)
    if m and bsz * heads:
        if width == 0:  # no page yet: nothing is live
            pos.fill_(-1)
            score.zero_()
            valid.zero_()
        else:
            _read_meta_kernel[(bsz * heads, cdiv(m, _BLOCK))](
                pool.view(torch.int32), table.contiguous(), width, counts.to(torch.int64).contiguous(), 1, m,
                pool.shape[1] // 4, tpp, pos, score, valid, valid, m, 0, 0, 0, 0, REC_W=layout.stride // 4, STATE=False,
                MEAN=False, BLOCK=_BLOCK,
            )  # fmt: skip
    return pos, score, valid.view(torch.bool)


def read_candidates_triton(
    pool: torch.Tensor,
    tables: Sequence[torch.Tensor],
    counts: torch.Tensor,
    tpp: Sequence[int],
    layouts: Sequence[RecordLayout],
    m: Sequence[int],
    exit_pos: torch.Tensor,
    exit_score: torch.Tensor,
    pad_end: torch.Tensor,
    mean_over: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`hfkv.storage.paged.PagedTiers.candidates` (its torch twin) in one launch: ``(pos int64, score fp32,
    valid bool, state int8)``, each ``[B, H, sum(m) + len(exit_pos)]`` (``read_candidates_cpu``'s contract). With
    ``mean_over=(length, score_start)`` the scores are the sums' means over the queries that saw each token, as the
    cache ranks them."""
    check_pool(pool, "read_candidates_triton")
    n_exit = check_candidates("read_candidates_triton", counts, tables, tpp, layouts, m, exit_pos, exit_score)
    bsz, heads, tiers = counts.shape
    n, dev, rows = sum(m) + n_exit, pool.device, bsz * heads
    pos = torch.empty(bsz, heads, n, dtype=torch.int64, device=dev)
    score = torch.empty(bsz, heads, n, dtype=torch.float32, device=dev)
    valid = torch.empty(bsz, heads, n, dtype=torch.uint8, device=dev)
    state = torch.empty(bsz, heads, n, dtype=torch.int8, device=dev)
    if rows == 0 or n == 0:
        return pos, score, valid.view(torch.bool), state
    counts64 = counts.to(torch.int64).contiguous()
    mean = mean_over if mean_over is not None else (0, 0)
    # up to three tiers (the kernel's parts): missing ones hold no slot (their table is any tensor, never read)
    if tiers > 3:
        raise ValueError(f"read_candidates_triton: at most 3 tiers (the kernel's parts), got {tiers}")
    pad = 3 - tiers
    tabs = [t.contiguous() for t in tables]
    tabs += tabs[:1] * pad
    widths = [t.shape[-1] for t in tables] + [0] * pad
    recs = [lay.stride // 4 for lay in layouts] + [1] * pad
    blocks = sum(cdiv(x, _BLOCK) for x in [*m, n_exit])
    _candidates_kernel[(rows, blocks)](
        pool.view(torch.int32), *tabs, *widths, *m, *([0] * pad), *tpp, *([1] * pad), counts64, tiers,
        pool.shape[1] // 4, exit_pos.contiguous(), exit_score, *exit_score.stride(), pad_end.contiguous(), n_exit,
        heads, pos, score, valid, state, n, *mean, REC_W0=recs[0], REC_W1=recs[1], REC_W2=recs[2],
        MEAN=mean_over is not None, BLOCK=_BLOCK,
    )  # fmt: skip
    return pos, score, valid.view(torch.bool), state
