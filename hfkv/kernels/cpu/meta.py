"""Slot metadata of a tier on CPU tensors: :meth:`hfkv.storage.paged.PagedTiers.read_meta`'s contract, by the C++ of
``meta.cpp`` (why: that file's header). The torch path of ``read_meta`` is its twin; the tests compare the two.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from hfkv.kernels.cpu.build import library
from hfkv.storage.record import RecordLayout

__all__ = ["read_meta_cpu"]


@cache
def _kernel():
    fn = library().hfkv_read_meta
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, i32, i32, i32, i32, i32, ptr, i32, ptr, ptr, ptr]
    fn.restype = None
    return fn


def read_meta_cpu(
    pool: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, tpp: int, layout: RecordLayout, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pos int32, score fp32, valid bool)``, each ``[B, H, m]``, of slots ``[0, m)`` of every head of one tier.

    ``pool`` is the ``[pages, page_bytes]`` uint8 pool, ``table [B, H, W]`` the tier's page table, ``counts [B, H]``
    its slot counts. Slots past a head's count read as the null page: position -1, score 0, not valid.
    """
    if not (pool.device.type == "cpu" and pool.dtype == torch.uint8 and pool.is_contiguous() and pool.dim() == 2):
        raise ValueError(f"read_meta_cpu: pool must be a contiguous [pages, bytes] uint8 CPU tensor, got {pool.dtype}")
    bsz, heads, width = table.shape
    table = table.to(torch.int32).contiguous()
    counts = counts.to(torch.int64).contiguous()
    pos = torch.empty(bsz, heads, m, dtype=torch.int32)
    score = torch.empty(bsz, heads, m, dtype=torch.float32)
    valid = torch.empty(bsz, heads, m, dtype=torch.bool)
    if m:
        _kernel()(
            pool.data_ptr(), pool.shape[1], table.data_ptr(), bsz * heads, width, tpp, layout.nbytes,
            layout.pos_offset, layout.score_offset, counts.data_ptr(), m, pos.data_ptr(), score.data_ptr(),
            valid.data_ptr(),
        )  # fmt: skip
    return pos, score, valid
