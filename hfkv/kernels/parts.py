"""The slots one attention call reads, as the decode kernels (Triton and CPU) take them.

Kept apart from the kernels so the CPU path and the torch twin need no Triton import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hfkv.quant.record import RecordLayout

__all__ = ["DenseSlots", "PagedSlots", "Part", "plan_key"]


@dataclass(frozen=True)
class DenseSlots:
    """Slots held densely in the model dtype (the window ring, a chunk's exits).

    ``k, v [B, H, S, D]``; ``pos [S]`` logical positions shared by every row (-1: empty slot);
    ``score [B, H, S]`` fp32 sums that attention adds to in place (None: not scored).
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    score: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class PagedSlots:
    """One tier of a layer's paged storage: its byte pool, page table ``[B, H, W]`` and record layout."""

    pool: torch.Tensor
    table: torch.Tensor
    tpp: int
    layout: RecordLayout

    @property
    def slots(self) -> int:
        return self.table.shape[-1] * self.tpp

    def record_offsets(self) -> torch.Tensor:
        """``[B, H, slots]`` int64 byte offset of every slot's record (null-page entries included)."""
        s = torch.arange(self.slots, device=self.table.device)
        page = self.table.long()[..., s // self.tpp]
        return page * self.pool.shape[1] + (s % self.tpp) * self.layout.stride

    def tag_offsets(self) -> torch.Tensor:
        """``[B, H, slots]`` int64 byte offset of every slot's tag (in its page's tag region)."""
        return self._meta_offsets(self.layout.tag_region(self.tpp))

    def score_offsets(self) -> torch.Tensor:
        """``[B, H, slots]`` int64 byte offset of every slot's score (in its page's score region)."""
        return self._meta_offsets(self.layout.score_region(self.tpp))

    def _meta_offsets(self, region: int) -> torch.Tensor:
        s = torch.arange(self.slots, device=self.table.device)
        page = self.table.long()[..., s // self.tpp]
        return page * self.pool.shape[1] + region + (s % self.tpp) * 4


Part = DenseSlots | PagedSlots


def head_step(counts: torch.Tensor, where: str) -> int:
    """The step between heads of per-head counts ``[B, H]`` int64 whose heads lie at equal steps (a tier's view
    of ``PagedTiers.counts [B, H, T]`` does): what the kernels that read and write counts in place take."""
    bsz, heads = counts.shape
    if counts.dtype != torch.int64 or (bsz > 1 and counts.stride(0) != heads * counts.stride(1)):
        raise ValueError(f"{where}: counts must be int64 [B, H] with heads at equal steps, got {counts.dtype} "
                         f"strides {counts.stride()}")  # fmt: skip
    return counts.stride(1)


def plan_key(query: torch.Tensor, parts: list[Part] | tuple[Part, ...], write: bool) -> tuple:
    """What a kernel's launch plan depends on beyond its options: the query's shape and dtype, each
    part's tensors (by identity: a plan holds them, so an id cannot be reused while it lives) and shapes.
    A layer keeps its plan while this key stays (its tensors change only at policy runs, when a table or
    the pool grows, or on batch surgery)."""
    ids = []
    for p in parts:
        if isinstance(p, DenseSlots):
            ids.append((id(p.k), id(p.v), id(p.pos), id(p.score), p.k.shape))
        else:
            ids.append((id(p.pool), id(p.table), p.pool.shape, p.table.shape, p.tpp, p.layout))
    return (tuple(query.shape), query.dtype, query.device, write, tuple(ids))
