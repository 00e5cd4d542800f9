"""A tier's compaction on CPU tensors: the data movement of :meth:`hfkv.storage.paged.PagedTiers.remove`, by the C++
of ``compact.cpp`` (why: that file's header). The torch path of ``remove`` is its twin; the tests compare the two.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from hfkv.kernels.cpu.build import library
from hfkv.storage.record import RecordLayout

__all__ = ["compact_cpu"]


@cache
def _kernel():
    fn = library().hfkv_compact
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, i32, i32, i32, i32, ptr, ptr, i32, ptr]
    fn.restype = None
    return fn


def compact_cpu(
    pool: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    keep: torch.Tensor,
    new_counts: torch.Tensor,
    tpp: int,
    layout: RecordLayout,
) -> None:
    """Move each head's kept records below its new count into the holes there and zero the vacated tags.

    ``pool [pages, page_bytes]`` uint8, ``table [B, H, W]`` the tier's page table, ``counts [B, H]`` its slot
    counts, ``keep [B, H, M]`` bool (False past a head's count), ``new_counts [B, H]`` = ``keep.sum(-1)``.
    """
    if not (pool.device.type == "cpu" and pool.dtype == torch.uint8 and pool.is_contiguous() and pool.dim() == 2):
        raise ValueError(f"compact_cpu: pool must be a contiguous [pages, bytes] uint8 CPU tensor, got {pool.dtype}")
    bsz, heads, width = table.shape
    m = keep.shape[-1]
    if keep.shape[:2] != (bsz, heads) or counts.shape != (bsz, heads) or new_counts.shape != (bsz, heads):
        raise ValueError(
            f"compact_cpu: keep {tuple(keep.shape)}, counts {tuple(counts.shape)} and new_counts "
            f"{tuple(new_counts.shape)} must lead with the table's [B, H] = {(bsz, heads)}"
        )
    if m == 0 or width == 0:
        return
    table = table.to(torch.int32).contiguous()
    keep = keep.to(torch.uint8).contiguous()
    counts = counts.to(torch.int64).contiguous()
    new_counts = new_counts.to(torch.int64).contiguous()
    _kernel()(
        pool.data_ptr(), pool.shape[1], table.data_ptr(), bsz * heads, width, tpp, layout.stride,
        layout.tag_region(tpp), counts.data_ptr(), keep.data_ptr(), m, new_counts.data_ptr(),
    )  # fmt: skip
