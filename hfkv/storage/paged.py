"""Paged, per-head tier storage of one layer (torch reference; KV-Compress / DiffKV layout).

Every (batch row, KV head, tier) owns a contiguous run of *slots* ``[0, count)``; slot ``s``
lives in page ``page_table[b, h, tier, s // tpp]`` at offset ``s % tpp``, where ``tpp`` (tokens
per page) depends on the tier's record size so all tiers share one byte pool. Keeping the live
slots a dense prefix makes reads a single gather and lets removal free whole pages: a removal
moves only the tier's last live records into the holes (never a full re-sort), then returns
the emptied tail pages to the free stack.

All bulk operations are vectorised over batch rows and heads. The torch reference uses
``nonzero`` (a host sync) to size its gathers; the Triton backend replaces those paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hfkv.storage.pool import NULL_PAGE, SCRATCH_PAGE, PagePool
from hfkv.storage.record import RecordLayout


def _ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + b - 1) // b


def auto_page_bytes(
    record_sizes: Sequence[int], low: int = 1024, high: int = 16384, max_tail_waste: float = 0.01
) -> int:
    """The smallest page in ``[low, high]`` whose tail waste is under ``max_tail_waste`` for every tier.

    Unified pages hold a different number of tokens per tier, so a fixed power of two wastes
    ``page % record`` bytes on every page (12% for bf16 records at head_dim 128 in 4 KiB pages).
    Candidates are multiples of the largest record; the smallest acceptable one also keeps the
    last, partly filled page of each head small. Falls back to the least wasteful candidate.
    """
    big = max(record_sizes)
    best = None
    for k in range(max(1, -(-low // big)), max(1, high // big) + 1):
        page = k * big
        waste = sum((page % r) / page for r in record_sizes)
        if waste <= max_tail_waste:
            return page
        if best is None or waste < best[0]:
            best = (waste, page)
    return best[1]


class PagedTiers:
    def __init__(
        self,
        layouts: Sequence[RecordLayout],
        batch: int,
        heads: int,
        page_bytes: int | None,
        device: torch.device | str = "cpu",
        initial_pages: int = 1,
    ) -> None:
        self.layouts = tuple(layouts)
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
        self.pool = PagePool(page_bytes, self.device, initial_pages)
        n_t = len(self.layouts)
        self.counts = torch.zeros(batch, heads, n_t, dtype=torch.int64, device=self.device)
        self.page_table = torch.full((batch, heads, n_t, 4), -1, dtype=torch.int32, device=self.device)
        # Bumped whenever a tier's slots change; the cached read plans of the decode step key on it.
        self.versions = [0] * n_t
        self._plans: list[tuple[int, torch.Tensor, int] | None] = [None] * n_t

    # ----------------------------------------------------------------- helpers
    @property
    def num_tiers(self) -> int:
        return len(self.layouts)

    def pages_per_head(self) -> torch.Tensor:
        """``[B, H, tiers]`` pages owned, derived from counts (the invariant the tests check)."""
        tpp = torch.tensor(self.tpp, device=self.device)
        return (self.counts + tpp - 1) // tpp

    def _ensure_table_width(self, width: int) -> None:
        cur = self.page_table.shape[-1]
        if width <= cur:
            return
        new = max(width, 2 * cur)
        pad = torch.full((*self.page_table.shape[:-1], new - cur), -1, dtype=torch.int32, device=self.device)
        self.page_table = torch.cat([self.page_table, pad], dim=-1)

    def _locate(self, tier: int, b: torch.Tensor, h: torch.Tensor, s: torch.Tensor):
        tpp = self.tpp[tier]
        page = self.page_table[b, h, tier, s // tpp].long()
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
        lay, tpp = self.layouts[tier], self.tpp[tier]
        if records.shape[-1] != lay.nbytes:
            raise ValueError(f"append: record size {records.shape[-1]} != tier {tier} layout {lay.nbytes}")
        bsz, heads = self.batch, self.heads
        bh = b * heads + h
        k = torch.bincount(bh, minlength=bsz * heads)
        old = self.counts[..., tier].reshape(-1)
        new = old + k
        old_pages, new_pages = _ceil_div(old, tpp), _ceil_div(new, tpp)
        need = new_pages - old_pages
        total = int(need.sum())
        if total:
            self._ensure_table_width(int(new_pages.max()))
            ids = self.pool.allocate(total)
            self.pool.data[ids.long()] = 0  # a reused page may hold another tier's bytes
            owner = torch.repeat_interleave(torch.arange(bsz * heads, device=self.device), need)
            start = torch.cumsum(need, 0) - need
            col = old_pages[owner] + torch.arange(total, device=self.device) - start[owner]
            n_t, width = self.num_tiers, self.page_table.shape[-1]
            self.page_table.view(bsz * heads, n_t, width)[owner, tier, col] = ids
        first = torch.cumsum(k, 0) - k
        s = old[bh] + torch.arange(bh.numel(), device=self.device) - first[bh]
        page, off = self._locate(tier, b, h, s)
        self.pool.tier_view(lay.nbytes)[page, off] = records
        self.counts[..., tier] = new.view(bsz, heads)
        self.versions[tier] += 1

    def remove(self, tier: int, keep: torch.Tensor) -> None:
        """Drop live slots of ``tier`` where ``keep`` is False; ``keep`` is ``[B, H, M]`` with M >= max count.

        Holes below the new count are filled with the tier's last kept records (fewest moves),
        then the tail pages that became empty go back to the pool.
        """
        lay, tpp = self.layouts[tier], self.tpp[tier]
        cnt = self.counts[..., tier]
        m = keep.shape[-1]
        s = torch.arange(m, device=self.device)
        live = s < cnt.unsqueeze(-1)
        keep = keep & live
        new = keep.sum(-1)
        below = s < new.unsqueeze(-1)
        hb, hh, hs = (live & ~keep & below).nonzero(as_tuple=True)
        sb, sh, ss = (keep & ~below).nonzero(as_tuple=True)
        if hs.numel():
            view = self.pool.tier_view(lay.nbytes)
            view[self._locate(tier, hb, hh, hs)] = view[self._locate(tier, sb, sh, ss)]
        old_pages, new_pages = _ceil_div(cnt, tpp), _ceil_div(new, tpp)
        col = torch.arange(self.page_table.shape[-1], device=self.device)
        freed = (col >= new_pages.unsqueeze(-1)) & (col < old_pages.unsqueeze(-1))
        table = self.page_table[:, :, tier, :]
        self.pool.release(table[freed])
        table.masked_fill_(freed, -1)
        self.counts[..., tier] = new
        self.versions[tier] += 1

    def add_scores(self, tier: int, delta: torch.Tensor) -> None:
        """Add ``delta [B, H, M]`` (fp32) to the score sums of slots ``[0, M)``; empty slots hit the scratch page."""
        self.read_meta(tier, add=delta)

    # ------------------------------------------------------------------- reads
    def _slot_pages(self, tier: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page and in-page offset of slots ``[0, m)`` of every head; ``-1`` pages for slots past the count."""
        tpp = self.tpp[tier]
        s = torch.arange(m, device=self.device)
        col = (s // tpp).clamp_max(self.page_table.shape[-1] - 1)  # slots past the table are empty anyway
        page = torch.where(s < self.counts[..., tier].unsqueeze(-1), self.page_table[:, :, tier, col].long(), -1)
        return page, (s % tpp).expand_as(page)

    def max_count(self, tier: int) -> int:
        return int(self.counts[..., tier].max()) if self.counts.numel() else 0

    def _read_pages(self, tier: int, m: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = self.max_count(tier) if m is None else m
        page, off = self._slot_pages(tier, m)
        valid = page >= 0
        return torch.where(valid, page, NULL_PAGE), off, valid

    def read(self, tier: int, m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Records of every live slot, padded: ``([B, H, M, record_bytes] uint8, valid [B, H, M])``.

        Padding slots read the all-zero null page, so they decode to zeros.
        """
        page, off, valid = self._read_pages(tier, m)
        return self.pool.tier_view(self.layouts[tier].nbytes)[page, off], valid

    def _meta_column(self, tier: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
        lay, tpp, pb = self.layouts[tier], self.tpp[tier], self.pool.page_bytes
        size, stride = (self.pool.num_pages, tpp), (pb // 4, lay.nbytes // 4)
        return self.pool.data.view(dtype).as_strided(size, stride, offset // 4)

    def read_meta(
        self, tier: int, m: int | None = None, add: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions and score sums of every live slot without touching K/V bytes: ``(pos, score, valid)``.

        ``add [B, H, M]`` (optional) is first added to the score sums of slots ``[0, M)`` — the
        policy folds the decode steps' pending increments and reads the result with one slot lookup.
        """
        lay = self.layouts[tier]
        if add is not None:
            m = add.shape[-1]
        page, off = self._slot_pages(tier, self.max_count(tier) if m is None else m)
        valid = page >= 0
        scores = self._meta_column(tier, lay.score_offset, torch.float32)
        if add is not None:
            scores.index_put_((torch.where(valid, page, SCRATCH_PAGE), off), add.float(), accumulate=True)
        page = torch.where(valid, page, NULL_PAGE)
        pos = self._meta_column(tier, lay.pos_offset, torch.int32)[page, off]
        return pos, scores[page, off], valid

    def _page_list(self, tier: int) -> tuple[torch.Tensor, int]:
        """Flat page ids ``[B * H * npages]`` (empty entries -> the null page) and slots per head."""
        tpp = self.tpp[tier]
        npages = int(_ceil_div(self.counts[..., tier], tpp).max()) if self.counts.numel() else 0
        pages = self.page_table[:, :, tier, :npages].long().clamp_min(NULL_PAGE)
        return pages.reshape(-1), npages * tpp

    def _gather_records(self, tier: int, pages: torch.Tensor, m: int) -> torch.Tensor:
        """``[B, H, m, record_bytes]`` uint8 records of whole pages, word-aligned (one ``index_select``).

        The pool is read as 4-byte words through a view cut to each page's used prefix, so the
        gathered rows are already contiguous records: no second copy to drop page tails.
        """
        lay, tpp, pb = self.layouts[tier], self.tpp[tier], self.pool.page_bytes
        words = self.pool.data.view(torch.int32).as_strided((self.pool.num_pages, tpp * lay.nbytes // 4), (pb // 4, 1))
        rows = words.index_select(0, pages)
        return rows.view(self.batch, self.heads, m, lay.nbytes // 4).view(torch.uint8)

    def read_slots(self, tier: int) -> torch.Tensor:
        """What attention needs of a tier: every slot's record, ``[B, H, M, record_bytes]`` uint8.

        One ``index_select`` of whole pages. The page list only changes with the tier, so it is
        cached per tier version: a decode step between policy runs does nothing else here.
        A head's slots are a prefix of its pages, so copying whole pages (contiguous rows, as
        paged-attention kernels read them) replaces a per-slot gather. Slots past a head's count
        hold zeros (null page, zeroed on allocation) or stale records of the same tier, so they
        always decode to finite values; :meth:`slot_positions` marks them empty.
        """
        plan = self._plans[tier]
        if plan is None or plan[0] != self.versions[tier]:
            pages, m = self._page_list(tier)
            plan = self._plans[tier] = (self.versions[tier], pages.to(torch.int32), m)
        _, pages, m = plan
        return self._gather_records(tier, pages, m)

    def slot_positions(self, tier: int, rec: torch.Tensor) -> torch.Tensor:
        """Logical positions ``[B, H, M]`` (int32) of the slots in ``rec`` from :meth:`read_slots`; -1 = empty."""
        valid = torch.arange(rec.shape[2], device=self.device) < self.counts[..., tier].unsqueeze(-1)
        return torch.where(valid, self.layouts[tier].positions(rec), -1)

    def gather(self, tier: int, b: torch.Tensor, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Records of the given live slots, ``[len(s), record_bytes]``."""
        return self.pool.tier_view(self.layouts[tier].nbytes)[self._locate(tier, b, h, s)]

    # --------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Return every page (a finished request); the pool keeps its capacity for reuse."""
        self.counts.zero_()
        self.page_table.fill_(-1)
        self.pool.reset()
        self.versions = [v + 1 for v in self.versions]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (may repeat, e.g. beam search); repeated rows get their own pages."""
        reads = [self.read(t) for t in range(self.num_tiers)]
        self.batch = int(index.numel())
        self.counts = torch.zeros(self.batch, self.heads, self.num_tiers, dtype=torch.int64, device=self.device)
        self.page_table = torch.full(
            (self.batch, self.heads, self.num_tiers, self.page_table.shape[-1]),
            -1,
            dtype=torch.int32,
            device=self.device,
        )
        self.pool.reset()
        self.versions = [v + 1 for v in self.versions]
        for t, (rows, valid) in enumerate(reads):
            self.append(t, rows[index], valid[index])

    def held_tensors(self) -> list[torch.Tensor]:
        plans = [p[1] for p in self._plans if p is not None]
        return [*self.pool.held_tensors(), self.counts, self.page_table, *plans]
