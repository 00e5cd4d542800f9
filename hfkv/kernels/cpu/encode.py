"""Encode and write records on CPU tensors: :func:`hfkv.kernels.encode.encode_write`'s contract, by the C++ of
``encode.cpp`` (why: that file's header). Torch twin: :func:`hfkv.kernels.encode.encode_write_reference`
(``RecordLayout.encode`` and a scatter); the tests compare the two byte for byte.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from hfkv.kernels.cpu.build import library
from hfkv.quant.formats import INT_BITS, QuantFormat
from hfkv.quant.record import RecordLayout

__all__ = ["encode_write_cpu"]

_MODEL = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


@cache
def _kernel():
    fn = library().hfkv_encode_write
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    fn.argtypes = [ptr, ptr, i64, ptr, ptr, i32, i32, ptr, ptr, ptr, ptr, i64, i32, i32]
    fn.restype = None
    return fn


def _field(fmt: QuantFormat, offset: int) -> torch.Tensor:
    if fmt.name in INT_BITS:
        desc = (1, INT_BITS[fmt.name], fmt.group_size, 0)
    elif fmt.name == "fp8":
        desc = (2, 8, fmt.head_dim, 0)
    else:
        desc = (0, fmt.bits, fmt.head_dim, _MODEL[fmt.model_dtype])
    return torch.tensor([*desc, offset, fmt.nbytes], dtype=torch.int32)


@cache
def _fields(layout: RecordLayout) -> tuple[torch.Tensor, torch.Tensor]:
    return _field(layout.key, 0), _field(layout.value, layout.key.nbytes)


def encode_write_cpu(
    pool: torch.Tensor,
    dest: torch.Tensor,
    layout: RecordLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
    checked: bool = True,
) -> None:
    """Encode tokens ``k, v [N, D]`` as ``layout`` records and write record ``i`` into the slot whose body starts
    at byte ``dest[i]`` of ``pool`` (CPU tensors; distinct slot starts, as :func:`hfkv.kernels.encode.encode_write`).

    ``checked=False`` skips validating ``dest`` against the pool (three reductions read back): for slots the
    storage itself just reserved (``PagedTiers.append_tokens``), a tenth of a policy run's admission."""
    n = dest.shape[0] if dest.dim() == 1 else -1
    if not (pool.device.type == "cpu" and pool.dtype == torch.uint8 and pool.is_contiguous() and pool.dim() == 2):
        raise ValueError(
            f"encode_write_cpu: pool must be a contiguous uint8 [pages, page_bytes] CPU tensor, got {pool.dtype} "
            f"shape {tuple(pool.shape)}"
        )
    if n < 0 or dest.dtype != torch.int64:
        raise ValueError(f"encode_write_cpu: dest must be int64 [N] byte offsets, got {dest.dtype} {tuple(dest.shape)}")
    for name, x, fmt in (("k", k, layout.key), ("v", v, layout.value)):
        if tuple(x.shape) != (n, fmt.head_dim) or x.dtype not in _INPUTS:
            raise ValueError(
                f"encode_write_cpu: {name} must be [{n}, {fmt.head_dim}] in one of {list(_INPUTS)}, got "
                f"{x.dtype} {tuple(x.shape)}"
            )
    if tuple(pos.shape) != (n,) or pos.dtype.is_floating_point or tuple(score.shape) != (n,):
        raise ValueError(f"encode_write_cpu: pos (integer) and score must be [{n}], got {pos.dtype} / {score.dtype}")
    if n == 0:
        return
    tpp = layout.records_per_page(pool.shape[1])
    if checked:
        in_page = dest % pool.shape[1]
        if int(dest.min()) < 0 or int(dest.max()) >= pool.numel() or int(in_page.max()) >= tpp * layout.stride:
            raise ValueError(
                f"encode_write_cpu: dest must be slot starts, page * {pool.shape[1]} + slot * {layout.stride} "
                f"with slot < {tpp}, inside the pool's {pool.numel()} bytes"
            )
    kf, vf = k.to(torch.float32).contiguous(), v.to(torch.float32).contiguous()
    p, s = pos.to(torch.int64).contiguous(), score.to(torch.float32).contiguous()
    fk, fv = _fields(layout)
    dest = dest.contiguous()
    _kernel()(
        pool.data_ptr(), dest.data_ptr(), n, kf.data_ptr(), vf.data_ptr(), layout.key.head_dim,
        layout.value.head_dim, p.data_ptr(), s.data_ptr(), fk.data_ptr(), fv.data_ptr(), pool.shape[1], tpp,
        layout.stride,
    )  # fmt: skip
