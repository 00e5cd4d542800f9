"""Compaction's data movement inside the byte pool: copying whole records and emptying vacated slots.

A removal keeps each head's live slots a dense prefix by moving the tier's last kept records into
the holes below the new count, then zeroes the tags of the slots it vacated. On the torch path
that is a gather and a scatter through a ``[pages, tpp, record]`` view per tier; here it is one
launch that copies 4-byte words (records are 4-byte multiples at 4-aligned offsets) and one that
stores zero tags.

The copy assumes what compaction guarantees: sources and destinations are disjoint sets of
records (the holes lie below the new count, the moved records at or above it). Programs run in no
particular order, so a record that were both read and written by the same launch could be read
before or after it is overwritten.

``move_records_reference`` and ``clear_tags_reference`` are the torch twins.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hfkv.kernels.encode import check_offsets, check_pool
from hfkv.kernels.parts import head_step
from hfkv.quant.record import RecordLayout

_MAX_BLOCK = 1024  # words per program; a record is copied by cdiv(words, block) programs


@triton.jit
def _move_kernel(words_ptr, src_ptr, dst_ptr, n_words, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = w < n_words
    src = tl.load(src_ptr + i) // 4
    dst = tl.load(dst_ptr + i) // 4
    tl.store(words_ptr + dst + w, tl.load(words_ptr + src + w, mask=m), mask=m)


@triton.jit
def _clear_kernel(words_ptr, at_ptr, n, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    at = tl.load(at_ptr + j, mask=m, other=0)
    tl.store(words_ptr + at // 4, tl.zeros([BLOCK], tl.int32), mask=m)


def _check_move(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, record_bytes: int, where: str) -> None:
    check_pool(pool, where)
    if not isinstance(record_bytes, int) or record_bytes <= 0 or record_bytes % 4:
        raise ValueError(f"{where}: record_bytes={record_bytes!r} must be a positive multiple of 4")
    check_offsets(src, "src", None, pool.device, where)
    check_offsets(dst, "dst", src.shape[0], pool.device, where)


def move_records(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, record_bytes: int) -> None:
    """Copy the ``record_bytes`` bytes at byte offset ``src[i]`` of ``pool`` to ``dst[i]``, for every i.

    Offsets must be 4-aligned and the source and destination records disjoint (see the module
    docstring); neither is checked, as that would cost a host sync.
    """
    _check_move(pool, src, dst, record_bytes, "move_records")
    n = src.shape[0]
    if n == 0:
        return
    n_words = record_bytes // 4
    block = min(triton.next_power_of_2(n_words), _MAX_BLOCK)
    _move_kernel[(n, -(-n_words // block))](pool.view(torch.int32), src, dst, n_words, BLOCK=block)


def move_records_reference(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, record_bytes: int) -> None:
    """Torch twin of :func:`move_records` (a gather, then a scatter)."""
    _check_move(pool, src, dst, record_bytes, "move_records_reference")
    e = torch.arange(record_bytes, device=pool.device)
    flat = pool.view(-1)
    flat[dst[:, None] + e] = flat[src[:, None] + e]


def clear_tags(pool: torch.Tensor, at: torch.Tensor) -> None:
    """Store int32 0 at each 4-aligned byte offset ``at [M]`` of ``pool``: the tags of vacated slots."""
    check_pool(pool, "clear_tags")
    check_offsets(at, "at", None, pool.device, "clear_tags")
    m = at.shape[0]
    if m == 0:
        return
    block = min(triton.next_power_of_2(m), _MAX_BLOCK)
    _clear_kernel[(-(-m // block),)](pool.view(torch.int32), at, m, BLOCK=block)


def clear_tags_reference(pool: torch.Tensor, at: torch.Tensor) -> None:
    """Torch twin of :func:`clear_tags`."""
    check_pool(pool, "clear_tags_reference")
    check_offsets(at, "at", None, pool.device, "clear_tags_reference")
    pool.view(torch.int32).view(-1)[at // 4] = 0


# ------------------------------------------------------------------------------------------ compaction
@triton.jit
def _kept(keep_row, s, ok, KEEP_STATE: tl.constexpr):
    # whether slots s (where ok) are kept: a flag, or (KEEP_STATE >= 0) a new state equal to the tier's own
    x = tl.load(keep_row + s, mask=ok, other=0)
    if KEEP_STATE >= 0:
        return ok & (x.to(tl.int32) == KEEP_STATE)
    return ok & (x != 0)


# A removal's whole data movement in one launch, one program per (row, head): the head's new count (its kept live
# slots), then the j-th hole below it (a live slot not kept) receives the j-th kept record at or above it, both in
# slot order (the torch path's pairing of two nonzero scans), then the live slots past the new count on pages the
# head keeps get a zero tag. Barriers separate the passes: one pass's stores are another thread's loads in the next.
@triton.jit(do_not_specialize=["table_w", "m", "page_words", "tpp", "count_stride", "keep_stride"])
def _compact_kernel(
    words_ptr, table_ptr, table_w, counts_ptr, count_stride, new_ptr, keep_ptr, keep_stride, m, scratch_ptr,
    page_words, tpp, REC_W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, KEEP_STATE: tl.constexpr,
):  # fmt: skip
    _compact_head(
        words_ptr, table_ptr, table_w, counts_ptr, count_stride, new_ptr, keep_ptr, keep_stride, m, scratch_ptr,
        page_words, tpp, tl.program_id(0).to(tl.int64), REC_W, BLOCK, BLOCK_W, KEEP_STATE,
    )  # fmt: skip


# Every tier a policy run removes from in one launch: program (row x head, tier), a tier's kept slots those whose new
# state is the tier's own (a strided slice of the run's states, from column col<t>); a tier of width 0 is left as it is
# (every tier is a part, whichever lose tokens: one compiled instance per model, not one per set of tiers).
@triton.jit(
    do_not_specialize=[
        "tw0", "tw1", "tw2", "count_stride", "keep_stride", "col0", "col1", "col2", "m0", "m1", "m2", "m_max",
        "n_heads", "page_words", "tpp0", "tpp1", "tpp2",
    ]
)  # fmt: skip
def _compact_tiers_kernel(
    words_ptr, table0, table1, table2, tw0, tw1, tw2, counts_ptr, count_stride, new_ptr, keep_ptr, keep_stride,
    col0, col1, col2, m0, m1, m2, scratch_ptr, m_max, n_heads, page_words, tpp0, tpp1, tpp2, REC_W0: tl.constexpr,
    REC_W1: tl.constexpr, REC_W2: tl.constexpr, BW0: tl.constexpr, BW1: tl.constexpr, BW2: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    scratch = scratch_ptr + t.to(tl.int64) * n_heads * m_max
    if t == 0:
        if m0 > 0:
            _compact_head(words_ptr, table0, tw0, counts_ptr, count_stride, new_ptr, keep_ptr + col0, keep_stride,
                          m0, scratch, page_words, tpp0, bh, REC_W0, BLOCK, BW0, 0)  # fmt: skip
    elif t == 1:
        if m1 > 0:
            _compact_head(words_ptr, table1, tw1, counts_ptr + 1, count_stride, new_ptr + n_heads, keep_ptr + col1,
                          keep_stride, m1, scratch, page_words, tpp1, bh, REC_W1, BLOCK, BW1, 1)  # fmt: skip
    else:
        if m2 > 0:
            _compact_head(words_ptr, table2, tw2, counts_ptr + 2, count_stride, new_ptr + 2 * n_heads,
                          keep_ptr + col2, keep_stride, m2, scratch, page_words, tpp2, bh, REC_W2, BLOCK, BW2,
                          2)  # fmt: skip


@triton.jit
def _compact_head(
    words_ptr, table_ptr, table_w, counts_ptr, count_stride, new_ptr, keep_ptr, keep_stride, m, scratch_ptr,
    page_words, tpp, bh, REC_W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, KEEP_STATE: tl.constexpr,
):  # fmt: skip
    cnt = tl.minimum(tl.load(counts_ptr + bh * count_stride), m)
    keep_row = keep_ptr + bh * keep_stride
    lane = tl.arange(0, BLOCK)
    # 0. the new count: kept live slots (flags past the count do not count)
    keep_n = tl.full((), 0, tl.int64)
    for start in range(0, cnt, BLOCK):
        s = start + lane
        keep_n += tl.sum(_kept(keep_row, s, s < cnt, KEEP_STATE).to(tl.int64), 0)
    tl.store(new_ptr + bh, keep_n)
    pages = table_ptr + bh * table_w
    holes = scratch_ptr + bh * m
    # 1. the holes below the new count, by rank
    base = 0
    for start in range(0, keep_n, BLOCK):
        s = start + lane
        hole = (~_kept(keep_row, s, s < keep_n, KEEP_STATE)) & (s < keep_n)
        rank = base + tl.cumsum(hole.to(tl.int32), 0) - 1
        tl.store(holes + rank, s.to(tl.int32), mask=hole)
        base += tl.sum(hole.to(tl.int32), 0)
    tl.debug_barrier()
    # 2. the kept records at or above it, by rank, into those holes
    w = tl.arange(0, BLOCK_W)
    base = 0
    for start in range(keep_n, cnt, BLOCK):
        s = start + lane
        src = _kept(keep_row, s, s < cnt, KEEP_STATE) & (s < cnt)
        rank = base + tl.cumsum(src.to(tl.int32), 0) - 1
        dst = tl.load(holes + rank, mask=src, other=0).to(tl.int64)
        s_page = tl.load(pages + s // tpp, mask=src, other=0).to(tl.int64) * page_words
        d_page = tl.load(pages + dst // tpp, mask=src, other=0).to(tl.int64) * page_words
        s_at = s_page + (s % tpp) * REC_W
        d_at = d_page + (dst % tpp) * REC_W
        both = src[:, None] & (w < REC_W)[None, :]
        rec = tl.load(words_ptr + s_at[:, None] + w[None, :], mask=both, other=0)
        tl.store(words_ptr + d_at[:, None] + w[None, :], rec, mask=both)
        for region in tl.static_range(2):  # the tag, then the score, in their pages' regions
            at = tpp * (REC_W + region)
            meta = tl.load(words_ptr + s_page + at + s % tpp, mask=src, other=0)
            tl.store(words_ptr + d_page + at + dst % tpp, meta, mask=src)
        base += tl.sum(src.to(tl.int32), 0)
    tl.debug_barrier()
    # 3. empty tags for the vacated live slots on the pages the head keeps
    clear_end = tl.minimum(cnt, (keep_n + tpp - 1) // tpp * tpp)
    for start in range(keep_n, clear_end, BLOCK):
        s = start + lane
        ok = s < clear_end
        at = tl.load(pages + s // tpp, mask=ok, other=0).to(tl.int64) * page_words + tpp * REC_W + s % tpp
        tl.store(words_ptr + at, tl.zeros([BLOCK], tl.int32), mask=ok)


def compact(
    pool: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    keep: torch.Tensor,
    tpp: int,
    layout: RecordLayout,
) -> torch.Tensor:
    """:func:`hfkv.kernels.cpu.compact.compact_cpu`'s data movement in one launch (the torch path of
    :meth:`hfkv.storage.paged.PagedTiers.remove` is the twin): ``keep [B, H, M]`` bool, flags past a head's
    count ignored; ``counts [B, H]`` int64 (a tier's view of ``PagedTiers.counts`` is fine), left as it is.
    Returns each head's new count, ``[B, H]`` int64 (its kept live slots). (A policy run's removals compare the
    run's new states in the kernel instead: :func:`remove_tiers`.)"""
    check_pool(pool, "compact")
    bsz, heads, width = table.shape
    m = keep.shape[-1]
    if m == 0 or width == 0 or bsz * heads == 0:
        return torch.zeros(bsz, heads, dtype=torch.int64, device=pool.device)
    keep = keep.contiguous().view(torch.uint8)
    new = torch.empty(bsz, heads, dtype=torch.int64, device=pool.device)  # every head's is written
    step = head_step(counts, "compact")
    scratch = torch.empty(bsz * heads, m, dtype=torch.int32, device=pool.device)
    rec_w = layout.stride // 4
    _compact_kernel[(bsz * heads,)](
        pool.view(torch.int32), table.contiguous(), width, counts, step, new, keep, m, m, scratch, pool.shape[1] // 4,
        tpp, REC_W=rec_w, BLOCK=64, BLOCK_W=triton.next_power_of_2(rec_w), KEEP_STATE=-1,
    )  # fmt: skip
    return new


# ------------------------------------------------------------------------------------------- page release
# The rest of a removal in one program: each head's pages past its new count go onto the pool's free stack (in
# head order, then column order: the order the torch path's boolean index gives them) and leave the table, the
# counts take the new values, and the number freed and the widest head's pages come back in one read.
@triton.jit(do_not_specialize=["table_w", "n_heads", "tpp", "count_stride", "n_free"])
def _release_kernel(
    table_ptr, table_w, counts_ptr, count_stride, new_ptr, free_ptr, n_free, out_ptr, n_heads, tpp,
    BLOCK: tl.constexpr,
):  # fmt: skip
    total, widest = _release_tier(table_ptr, table_w, counts_ptr, count_stride, new_ptr, free_ptr, n_free,
                                  n_heads, tpp, BLOCK)  # fmt: skip
    tl.store(out_ptr, total)
    tl.store(out_ptr + 1, widest)


# The page releases of _compact_tiers_kernel's tiers in one program, in tier order (each tier's pages pushed after
# the ones before: the order of one removal after another); a tier of width 0 is skipped.
@triton.jit(
    do_not_specialize=["tw0", "tw1", "tw2", "count_stride", "n_free", "n_heads", "tpp0", "tpp1", "tpp2", "m0", "m1",
                       "m2"]
)  # fmt: skip
def _release_tiers_kernel(
    table0, table1, table2, tw0, tw1, tw2, counts_ptr, count_stride, new_ptr, free_ptr, n_free, n_heads, tpp0, tpp1,
    tpp2, m0, m1, m2, NT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    freed = tl.full((), 0, tl.int64)
    if m0 > 0:
        freed, _ = _release_tier(table0, tw0, counts_ptr, count_stride, new_ptr, free_ptr, n_free, n_heads, tpp0,
                                 BLOCK)  # fmt: skip
    if NT > 1:
        if m1 > 0:
            more, _ = _release_tier(table1, tw1, counts_ptr + 1, count_stride, new_ptr + n_heads, free_ptr,
                                    n_free + freed, n_heads, tpp1, BLOCK)  # fmt: skip
            freed += more
    if NT > 2:
        if m2 > 0:
            _release_tier(table2, tw2, counts_ptr + 2, count_stride, new_ptr + 2 * n_heads, free_ptr, n_free + freed,
                          n_heads, tpp2, BLOCK)  # fmt: skip


@triton.jit
def _release_tier(
    table_ptr, table_w, counts_ptr, count_stride, new_ptr, free_ptr, n_free, n_heads, tpp, BLOCK: tl.constexpr
):
    total = tl.full((), 0, tl.int64)
    widest = tl.full((), 0, tl.int64)
    lane = tl.arange(0, BLOCK)
    for i in range(0, n_heads):
        bh = tl.full((), i, tl.int64)
        old = tl.load(counts_ptr + bh * count_stride)
        new = tl.load(new_ptr + bh)
        old_pages = (old + tpp - 1) // tpp
        new_pages = (new + tpp - 1) // tpp
        row = table_ptr + bh * table_w
        for c0 in range(new_pages, old_pages, BLOCK):
            c = c0 + lane
            ok = c < old_pages
            tl.store(free_ptr + n_free + total + (c - new_pages), tl.load(row + c, mask=ok, other=0), mask=ok)
            tl.store(row + c, tl.zeros([BLOCK], tl.int32), mask=ok)
        total += old_pages - new_pages
        widest = tl.maximum(widest, new_pages)
        tl.store(counts_ptr + bh * count_stride, new)
    return total, widest


def release_pages(
    table: torch.Tensor,
    counts: torch.Tensor,
    new: torch.Tensor,
    tpp: int,
    free_stack: torch.Tensor,
    n_free: int,
    known: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """After :func:`compact`: the pages past each head's new count (``new [B, H]``) pushed onto ``free_stack``
    from ``n_free`` on and set to the null page in ``table [B, H, W]``, ``counts [B, H]`` set to ``new``.
    Returns ``(pages freed, the widest head's pages)``: the one host read of a removal, unless the caller
    ``known`` them already (a planned run's: ``moves.plan_moves``)."""
    bsz, heads, width = table.shape
    if bsz * heads and width:
        out = torch.empty(2, dtype=torch.int64, device=table.device)
        _release_kernel[(1,)](
            table, width, counts, head_step(counts, "release_pages"), new.contiguous(), free_stack, n_free, out,
            bsz * heads, tpp, BLOCK=64,
        )  # fmt: skip
        if known is not None:
            return known
        n_freed, widest = out.tolist()
        return n_freed, widest
    counts.copy_(new)
    return 0, 0


def remove_tiers(
    pool: torch.Tensor,
    tables: Sequence[torch.Tensor],
    counts: torch.Tensor,
    states: torch.Tensor,
    sizes: Sequence[int],
    removing: Sequence[bool],
    tpp: Sequence[int],
    layouts: Sequence[RecordLayout],
    free_stack: torch.Tensor,
    n_free: int,
) -> None:
    """:func:`compact` then :func:`release_pages` for the tiers ``removing`` says (of up to three) in two launches, a
    policy run's removals: tier ``t`` (page table ``tables[t]``, counts ``counts[..., t]`` of ``counts [B, H, T]``
    int64) keeps the slots whose new state, column ``sum(sizes[:t]) + s`` of ``states [B, H, N]`` (int8; slots
    ``s < sizes[t]``: every tier's side by side), is ``t``. Every tier is a part of the launches, those not removing
    skipped, so a model compiles one instance of each, not one per set of tiers. The freed pages go onto
    ``free_stack`` from ``n_free`` on, tier after tier, and the counts take the kept ones: what one removal after
    another leaves. Nothing is read back (the caller knows what is freed)."""
    check_pool(pool, "remove_tiers")
    nt = len(tables)
    if not 1 <= nt <= 3 or not len(sizes) == len(removing) == len(tpp) == len(layouts) == nt or counts.shape[-1] != nt:
        raise ValueError(f"remove_tiers: 1 to 3 tiers with a table, size, flag, tpp, layout and count each, got {nt}")
    if states.dtype != torch.int8 or not states.is_contiguous():
        raise ValueError(f"remove_tiers: states must be contiguous int8, got {states.dtype}")
    if counts.dtype != torch.int64 or not counts.is_contiguous():  # written in place: no copy
        raise ValueError(f"remove_tiers: counts must be contiguous int64 [B, H, T], got {counts.dtype}")
    bsz, heads, n_states = states.shape
    rows = bsz * heads
    m = [size if on else 0 for size, on in zip(sizes, removing, strict=True)]  # 0: the tier's programs return
    if rows == 0 or not any(m):
        return
    pad = 3 - nt
    tabs = [t.contiguous() for t in tables]
    tabs += tabs[:1] * pad
    tws = [t.shape[-1] for t in tables] + [0] * pad
    cols = [sum(sizes[:t]) for t in range(nt)] + [0] * pad
    m += [0] * pad
    recs = [lay.stride // 4 for lay in layouts] + [1] * pad
    tpps = [*tpp, *([1] * pad)]
    m_max = max(m)
    new = torch.empty(nt, rows, dtype=torch.int64, device=pool.device)
    scratch = torch.empty(nt, rows, m_max, dtype=torch.int32, device=pool.device)
    _compact_tiers_kernel[(rows, nt)](
        pool.view(torch.int32), *tabs, *tws, counts, nt, new, states, n_states, *cols, *m, scratch, m_max, rows,
        pool.shape[1] // 4, *tpps, REC_W0=recs[0], REC_W1=recs[1], REC_W2=recs[2],
        BW0=triton.next_power_of_2(recs[0]), BW1=triton.next_power_of_2(recs[1]), BW2=triton.next_power_of_2(recs[2]),
        BLOCK=64,
    )  # fmt: skip
    _release_tiers_kernel[(1,)](
        *tabs, *tws, counts, nt, new, free_stack, n_free, rows, *tpps, *m, NT=nt, BLOCK=64
    )  # fmt: skip
