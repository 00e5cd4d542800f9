"""Slot metadata of a tier in one launch: :meth:`hfkv.storage.paged.PagedTiers.read_meta`'s contract on the Triton
backend (the torch path of ``read_meta`` is its twin; ``hfkv.kernels.cpu.meta`` is the CPU kernel's).

A policy run reads the position and score sum of every slot of every tier. The torch path builds slot indices,
page lookups, masks and two strided gathers per tier, about a dozen launches; on a GPU a policy run is bound by
its launches (docs/kernels.md, "Runs on a GPU"), so here it is one per tier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfkv.kernels.encode import check_pool
from hfkv.storage.record import RecordLayout

__all__ = ["read_meta_triton"]

_BLOCK = 256


@triton.jit(do_not_specialize=["table_w", "m", "page_words", "tpp"])
def _read_meta_kernel(
    words_ptr, table_ptr, table_w, counts_ptr, m, page_words, tpp, pos_ptr, score_ptr, valid_ptr,
    REC_W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = s < m
    live = inside & (s < tl.load(counts_ptr + bh))
    page = tl.load(table_ptr + bh * table_w + s // tpp, mask=live, other=0).to(tl.int64)
    at = page * page_words + tpp * REC_W + s % tpp  # the tag in the page's tag region, the score past it
    tag = tl.load(words_ptr + at, mask=live, other=0)  # slots past the count: as the null page reads
    score = tl.load(words_ptr.to(tl.pointer_type(tl.float32)) + at + tpp, mask=live, other=0.0)
    out = bh * m + s
    tl.store(pos_ptr + out, tag - 1, mask=inside)
    tl.store(score_ptr + out, score, mask=inside)
    tl.store(valid_ptr + out, live.to(tl.uint8), mask=inside)


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
            _read_meta_kernel[(bsz * heads, triton.cdiv(m, _BLOCK))](
                pool.view(torch.int32), table.contiguous(), width, counts.to(torch.int64).contiguous(), m,
                pool.shape[1] // 4, tpp, pos, score, valid, REC_W=layout.stride // 4, BLOCK=_BLOCK,
            )  # fmt: skip
    return pos, score, valid.view(torch.bool)
