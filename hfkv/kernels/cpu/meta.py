"""Slot metadata of a tier on CPU tensors: :meth:`hfkv.storage.paged.PagedTiers.read_meta`'s contract, by the C++ of
``meta.cpp`` (why: that file's header). The torch path of ``read_meta`` is its twin; the tests compare the two.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

import torch

from hfkv.kernels.cpu.build import library
from hfkv.kernels.reference import check_candidates
from hfkv.quant.record import RecordLayout
from hfkv.states import EVICTED, ORIGINAL

__all__ = ["read_candidates_cpu", "read_meta_cpu", "tier_changes_cpu"]


@cache
def _kernel():
    fn = library().hfkv_read_meta
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, i32, i32, i32, i32, ptr, i32, ptr, ptr, ptr]
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
            pool.data_ptr(), pool.shape[1], table.data_ptr(), bsz * heads, width, tpp, layout.tag_region(tpp),
            layout.score_region(tpp), counts.data_ptr(), m, pos.data_ptr(), score.data_ptr(),
            valid.data_ptr(),
        )  # fmt: skip
    return pos, score, valid


@cache
def _changes_kernel():
    fn = library().hfkv_tier_changes
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    fn.argtypes = [ptr, ptr, i64, i64, ptr, i32, i32, ptr]
    fn.restype = None
    return fn


def tier_changes_cpu(new: torch.Tensor, valid: torch.Tensor, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """:func:`hfkv.kernels.changes.tier_changes_reference` in one C++ pass (``new`` int8, ``valid`` bool, both
    ``[B, H, N]`` CPU tensors; slots past the tiers' are ignored): per tier, its valid slots moving to a lower
    tier they are kept in, and its valid slots leaving it."""
    if new.device.type != "cpu" or new.shape != valid.shape or new.dim() != 3:
        raise ValueError(
            f"tier_changes_cpu: new {tuple(new.shape)} and valid {tuple(valid.shape)}: [B, H, N] CPU tensors"
        )
    ends = torch.tensor([sum(sizes[: t + 1]) for t in range(len(sizes))], dtype=torch.int64)
    if len(sizes) and int(ends[-1]) > new.shape[-1]:
        raise ValueError(f"tier_changes_cpu: sizes {list(sizes)} cover more than the {new.shape[-1]} slots given")
    out = torch.zeros(2 * len(sizes), dtype=torch.int64)
    fresh = new.to(torch.int8).contiguous()
    ok = valid.to(torch.uint8).contiguous()
    _changes_kernel()(
        fresh.data_ptr(), ok.data_ptr(), new.shape[0] * new.shape[1], new.shape[-1], ends.data_ptr(), len(sizes),
        EVICTED, out.data_ptr(),
    )  # fmt: skip
    flat = out.tolist()
    return [(flat[2 * t], flat[2 * t + 1]) for t in range(len(sizes))]


@cache
def _candidates_kernel():
    fn = library().hfkv_read_candidates
    ptr, i8, i32, i64 = ctypes.c_void_p, ctypes.c_int8, ctypes.c_int32, ctypes.c_int64
    fn.argtypes = [ptr, i64, i32, *[ptr] * 7, i64, i64, ptr, ptr, i32, ptr, i8, i8, ptr, ptr, ptr, ptr]
    fn.restype = None
    return fn


def read_candidates_cpu(
    pool: torch.Tensor,
    tables: Sequence[torch.Tensor],
    counts: torch.Tensor,
    tpp: Sequence[int],
    layouts: Sequence[RecordLayout],
    m: Sequence[int],
    exit_pos: torch.Tensor,
    exit_score: torch.Tensor,
    pad_end: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`hfkv.storage.paged.PagedTiers.candidates` (its torch twin) in one C++ pass over the page tables:
    ``(pos int64, score fp32, valid bool, state int8)``, each ``[B, H, sum(m) + len(exit_pos)]``."""
    if not (pool.device.type == "cpu" and pool.dtype == torch.uint8 and pool.is_contiguous() and pool.dim() == 2):
        raise ValueError(f"read_candidates_cpu: pool must be a contiguous [pages, bytes] uint8 CPU tensor, got "
                         f"{pool.dtype} on {pool.device}")  # fmt: skip
    n_exit = check_candidates("read_candidates_cpu", counts, tables, tpp, layouts, m, exit_pos, exit_score)
    bsz, heads, tiers = counts.shape
    n = sum(m) + n_exit
    tabs = [t.to(torch.int32).contiguous() for t in tables]
    keep = [
        counts.to(torch.int64).contiguous(),
        exit_pos.to(torch.int64).contiguous(),
        exit_score.to(torch.float32).contiguous(),
        pad_end.to(torch.int64).contiguous(),
    ]
    arrays = [
        (ctypes.c_void_p * tiers)(*(t.data_ptr() for t in tabs)),
        *(
            (ctypes.c_int32 * tiers)(*values)
            for values in (
                [t.shape[-1] for t in tabs],
                tpp,
                [lay.tag_region(p) for lay, p in zip(layouts, tpp, strict=True)],
                [lay.score_region(p) for lay, p in zip(layouts, tpp, strict=True)],
            )
        ),
    ]
    pos = torch.empty(bsz, heads, n, dtype=torch.int64)
    score = torch.empty(bsz, heads, n, dtype=torch.float32)
    valid = torch.empty(bsz, heads, n, dtype=torch.bool)
    state = torch.empty(bsz, heads, n, dtype=torch.int8)
    if n:
        _candidates_kernel()(
            pool.data_ptr(), pool.shape[1], tiers, *arrays, keep[0].data_ptr(), (ctypes.c_int32 * tiers)(*m), bsz,
            heads, keep[1].data_ptr(), keep[2].data_ptr(), n_exit, keep[3].data_ptr(), ORIGINAL, EVICTED,
            pos.data_ptr(), score.data_ptr(), valid.data_ptr(), state.data_ptr(),
        )  # fmt: skip
    return pos, score, valid, state
