"""Records of given slots, decoded, on CPU tensors: :func:`hfkv.kernels.gather.gather_decode`'s contract, by the C++
``hfkv_gather_decode`` of ``paged_decode.cpp`` (beside the decode kernel, whose field decoder it uses).

A policy run reads the tokens it demotes as fp32 and re-encodes them into their new tier; the torch path of
:meth:`hfkv.storage.paged.PagedTiers.gather_decoded` (a page lookup, a gather, ``RecordLayout.decode_kv``) is the
twin, equal bit for bit, and was the largest part of a CPU policy run at 8k tokens that demotes.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from hfkv.kernels.cpu.build import library
from hfkv.kernels.cpu.paged_decode import _describe, _Part
from hfkv.kernels.parts import PagedSlots
from hfkv.quant.record import RecordLayout

__all__ = ["gather_decode_cpu"]


@cache
def _kernel():
    fn = library().hfkv_gather_decode
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    fn.argtypes = [ctypes.POINTER(_Part), i32, i64, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    return fn


def gather_decode_cpu(
    pool: torch.Tensor, table: torch.Tensor, tpp: int, layout: RecordLayout, b: torch.Tensor, h: torch.Tensor,
    s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(k, v [n, D] fp32, pos [n] int64, score [n] fp32)`` of the live slots ``(b, h, s)`` of one tier (``table
    [B, H, W]`` its page table, ``tpp`` records per page), equal to ``PagedTiers.gather_decoded``'s torch path."""
    if pool.device.type != "cpu":
        raise ValueError(f"gather_decode_cpu: the pool must be a CPU tensor, got one on {pool.device}")
    n, dim = s.numel(), layout.key.head_dim
    k = torch.empty(n, dim, dtype=torch.float32)
    v = torch.empty(n, dim, dtype=torch.float32)
    pos = torch.empty(n, dtype=torch.int64)
    score = torch.empty(n, dtype=torch.float32)
    if n == 0:
        return k, v, pos, score
    keep: list[torch.Tensor] = []
    part = _describe(PagedSlots(pool, table, tpp, layout), False, keep)
    idx = [x.to(torch.int64).contiguous() for x in (b, h, s)]
    rc = _kernel()(
        ctypes.byref(part), table.shape[1], n, *(x.data_ptr() for x in idx), dim, k.data_ptr(), v.data_ptr(),
        pos.data_ptr(), score.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"gather_decode_cpu: head_dim={dim} is above the CPU kernel's 512")
    return k, v, pos, score
