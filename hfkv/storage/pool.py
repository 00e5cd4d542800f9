"""A layer's page pool: one byte tensor shared by every tier, plus a free-page stack.

Pages are handed out in bulk: the caller asks for ``n`` pages at once (the sum of many heads'
demands) and slices the returned ids with a cumsum, so allocation for all heads of a layer is
one stack pop, not a loop.

Growth is what ``kv_bytes`` pays for, because capacity is held. A pool whose final size is bounded
(a cache with a budget) grows by exactly what is asked: it stops growing at the bound, so the
copies stay few, and its capacity never exceeds its peak demand. An unbounded pool grows
geometrically by ``growth`` (1/32 by default): a few percent of capacity buys amortised
constant-time growth over a long generation.

Page ``NULL_PAGE`` is reserved and never handed out: it stays all zeros, so a padded read of an
empty slot decodes to finite zeros with a zero tag (empty), and padded score updates add exact
zeros to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hfkv.quant.record import RecordLayout

NULL_PAGE = 0
RESERVED_PAGES = 1
GROWTH = 1 / 32  # geometric growth of an unbounded pool


class PagePool:
    def __init__(
        self,
        page_bytes: int,
        device: torch.device | str = "cpu",
        initial_pages: int = 16,
        growth: float = GROWTH,
    ) -> None:
        if page_bytes <= 0 or page_bytes % 4:
            raise ValueError(f"PagePool.page_bytes={page_bytes} must be a positive multiple of 4")
        if not 0 <= growth <= 1:
            raise ValueError(f"PagePool.growth={growth} must be in [0, 1] (0: grow by exact demand)")
        self.page_bytes = page_bytes
        self.growth = growth
        self.device = torch.device(device)
        n = max(int(initial_pages), 0) + RESERVED_PAGES
        self.data = torch.zeros(n, page_bytes, dtype=torch.uint8, device=self.device)
        # Stack of free page ids: entries [0, n_free) are free; top of stack is n_free - 1.
        self.free_stack = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.reset()

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def pages_in_use(self) -> int:
        """Pages owned by heads (the reserved page is not counted here, but is held)."""
        return self.num_pages - self.n_free - RESERVED_PAGES

    def _grow(self, need: int) -> None:
        old = self.num_pages
        extra = max(need - self.n_free, math.ceil(old * self.growth))
        new = old + extra
        self.data = torch.cat([self.data, torch.zeros(extra, self.page_bytes, dtype=torch.uint8, device=self.device)])
        new_ids = torch.arange(new - 1, old - 1, -1, dtype=torch.int32, device=self.device)
        stack = torch.empty(new, dtype=torch.int32, device=self.device)
        # New pages go below the existing free ids so recently freed (warm) pages are reused first.
        stack[:extra] = new_ids
        stack[extra : extra + self.n_free] = self.free_stack[: self.n_free]
        self.free_stack = stack
        self.n_free += extra

    def allocate(self, n: int) -> torch.Tensor:
        """Pop ``n`` page ids (int32, on the pool's device)."""
        if n < 0:
            raise ValueError(f"PagePool.allocate: n={n} must be >= 0")
        if n > self.n_free:
            self._grow(n)
        self.n_free -= n
        return self.free_stack[self.n_free : self.n_free + n].clone()

    def take(self, n: int) -> torch.Tensor:
        """:meth:`allocate` without the copy: the ids as a view of the free stack, valid until the next release or
        growth overwrites that part of it (a kernel launched before then reads them, as a policy run's appends do:
        one launch fewer each)."""
        if n < 0:
            raise ValueError(f"PagePool.take: n={n} must be >= 0")
        if n > self.n_free:
            self._grow(n)
        self.n_free -= n
        return self.free_stack[self.n_free : self.n_free + n]

    def release(self, ids: torch.Tensor) -> None:
        """Push page ids back. Callers guarantee ids are live and distinct (checked in tests)."""
        n = int(ids.numel())
        if n == 0:
            return
        self.free_stack[self.n_free : self.n_free + n] = ids.to(torch.int32).reshape(-1)
        self.n_free += n

    def pushed(self, n: int) -> None:
        """``n`` page ids were written onto the stack past its top by a kernel (``hfkv.kernels.move.release_pages``):
        what :meth:`release` does, without a launch of its own."""
        self.n_free += n

    def reset(self) -> None:
        """Every page back on the stack, in descending order so the lowest ids are handed out first."""
        n = self.num_pages
        self.free_stack[: n - RESERVED_PAGES] = torch.arange(
            n - 1, RESERVED_PAGES - 1, -1, dtype=torch.int32, device=self.device
        )
        self.n_free = n - RESERVED_PAGES

    def bodies(self, layout: RecordLayout) -> torch.Tensor:
        """The pool seen as ``[pages, tokens_per_page, layout.stride]``: every slot's keys and values."""
        tpp, st = layout.records_per_page(self.page_bytes), layout.stride
        return self.data.as_strided((self.num_pages, tpp, st), (self.page_bytes, st, 1))

    def tags(self, layout: RecordLayout) -> torch.Tensor:
        """The pool seen as ``[pages, tokens_per_page]`` int32: every slot's tag (its page's tag region)."""
        return self._region(layout, torch.int32, layout.tag_region)

    def scores(self, layout: RecordLayout) -> torch.Tensor:
        """The pool seen as ``[pages, tokens_per_page]`` fp32: every slot's score sum (its page's score region)."""
        return self._region(layout, torch.float32, layout.score_region)

    def _region(self, layout: RecordLayout, dtype: torch.dtype, offset: Callable[[int], int]) -> torch.Tensor:
        """``[pages, tpp]`` 4-byte words starting ``offset(tpp)`` bytes into every page."""
        tpp, pb = layout.records_per_page(self.page_bytes), self.page_bytes
        return self.data.view(dtype).as_strided((self.num_pages, tpp), (pb // 4, 1), offset(tpp) // 4)

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.data, self.free_stack]
