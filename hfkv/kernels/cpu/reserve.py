"""Slots for appended records on CPU tensors: :func:`hfkv.kernels.reserve.reserve_slots`'s contract, by the C++ of
``reserve.cpp`` (why: that file's header). The torch path of :meth:`hfkv.storage.paged.PagedTiers._reserve` is its
twin; the tests compare the two.
"""

from __future__ import annotations

import ctypes

import torch

from hfkv.kernels.cpu.build import function
from hfkv.kernels.parts import head_step

__all__ = ["count_appends_cpu", "reserve_slots_cpu"]


def reserve_slots_cpu(
    pool: torch.Tensor, table: torch.Tensor, old: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, tpp: int,
    record_bytes: int, n: int,
) -> torch.Tensor:  # fmt: skip
    """:func:`hfkv.kernels.reserve.reserve_slots` on CPU tensors (same arguments and result); ``table`` must be
    contiguous int32, since it is written in place."""
    if not (pool.device.type == "cpu" and pool.dtype == torch.uint8 and pool.is_contiguous() and pool.dim() == 2):
        raise ValueError(
            f"reserve_slots_cpu: pool must be a contiguous [pages, bytes] uint8 CPU tensor, got {pool.dtype}"
        )
    if not (table.dtype == torch.int32 and table.is_contiguous()):
        raise ValueError(
            f"reserve_slots_cpu: table must be a contiguous int32 tensor (written in place), got {table.dtype}"
        )
    out = torch.empty(n, dtype=torch.int64)
    heads = old.numel()
    if heads == 0 or n == 0 and ids.numel() == 0:
        return out
    old = old.to(torch.int64).contiguous()
    k = k.to(torch.int64).contiguous()
    ids = ids.to(torch.int32).contiguous()
    function("hfkv_reserve", "p i64 p i32 p p p i64 i32 i32 p")(
        pool.data_ptr(), pool.shape[1], table.data_ptr(), table.shape[-1], old.data_ptr(), k.data_ptr(),
        ids.data_ptr(), heads, tpp, record_bytes, out.data_ptr(),
    )  # fmt: skip
    return out


def count_appends_cpu(
    b: torch.Tensor, h: torch.Tensor, counts: torch.Tensor, tpp: int, known: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """:func:`hfkv.kernels.reserve.count_appends` on CPU tensors (same arguments and result; ``counts`` is written)."""
    step, n_heads = head_step(counts, "count_appends_cpu"), counts.numel()
    b, h = b.to(torch.int64).contiguous(), h.to(torch.int64).contiguous()
    k = torch.empty(n_heads, dtype=torch.int64)
    old = torch.empty(n_heads, dtype=torch.int64)
    widest = ctypes.c_int64(0)
    total = function("hfkv_count_appends", "p p i64 i64 p i64 i64 i32 p p p", "i64")(
        b.data_ptr(), h.data_ptr(), b.numel(), counts.shape[1], counts.data_ptr(), step, n_heads, tpp, k.data_ptr(),
        old.data_ptr(), ctypes.byref(widest),
    )  # fmt: skip
    return (k, old, int(total), int(widest.value)) if known is None else (k, old, *known)
