"""A tier's compaction on CPU tensors: the data movement of :meth:`hfkv.storage.paged.PagedTiers.remove`, by the C++
of ``compact.cpp`` (why: that file's header). The torch path of ``remove`` is its twin; the tests compare the two.
"""

from __future__ import annotations

import ctypes

import torch

from hfkv.kernels.cpu.build import function
from hfkv.kernels.parts import head_step
from hfkv.quant.record import RecordLayout

__all__ = ["compact_cpu", "release_pages_cpu"]


def _cpu_step(counts: torch.Tensor, where: str) -> int:
    if counts.device.type != "cpu":
        raise ValueError(f"{where}: counts must be on the CPU, got {counts.device}")
    return head_step(counts, where)


def compact_cpu(
    pool: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    keep: torch.Tensor,
    tpp: int,
    layout: RecordLayout,
) -> torch.Tensor:
    """Move each head's kept records below its new count into the holes there and zero the vacated tags; returns
    the new counts ``[B, H]`` int64 (:func:`hfkv.kernels.move.compact`'s contract).

    ``pool [pages, page_bytes]`` uint8, ``table [B, H, W]`` the tier's page table, ``counts [B, H]`` its slot
    counts (int64; a tier's view of ``PagedTiers.counts`` is fine; left as they are), ``keep [B, H, M]`` bool
    (flags past a head's count ignored).
    """
    if not (pool.device.type == "cpu" and pool.dtype == torch.uint8 and pool.is_contiguous() and pool.dim() == 2):
        raise ValueError(f"compact_cpu: pool must be a contiguous [pages, bytes] uint8 CPU tensor, got {pool.dtype}")
    bsz, heads, width = table.shape
    m = keep.shape[-1]
    if keep.shape[:2] != (bsz, heads) or counts.shape != (bsz, heads):
        raise ValueError(
            f"compact_cpu: keep {tuple(keep.shape)} and counts {tuple(counts.shape)} must lead with the table's "
            f"[B, H] = {(bsz, heads)}"
        )
    new = torch.zeros(bsz, heads, dtype=torch.int64)
    if m == 0 or width == 0:
        return new
    step = _cpu_step(counts, "compact_cpu")
    table = table.to(torch.int32).contiguous()
    keep = keep.to(torch.uint8).contiguous()
    function("hfkv_compact", "p i64 p i64 i32 i32 i32 i32 p i64 p i32 p")(
        pool.data_ptr(), pool.shape[1], table.data_ptr(), bsz * heads, width, tpp, layout.stride,
        layout.tag_region(tpp), counts.data_ptr(), step, keep.data_ptr(), m, new.data_ptr(),
    )  # fmt: skip
    return new


def release_pages_cpu(
    table: torch.Tensor,
    counts: torch.Tensor,
    new: torch.Tensor,
    tpp: int,
    free_stack: torch.Tensor,
    n_free: int,
    known: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """:func:`hfkv.kernels.move.release_pages` on CPU tensors (same arguments and result; ``table`` contiguous int32
    and ``free_stack`` int32, written in place)."""
    if not (table.dtype == torch.int32 and table.is_contiguous() and free_stack.dtype == torch.int32):
        raise ValueError("release_pages_cpu: table must be contiguous int32 and free_stack int32 (written in place)")
    bsz, heads, width = table.shape
    step = _cpu_step(counts, "release_pages_cpu")
    new = new.to(torch.int64).contiguous()
    widest = ctypes.c_int64(0)
    n_freed = function("hfkv_release", "p i64 i32 p i64 p i32 p i64 p", "i64")(
        table.data_ptr(), bsz * heads, width, counts.data_ptr(), step, new.data_ptr(), tpp, free_stack.data_ptr(),
        n_free, ctypes.byref(widest),
    )  # fmt: skip
    return (int(n_freed), int(widest.value)) if known is None else known
