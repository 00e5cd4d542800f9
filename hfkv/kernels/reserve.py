"""Slots for appended records in one launch: :meth:`hfkv.storage.paged.PagedTiers._reserve`'s contract on the
Triton backend (its torch path is the twin).

Appending ``n`` records to a tier takes each head's next slots: new pages where a head's last one is full (their
ids written into the page table, their bytes zeroed: a reused page may hold another tier's tags), and each
record's byte offset. The torch path is some twenty tensor operations (a repeat-interleave of page owners,
cumulative sums, scattered table writes, gathered page ids); a policy run appends once per destination tier, and
on a GPU a run is bound by its launches (docs/kernels.md, "Runs on a GPU"). Here one program per head does its
share: the host only counts the pages needed (one read, which the pool's free-page stack needs anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfkv.kernels.encode import check_pool
from hfkv.kernels.parts import head_step

__all__ = ["count_appends", "reserve_slots"]

_BLOCK = 256


@triton.jit(do_not_specialize=["table_w", "n_heads", "tpp", "page_words", "rec_bytes", "count_stride"])
def _reserve_kernel(
    words_ptr, table_ptr, table_w, old_ptr, k_ptr, ids_ptr, out_ptr, n_heads, tpp, page_words, rec_bytes,
    counts_ptr, count_stride, BLOCK: tl.constexpr, SET_COUNTS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    # This head's first record and first new page: exclusive prefix sums over the heads before it.
    first = tl.full((), 0, tl.int64)
    start = tl.full((), 0, tl.int64)
    for base in range(0, n_heads, BLOCK):
        i = base + tl.arange(0, BLOCK)
        before = i < bh
        o = tl.load(old_ptr + i, mask=before, other=0)
        n = tl.load(k_ptr + i, mask=before, other=0)
        first += tl.sum(n, 0)
        start += tl.sum((o + n + tpp - 1) // tpp - (o + tpp - 1) // tpp, 0)
    old = tl.load(old_ptr + bh)
    k = tl.load(k_ptr + bh).to(tl.int64)
    if SET_COUNTS:  # the head's count after the append (`old` is a snapshot: the other heads read theirs from it)
        tl.store(counts_ptr + bh.to(tl.int64) * count_stride, old + k)
    have = (old + tpp - 1) // tpp  # pages the head owns
    need = (old + k + tpp - 1) // tpp - have
    row = table_ptr + bh.to(tl.int64) * table_w
    for c0 in range(0, need, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        fresh = c < need
        tl.store(row + have + c, tl.load(ids_ptr + start + c, mask=fresh), mask=fresh)
    for c in range(0, need):
        page = words_ptr + tl.load(ids_ptr + start + c).to(tl.int64) * page_words
        for w0 in range(0, page_words, BLOCK):
            w = w0 + tl.arange(0, BLOCK)
            tl.store(page + w, tl.zeros((BLOCK,), tl.int32), mask=w < page_words)
    for j0 in range(0, k, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        live = j < k
        s = old + j
        col = s // tpp
        is_new = col >= have
        owned = tl.load(row + col, mask=live & ~is_new, other=0)
        added = tl.load(ids_ptr + start + (col - have), mask=live & is_new, other=0)
        page = tl.where(is_new, added, owned).to(tl.int64)
        tl.store(out_ptr + first + j, page * (page_words * 4) + (s % tpp) * rec_bytes, mask=live)


def reserve_slots(
    pool: torch.Tensor, table: torch.Tensor, old: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, tpp: int,
    record_bytes: int, n: int, counts: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Byte offsets ``[n]`` int64 of the next ``k[j]`` slots of every head ``j`` (``old [B*H]`` records held,
    ``k [B*H]`` appended, records grouped by head in head order); the new pages ``ids`` (int32, as many as the
    heads need, taken in head order) are written into ``table [B, H, W]`` (wide enough) and zeroed. With
    ``counts [B, H]`` (a tier's view of ``PagedTiers.counts``), each head's is set to ``old + k`` too: what
    :func:`count_appends` does, for a caller that has ``old`` and ``k`` already (a planned run's)."""
    check_pool(pool, "reserve_slots")
    out = torch.empty(n, dtype=torch.int64, device=pool.device)
    heads = old.numel()
    if heads == 0 or n == 0 and ids.numel() == 0:
        if counts is not None and heads:
            counts.copy_((old + k).view(counts.shape))
        return out
    step = head_step(counts, "reserve_slots") if counts is not None else 0
    _reserve_kernel[(heads,)](
        pool.view(torch.int32), table, table.shape[-1], old.to(torch.int64).contiguous(), k.contiguous(), ids, out,
        heads, tpp, pool.shape[1] // 4, record_bytes, counts if counts is not None else out, step, BLOCK=_BLOCK,
        SET_COUNTS=counts is not None,
    )  # fmt: skip
    return out


# What an append needs before any page is handed out, in one program: appended records per head (scattered adds
# at L2 and read back the same way, so no thread sees a stale cached count), each head's count before and after
# (written back: the tier's counts take their new values here), and the two numbers the host needs to hand out
# pages: how many are new and the widest head's pages after the append.
@triton.jit(do_not_specialize=["n", "heads", "n_heads", "tpp", "count_stride"])
def _count_kernel(
    b_ptr, h_ptr, n, heads, counts_ptr, count_stride, k_ptr, old_ptr, out_ptr, n_heads, tpp, BLOCK: tl.constexpr,
):  # fmt: skip
    lane = tl.arange(0, BLOCK)
    for h0 in range(0, n_heads, BLOCK):
        i = h0 + lane
        tl.atomic_xchg(k_ptr + i, tl.zeros([BLOCK], tl.int64), mask=i < n_heads)
    tl.debug_barrier()
    for j0 in range(0, n, BLOCK):
        j = j0 + lane
        ok = j < n
        bh = tl.load(b_ptr + j, mask=ok, other=0) * heads + tl.load(h_ptr + j, mask=ok, other=0)
        tl.atomic_add(k_ptr + bh, tl.full([BLOCK], 1, tl.int64), mask=ok)
    tl.debug_barrier()
    total = tl.full((), 0, tl.int64)
    widest = tl.full((), 0, tl.int64)
    for h0 in range(0, n_heads, BLOCK):
        i = h0 + lane
        ok = i < n_heads
        k = tl.atomic_add(k_ptr + i, tl.zeros([BLOCK], tl.int64), mask=ok)
        old = tl.load(counts_ptr + i.to(tl.int64) * count_stride, mask=ok, other=0)
        tl.store(old_ptr + i, old, mask=ok)
        tl.store(counts_ptr + i.to(tl.int64) * count_stride, old + k, mask=ok)
        have = (old + tpp - 1) // tpp
        after = (old + k + tpp - 1) // tpp
        total += tl.sum(tl.where(ok, after - have, 0), 0)
        widest = tl.maximum(widest, tl.max(tl.where(ok, after, 0), 0))
    tl.store(out_ptr, total)
    tl.store(out_ptr + 1, widest)


def count_appends(
    b: torch.Tensor, h: torch.Tensor, counts: torch.Tensor, tpp: int, known: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Appending one record to each head ``(b[j], h[j])`` of a tier whose counts are ``counts [B, H]`` (int64, a
    tier's view of ``PagedTiers.counts``): ``(k, old, new pages, widest)``, ``k [B*H]`` records added per head,
    ``old [B*H]`` its count before (what :func:`reserve_slots` takes), the pages to hand out and the widest head's
    pages after; ``counts`` takes the new values. One launch and one host read, none when the caller ``known`` the
    two numbers already (a planned run's: ``moves.plan_moves``); the torch path of ``PagedTiers._take_pages`` is
    the twin (a dozen launches)."""
    step = head_step(counts, "count_appends")
    n_heads, dev = counts.numel(), counts.device
    k = torch.empty(n_heads, dtype=torch.int64, device=dev)
    old = torch.empty(n_heads, dtype=torch.int64, device=dev)
    out = torch.empty(2, dtype=torch.int64, device=dev)
    _count_kernel[(1,)](
        b.contiguous(), h.contiguous(), b.numel(), counts.shape[1], counts, step, k, old, out, n_heads, tpp,
        BLOCK=_BLOCK,
    )  # fmt: skip
    total, widest = out.tolist() if known is None else known
    return k, old, total, widest
