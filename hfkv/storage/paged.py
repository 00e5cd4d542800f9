"""Paged, per-head tier storage of one layer (torch reference; KV-Compress / DiffKV layout).

Every (batch row, KV head, tier) owns a contiguous run of *slots* ``[0, count)``; slot ``s``
lives in page ``tables[tier][b, h, s // tpp]`` at offset ``s % tpp``, where ``tpp`` (tokens
per page) depends on the tier's record size so all tiers share one byte pool. Keeping the live
slots a dense prefix makes reads a single gather and lets removal free whole pages: a removal
moves only the tier's last live records into the holes (never a full re-sort), then returns
the emptied tail pages to the free stack.

Each tier's page table is exactly as wide as its largest head needs, with the null page in unused
entries, so the table itself is the decode step's read plan (one gather of whole pages, no
per-step index building) and it costs 4 bytes per page, not per slot. Slots past a head's count
read as empty: the null page is zero, fresh pages are zeroed, and a removal zeroes the tags of the
slots it vacates in pages the head keeps.

All bulk operations are vectorised over batch rows and heads. The torch reference uses
``nonzero`` (a host sync) to size its gathers at appends and removals (policy runs); the decode
step's reads and score updates need none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hfkv.kernels.backend import BackendOps, backend_ops
from hfkv.policy.scores import score_means
from hfkv.quant.record import RecordLayout
from hfkv.states import EVICTED, ORIGINAL
from hfkv.storage.pool import GROWTH, NULL_PAGE, PagePool


def _ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + b - 1) // b


# Pages start on a DRAM sector (32 bytes) where that costs at most PAGE_GROWTH more page: a page size that is not a
# multiple of it puts every other page's records across sector boundaries, so a GPU reads a third more sectors for
# the same 16- or 32-byte loads (ncu, H200: 24 sectors where 16 would do for each of the quantized loop's 16-byte
# code loads on 5,200-byte pages). Not at any price: a larger page is more memory in each head's last, part-filled
# page, which at small budgets is a large share of what a cache holds.
PAGE_ALIGN = 32
PAGE_GROWTH = 1.125


def _smallest_page(
    record_sizes: Sequence[int], first: int, step: int, high: int, max_tail_waste: float
) -> tuple[int, float]:
    """The first of ``first, first + step, ...`` (up to ``high``) whose tail waste is under ``max_tail_waste`` for
    every tier, else the least wasteful: ``(page, waste)``."""
    best = None
    for page in range(first, max(first, high) + 1, step):
        waste = sum((page % r) / page for r in record_sizes)
        if waste <= max_tail_waste:
            return page, waste
        if best is None or waste < best[1]:
            best = (page, waste)
    return best


def auto_page_bytes(
    record_sizes: Sequence[int], records: int = 8, high: int = 16384, max_tail_waste: float = 0.01
) -> int:
    """The smallest page holding at least ``records`` of the largest record whose tail waste is under
    ``max_tail_waste`` for every tier, a multiple of ``PAGE_ALIGN`` bytes where one at most ``PAGE_GROWTH``
    times larger qualifies.

    Unified pages hold a different number of tokens per tier, so a fixed power of two wastes
    ``page % record`` bytes on every page (12% for bf16 records at head_dim 128 in 4 KiB pages).
    Candidates are multiples of the largest record. About 8 of them per page balances the two
    per-head costs of a page size, which both scale with the record size: the half-filled last page
    of each head (grows with the page) and the page table and free stack entries (4 + 4 bytes per
    page, shrink with it). Falls back to the least wasteful candidate.
    """
    if not record_sizes or min(record_sizes) <= 0:
        raise ValueError(f"auto_page_bytes: record_sizes={list(record_sizes)} must be positive byte counts")
    big = max(record_sizes)
    packed, packed_waste = _smallest_page(record_sizes, records * big, big, high, max_tail_waste)
    first = -(-records * big // PAGE_ALIGN) * PAGE_ALIGN
    aligned, aligned_waste = _smallest_page(record_sizes, first, PAGE_ALIGN, high, max_tail_waste)
    if aligned <= PAGE_GROWTH * packed and aligned_waste <= max(packed_waste, max_tail_waste):
        return aligned
    return packed


class PagedTiers:
    def __init__(
        self,
        layouts: Sequence[RecordLayout],
        batch: int,
        heads: int,
        page_bytes: int | None,
        device: torch.device | str = "cpu",
        initial_pages: int = 0,
        growth: float = GROWTH,
        ops: BackendOps | None = None,
    ) -> None:
        self.layouts = tuple(layouts)
        # The kernels that encode, move, clear and read records (same bytes on every backend; None entries: the
        # torch code here). Default: the torch backend's.
        self.ops = backend_ops("torch") if ops is None else ops
        if page_bytes is None:
            page_bytes = auto_page_bytes([lay.nbytes for lay in self.layouts])
        self.tpp = []
        for i, lay in enumerate(self.layouts):
            tpp = page_bytes // lay.nbytes
            if tpp < 1:
                raise ValueError(
                    f"TriStateConfig.page_bytes={page_bytes} is too small for tier {i}: one token record "
                    f"needs {lay.nbytes} bytes (keys {lay.key.name}, values {lay.value.name}); "
                    f"use page_bytes >= {lay.nbytes}"
                )
            self.tpp.append(tpp)
        self.batch, self.heads = batch, heads
        self.device = torch.device(device)
        self.pool = PagePool(page_bytes, self.device, initial_pages, growth)
        n_t = len(self.layouts)
        self.counts = torch.zeros(batch, heads, n_t, dtype=torch.int64, device=self.device)
        self.tables = [self._empty_table(0) for _ in range(n_t)]
        # Bumped whenever a tier's slots change (consumers may cache what they derive from a tier).
        self.versions = [0] * n_t

    # ----------------------------------------------------------------- helpers
    @property
    def num_tiers(self) -> int:
        return len(self.layouts)

    def _empty_table(self, width: int) -> torch.Tensor:
        return torch.full((self.batch, self.heads, width), NULL_PAGE, dtype=torch.int32, device=self.device)

    def pages_per_head(self) -> torch.Tensor:
        """``[B, H, tiers]`` pages owned, derived from counts (the invariant the tests check)."""
        tpp = torch.tensor(self.tpp, device=self.device)
        return (self.counts + tpp - 1) // tpp

    def max_pages(self, tier: int) -> int:
        """Pages of the tier's largest head: the table's width (host-side, no sync)."""
        return self.tables[tier].shape[-1]

    def max_slots(self, tier: int) -> int:
        """Slots every head's read of the tier returns (whole pages of the largest head)."""
        return self.max_pages(tier) * self.tpp[tier]

    def _set_width(self, tier: int, width: int) -> None:
        """Keep the table exactly as wide as the largest head's page count (entries past it are null)."""
        table = self.tables[tier]
        cur = table.shape[-1]
        if width > cur:
            self.tables[tier] = torch.cat([table, self._empty_table(width - cur)], dim=-1)
        elif width < cur:
            self.tables[tier] = table[..., :width].contiguous()

    def _locate(self, tier: int, b: torch.Tensor, h: torch.Tensor, s: torch.Tensor):
        tpp = self.tpp[tier]
        page = self.tables[tier][b, h, s // tpp].long()
        return page, s % tpp

    # ------------------------------------------------------------------ writes
    def append(self, tier: int, records: torch.Tensor, valid: torch.Tensor) -> None:
        """Append ``records[b, h, i]`` for every ``valid[b, h, i]`` to the end of (b, h, tier), in order.

        ``records``: ``[B, H, n, record_bytes]`` uint8, ``valid``: ``[B, H, n]`` bool.
        """
        b, h, i = valid.nonzero(as_tuple=True)
        self.append_flat(tier, b, h, records[b, h, i])

    def append_flat(self, tier: int, b: torch.Tensor, h: torch.Tensor, records: torch.Tensor) -> None:
        """Append records owned by heads ``(b[j], h[j])``; entries of one head keep their relative order.

        ``(b, h)`` must be grouped in row-major order (as ``nonzero`` returns them).
        """
        lay = self.layouts[tier]
        if records.shape[-1] != lay.nbytes:
            raise ValueError(f"append: record size {records.shape[-1]} != tier {tier} layout {lay.nbytes}")
        if b.numel() == 0:
            return
        page, off = self._reserve(tier, b, h)
        self.pool.bodies(lay)[page, off] = records[..., : lay.stride]
        self.pool.tags(lay)[page, off] = lay.tags(records)
        self.pool.scores(lay)[page, off] = lay.scores(records)

    def append_tokens(
        self,
        tier: int,
        b: torch.Tensor,
        h: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: torch.Tensor,
        score: torch.Tensor,
        pages: tuple[int, int] | None = None,
        heads: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Encode tokens ``k, v [n, D]`` (positions ``pos [n]``, score sums ``score [n]``) into the tier's
        format and append them to heads ``(b, h)`` (grouped as for :meth:`append_flat`). No finiteness check:
        a caller that wants one reads ``RecordLayout.encodable_ends`` (the cache, once for a prompt's tiers).
        ``pages``: the new pages the append takes and the widest head's pages after it, when the caller knows them
        (a planned policy run's): the kernel backends then read nothing back. ``heads``: with ``pages``, each
        head's count now and tokens appended (``[B * H]`` each, a planned run's): the Triton backend then reserves
        the slots and sets the counts in one launch instead of counting first.

        The Triton and CPU backends quantize, pack and write each record in one call, straight into its slot
        (a policy run's few dozen tokens cost the torch encoder some fifty tensor operations).
        """
        if b.numel() == 0:
            return
        lay = self.layouts[tier]
        if self.ops.encode_write is None:
            self.append_flat(tier, b, h, lay.encode(k, v, pos, score, check_finite=False))
            return
        offsets = self._reserve_offsets(tier, b, h, pages, heads)
        self.ops.encode_write(self.pool.data, offsets, lay, k, v, pos, score)

    def _take_pages(self, tier: int, b: torch.Tensor, h: torch.Tensor):
        """What appending one record to each head ``(b[j], h[j])`` needs: ``(bh, k, old, old_pages, need, ids)``
        (records per head before and added, pages owned and needed, the new pages' ids or None), the table
        widened for them. One host read: the pool hands out pages by count."""
        tpp = self.tpp[tier]
        bh = b * self.heads + h
        # index_add, not bincount: on a GPU bincount reads its input's largest value back first (a wait)
        k = torch.zeros(self.batch * self.heads, dtype=torch.int64, device=self.device)
        k = k.index_add_(0, bh, torch.ones_like(bh, dtype=torch.int64))
        old = self.counts[..., tier].reshape(-1)
        old_pages, new_pages = _ceil_div(old, tpp), _ceil_div(old + k, tpp)
        need = new_pages - old_pages
        total, widest = torch.stack([need.sum(), new_pages.max()]).tolist()
        ids = None
        if total:
            self._set_width(tier, max(self.max_pages(tier), widest))
            ids = self.pool.allocate(total)
        return bh, k, old, old_pages, need, ids

    def _reserve(self, tier: int, b: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the next slot of heads ``(b[j], h[j])`` for every j (pages allocated in bulk); its page and offset."""
        bh, k, old, old_pages, need, ids = self._take_pages(tier, b, h)
        rows = self.batch * self.heads
        if ids is not None:
            total = ids.numel()
            self.pool.data[ids.long()] = 0  # a reused page may hold another tier's bytes (and non-zero tags)
            owner = torch.repeat_interleave(torch.arange(rows, device=self.device), need, output_size=total)
            start = torch.cumsum(need, 0) - need
            col = old_pages[owner] + torch.arange(total, device=self.device) - start[owner]
            self.tables[tier].view(rows, -1)[owner, col] = ids
        first = torch.cumsum(k, 0) - k
        s = old[bh] + torch.arange(bh.numel(), device=self.device) - first[bh]
        self._count_appended(tier, old + k)
        return self._locate(tier, b, h, s)

    def _reserve_offsets(
        self,
        tier: int,
        b: torch.Tensor,
        h: torch.Tensor,
        pages: tuple[int, int] | None = None,
        heads: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`_reserve`'s slots as byte offsets into the pool: two calls and one host read on the Triton and CPU
        backends (``count_appends``, which sets the new counts, then ``reserve_slots``), in place of the torch
        path's dozens of operations; one call and no read on the Triton one given ``pages`` and ``heads``."""
        lay, tpp, ops = self.layouts[tier], self.tpp[tier], self.ops
        if ops.reserve_slots is None:
            page, off = self._reserve(tier, b, h)
            return page * self.pool.page_bytes + off * lay.stride
        counts = self.counts[..., tier]
        if heads is not None and pages is not None and ops.reserve_sets_counts:
            (total, widest), (old, k), set_counts = pages, heads, counts  # the reservation sets the counts
        else:
            k, old, total, widest = ops.count_appends(b, h, counts, tpp, pages)
            set_counts = None
        ids = self.pool.free_stack[:0]
        if total:
            self._set_width(tier, max(self.max_pages(tier), widest))
            ids = self.pool.take(total)  # read by reserve_slots below, before any release can overwrite them
        self.versions[tier] += 1
        extra = () if set_counts is None else (set_counts,)  # the C++ twin takes no counts (it is never told heads)
        return ops.reserve_slots(self.pool.data, self.tables[tier], old, k, ids, tpp, lay.stride, b.numel(), *extra)

    def _count_appended(self, tier: int, new: torch.Tensor) -> None:
        self.counts[..., tier] = new.view(self.batch, self.heads)
        self.versions[tier] += 1

    def remove_states(
        self, states: torch.Tensor, sizes: Sequence[int], tiers: Sequence[int], pages: Sequence[tuple[int, int]]
    ) -> None:
        """A policy run's removals: from each tier in ``tiers``, the slots whose new state in ``states [B, H, N]``
        (every tier's slots side by side, ``sizes[t]`` each, then anything) is not the tier, ``pages[i]`` (pages
        freed, the table's width after) known. On the Triton backend one compaction and one page release for all of
        them (two launches, not two a tier); elsewhere :meth:`remove` for each, in order: the same storage either
        way."""
        cols = [sum(sizes[:t]) for t in range(len(sizes))]
        if self.ops.remove_tiers is None or not tiers:
            for tier, known in zip(tiers, pages, strict=True):
                self.remove(tier, states[..., cols[tier] : cols[tier] + sizes[tier]] == tier, known)
            return
        removing = [t in tiers for t in range(self.num_tiers)]
        self.ops.remove_tiers(self.pool.data, self.tables, self.counts, states.contiguous(), sizes, removing, self.tpp,
                     self.layouts, self.pool.free_stack, self.pool.n_free)  # fmt: skip
        self.pool.pushed(sum(freed for freed, _ in pages))
        for tier, (_, width) in zip(tiers, pages, strict=True):
            self._set_width(tier, width)
            self.versions[tier] += 1

    def remove(self, tier: int, keep: torch.Tensor, pages: tuple[int, int] | None = None) -> None:
        """Drop live slots of ``tier`` where ``keep`` is False; ``keep`` is ``[B, H, M]`` with M >= max count.
        ``pages``: the pages it frees and the table's width after it, when the caller knows them (a planned
        policy run's): the kernel backends then read nothing back.

        Holes below the new count are filled with the tier's last kept records (fewest moves),
        the vacated slots of pages the head keeps are tagged empty, then the tail pages that
        became empty go back to the pool.
        """
        tpp = self.tpp[tier]
        cnt = self.counts[..., tier]
        ops = self.ops
        if ops.compact is not None:  # two calls and one host read (a GPU's policy run is bound by launches)
            new = ops.compact(self.pool.data, self.tables[tier], cnt, keep, tpp, self.layouts[tier])
            n_freed, width = ops.release_pages(self.tables[tier], cnt, new, tpp, self.pool.free_stack,
                                               self.pool.n_free, pages)  # fmt: skip
            self.pool.pushed(n_freed)
            self._set_width(tier, width)
            self.versions[tier] += 1
            return
        m = keep.shape[-1]
        s = torch.arange(m, device=self.device)
        live = s < cnt.unsqueeze(-1)
        keep = keep & live
        new = keep.sum(-1)
        old_pages, new_pages = _ceil_div(cnt, tpp), _ceil_div(new, tpp)
        below = s < new.unsqueeze(-1)
        hb, hh, hs = (live & ~keep & below).nonzero(as_tuple=True)
        sb, sh, ss = (keep & ~below).nonzero(as_tuple=True)
        if hs.numel():
            self._move(tier, self._locate(tier, sb, sh, ss), self._locate(tier, hb, hh, hs))
        vb, vh, vs = (live & ~below & (s < (new_pages * tpp).unsqueeze(-1))).nonzero(as_tuple=True)
        if vs.numel():
            self._clear_tags(tier, *self._locate(tier, vb, vh, vs))
        table = self.tables[tier]
        col = torch.arange(table.shape[-1], device=self.device)
        freed = (col >= new_pages.unsqueeze(-1)) & (col < old_pages.unsqueeze(-1))
        # One host read for both numbers (a boolean index would be a second): the freed pages, in the order
        # a boolean index gives them, are the first n_freed of a stable sort putting freed entries first.
        n_freed, width = torch.stack([freed.sum(), new_pages.max()]).tolist() if new_pages.numel() else (0, 0)
        if n_freed:
            first = torch.argsort((~freed).view(-1).to(torch.uint8), stable=True)[:n_freed]
            self.pool.release(table.view(-1)[first])
        table.masked_fill_(freed, NULL_PAGE)
        self.counts[..., tier] = new
        self._set_width(tier, width)
        self.versions[tier] += 1

    def _move(self, tier: int, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy records from slots ``src`` to the (disjoint) slots ``dst``: the torch path's compaction (the
        Triton and CPU backends compact in one kernel call: :meth:`remove`)."""
        lay = self.layouts[tier]
        for view in (self.pool.bodies(lay), self.pool.tags(lay), self.pool.scores(lay)):
            view[dst] = view[src]

    def _clear_tags(self, tier: int, page: torch.Tensor, off: torch.Tensor) -> None:
        """Mark slots empty (tag 0) so reads of whole pages skip them (the torch path's, as :meth:`_move`)."""
        self.pool.tags(self.layouts[tier])[page, off] = 0

    def add_scores(self, tier: int, delta: torch.Tensor) -> None:
        """Add ``delta [B, H, M]`` (fp32) to the score sums of slots ``[0, M)`` of every head.

        ``delta`` must be zero at slots that are not live (attention gives them probability 0):
        they map to the null page or to vacated slots, which must keep reading as empty. ``M`` may
        exceed the slots the table covers (those entries are ignored).
        """
        lay, tpp, pb = self.layouts[tier], self.tpp[tier], self.pool.page_bytes
        width = self.max_pages(tier)
        m = min(delta.shape[-1], width * tpp)
        if m == 0:
            return
        pages = -(-m // tpp)
        flat_pages = self.tables[tier][..., :pages].to(torch.int64)
        offs = torch.arange(tpp, device=self.device) + lay.score_region(tpp) // 4
        index = (flat_pages.unsqueeze(-1) * (pb // 4) + offs).view(self.batch, self.heads, pages * tpp)[..., :m]
        self.pool.data.view(torch.float32).view(-1).index_add_(
            0, index.reshape(-1), delta[..., :m].to(torch.float32).reshape(-1)
        )

    # ------------------------------------------------------------------- reads
    def _slot_pages(self, tier: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page and in-page offset of slots ``[0, m)`` of every head; ``-1`` pages for slots past the count."""
        tpp = self.tpp[tier]
        s = torch.arange(m, device=self.device)
        table = self.tables[tier]
        if table.shape[-1] == 0:
            page = torch.full((self.batch, self.heads, m), -1, dtype=torch.int64, device=self.device)
        else:
            col = (s // tpp).clamp_max(table.shape[-1] - 1)  # slots past the table are empty anyway
            page = torch.where(s < self.counts[..., tier].unsqueeze(-1), table[:, :, col].long(), -1)
        return page, (s % tpp).expand_as(page)

    def max_count(self, tier: int) -> int:
        return int(self.counts[..., tier].max()) if self.counts.numel() else 0

    def read(self, tier: int, m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Records of every live slot, padded: ``([B, H, M, record_bytes] uint8, valid [B, H, M])``.

        Padding slots read the all-zero null page, so they decode to zeros.
        """
        m = self.max_count(tier) if m is None else m
        page, off = self._slot_pages(tier, m)
        valid = page >= 0
        return self._records(tier, torch.where(valid, page, NULL_PAGE), off), valid

    def _records(self, tier: int, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """Whole records (body, tag and score, as encoders make them) of slots ``(page, off)``."""
        lay = self.layouts[tier]
        meta = torch.stack([self.pool.tags(lay)[page, off], self.pool.scores(lay)[page, off].view(torch.int32)], -1)
        return torch.cat([self.pool.bodies(lay)[page, off], meta.view(torch.uint8)], -1)

    def read_meta(self, tier: int, m: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions and score sums of every live slot without touching K/V bytes: ``(pos, score, valid)``.

        ``m`` slots a head (default: the table's pages, known on the host; the largest count would be a
        device read, a wait on a GPU at every policy run); slots past a head's count are not valid."""
        lay = self.layouts[tier]
        if self.ops.read_meta is not None:  # one pass over the tables (the torch path below is the twin)
            m = self.max_slots(tier) if m is None else m
            return self.ops.read_meta(self.pool.data, self.tables[tier], self.counts[..., tier], self.tpp[tier], lay, m)
        page, off = self._slot_pages(tier, self.max_slots(tier) if m is None else m)
        valid = page >= 0
        page = torch.where(valid, page, NULL_PAGE)
        pos = self.pool.tags(lay)[page, off] - 1
        return pos, self.pool.scores(lay)[page, off], valid

    def candidates(
        self,
        exit_pos: torch.Tensor,
        exit_score: torch.Tensor,
        pad_end: torch.Tensor,
        mean_over: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """What a policy run ranks: every tier's slots (:meth:`read_meta`'s, ``max_slots`` a head) and then the
        window's exits (``exit_pos [m]``, ``exit_score [B, H, m]``), side by side: ``(pos int64, score fp32,
        valid bool, state int8)``, each ``[B, H, N]``, and the tiers' widths. A slot's state is its tier, an
        exit's ``ORIGINAL`` unless it lies below its row's ``pad_end`` (padding), anything not valid ``EVICTED``.

        With ``mean_over=(length, score_start)`` the scores are each sum's mean over the queries that saw the token
        (``score_start`` the first observed position; at least one), what a policy run ranks in ``mean`` mode.

        On the CPU backend one C++ pass (a dozen tensor operations here, a tenth of a policy run at 8k), on the Triton
        one a launch per tier and one for the exits, the means taken in them."""
        sizes = [self.max_slots(t) for t in range(self.num_tiers)]
        if self.ops.read_candidates is not None:
            args = (self.pool.data, self.tables, self.counts, self.tpp, self.layouts, sizes, exit_pos, exit_score,
                    pad_end, mean_over)  # fmt: skip
            return (*self.ops.read_candidates(*args), sizes)
        metas = [self.read_meta(t, m) for t, m in enumerate(sizes)]
        bsz, heads, m = exit_score.shape
        exit_valid = (exit_pos.view(1, 1, m) >= pad_end.view(-1, 1, 1)).expand(bsz, heads, m)
        pos = torch.cat([*(meta[0].long() for meta in metas), exit_pos.view(1, 1, m).long().expand(bsz, heads, m)], -1)
        valid = torch.cat([*(meta[2] for meta in metas), exit_valid], -1)
        # Each slot's tier; a token leaving the window is a candidate for the original tier.
        # (filled per part: repeat_interleave with host counts copies them to the device and reads the total back)
        tier_of = torch.cat(
            [
                torch.full((n,), t, dtype=torch.int8, device=self.device)
                for t, n in zip([*range(len(sizes)), ORIGINAL], [*sizes, m], strict=True)
            ]
        )
        state = torch.where(valid, tier_of, EVICTED).to(torch.int8)
        score = torch.cat([*(meta[1] for meta in metas), exit_score.float()], -1)
        return pos, score_means(score, pos, mean_over), valid, state, sizes

    def read_slots(self, tier: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention needs of a tier: every slot's keys and values, ``[B, H, M, layout.stride]`` uint8,
        and its tag, ``[B, H, M]`` int32 (0: empty).

        One ``index_select`` of whole pages through the page table (its width is the largest head's
        page count, its unused entries the null page) for the bodies, cut to each page's used prefix
        through a word view of the pool, so the gathered rows are already contiguous, word-aligned
        records; one more for the tags. Slots past a head's count read as empty (zero tag) and decode
        to finite values.
        """
        lay, tpp, pb = self.layouts[tier], self.tpp[tier], self.pool.page_bytes
        pages = self.tables[tier].view(-1)
        words = self.pool.data.view(torch.int32).as_strided((self.pool.num_pages, tpp * lay.stride // 4), (pb // 4, 1))
        rows = words.index_select(0, pages).view(self.batch, self.heads, self.max_slots(tier), lay.stride // 4)
        tags = self.pool.tags(lay).index_select(0, pages).view(self.batch, self.heads, self.max_slots(tier))
        return rows.view(torch.uint8), tags

    def gather(self, tier: int, b: torch.Tensor, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Records of the given live slots, ``[len(s), record_bytes]``."""
        return self._records(tier, *self._locate(tier, b, h, s))

    def gather_decoded(self, tier: int, b: torch.Tensor, h: torch.Tensor, s: torch.Tensor):
        """``(k, v [n, D] fp32, pos [n] int64, score [n] fp32)`` of the given live slots (one launch on the Triton
        backend, one C++ call on the CPU one; equal values)."""
        lay = self.layouts[tier]
        if self.ops.gather_decode is not None:
            return self.ops.gather_decode(self.pool.data, self.tables[tier], self.tpp[tier], lay, b, h, s)
        page, off = self._locate(tier, b, h, s)
        k, v = lay.decode_kv(self.pool.bodies(lay)[page, off], torch.float32)
        return k, v, self.pool.tags(lay)[page, off].long() - 1, self.pool.scores(lay)[page, off]

    def gather_decoded_into(
        self, tier: int, b: torch.Tensor, h: torch.Tensor, s: torch.Tensor, source: torch.Tensor, out: tuple
    ) -> None:
        """:meth:`gather_decoded` of the rows whose ``source`` is ``tier`` (a move plan's), written into ``out``
        (``(k, v [n, D], pos [n], score [n])``) at those rows; the others keep what they hold. One launch on the
        Triton backend, no host read."""
        if self.ops.plans_moves:  # the Triton gather writes the rows of its source in place
            lay = self.layouts[tier]
            self.ops.gather_decode(self.pool.data, self.tables[tier], self.tpp[tier], lay, b, h, s, (source, tier), out)
            return
        sel = source == tier
        for o, x in zip(out, self.gather_decoded(tier, b[sel], h[sel], s[sel]), strict=True):
            o[sel] = x

    # --------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Return every page (a finished request); the pool keeps its capacity for reuse."""
        self.counts.zero_()
        self.tables = [self._empty_table(0) for _ in range(self.num_tiers)]
        self.pool.reset()
        self.versions = [v + 1 for v in self.versions]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (may repeat, e.g. beam search); repeated rows get their own pages."""
        reads = [self.read(t) for t in range(self.num_tiers)]
        self.batch = int(index.numel())
        self.counts = torch.zeros(self.batch, self.heads, self.num_tiers, dtype=torch.int64, device=self.device)
        self.tables = [self._empty_table(0) for _ in range(self.num_tiers)]
        self.pool.reset()
        self.versions = [v + 1 for v in self.versions]
        for t, (rows, valid) in enumerate(reads):
            self.append(t, rows[index], valid[index])

    def held_tensors(self) -> list[torch.Tensor]:
        return [*self.pool.held_tensors(), self.counts, *self.tables]
