"""Reading one field of a tile of records in registers, for every tier format.

The decode kernel never materialises dense keys: each tile of records is read from the byte pool
and dequantized here, right before the dot products. Formats are compile-time constants, so a
kernel instance contains only the code of the formats its tiers use. The byte layout is the one
``hfkv.quant.formats`` writes (integer codes in planes, fp16 scale/zero per group, fp8 codes
with an fp32 scale); the torch twin of every function here is ``QuantFormat.decode_at``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfkv.quant.formats import INT_BITS, QuantFormat

# Format families (tl.constexpr values).
MODEL, INT, FP8 = 0, 1, 2

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype):
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"hfkv Triton kernels: model dtype {dtype} is not supported; allowed: {list(_TL_DTYPES)}"
        ) from None


def format_constants(fmt: QuantFormat) -> dict:
    """The constexpr arguments describing one field format: family, bits, group size, model dtype."""
    if fmt.name == "model":
        return {"fam": MODEL, "bits": fmt.bits, "group": fmt.head_dim, "dtype": tl_dtype(fmt.model_dtype)}
    if fmt.name == "fp8":
        return {"fam": FP8, "bits": 8, "group": fmt.head_dim, "dtype": tl.float32}
    return {"fam": INT, "bits": INT_BITS[fmt.name], "group": fmt.group_size, "dtype": tl.float32}


@triton.jit
def load_field(
    pool_ptr,
    rec,  # [N] int64: byte offset of each record
    live,  # [N] bool: records to read (others give 0)
    OFF: tl.constexpr,  # byte offset of the field inside the record
    FAM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    DTYPE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N: tl.constexpr = 0,  # rows of the tile (``rec``'s length); needed by INT_TILE only
    INT_TILE: tl.constexpr = False,
    ALIGN: tl.constexpr = 1,  # a power of two dividing every ``rec + OFF`` (bytes): lets loads be vectors
):
    """``[N, BLOCK_D]`` fp32 values of the field (columns past ``D`` are 0).

    Integer codes are read one of two ways. The gather (default) loads, per element, its code byte and
    its group's scale and zero: ``3 D`` loads per record. ``INT_TILE`` (``D`` a power of two) loads the
    record's ``D * BITS / 8`` code bytes and ``2 D / GROUP`` halves as contiguous rows and spreads them
    over the ``D`` elements in registers (planes by shifts, groups by broadcast): ``PER`` times fewer
    code loads and ``GROUP`` times fewer scale loads, paid in register shuffles. Which is faster is the
    GPU's to say (``eval/kernel_variants.py`` sweeps both); both give the same values.
    """
    d = tl.arange(0, BLOCK_D)
    m = live[:, None] & (d < D)[None, :]
    base = tl.multiple_of(rec + OFF, ALIGN)
    if FAM == 1 and INT_TILE:
        PER_T: tl.constexpr = 8 // BITS
        P_T: tl.constexpr = D // PER_T
        G_T: tl.constexpr = D // GROUP
        if ALIGN % 4 == 0 and P_T % 4 == 0:
            # As 32-bit words: one-byte rows stayed one byte per load on sm_90 (the compiler's layout for
            # the shifts below won over the load's own); byte k of a word is its bits 8k..8k+7.
            W_T: tl.constexpr = P_T // 4
            words = pool_ptr.to(tl.pointer_type(tl.int32))
            first = tl.multiple_of(base // 4, ALIGN // 4)
            word = tl.load(words + first[:, None] + tl.arange(0, W_T)[None, :], mask=live[:, None], other=0)
            # element d is plane d // P of byte d % P; no shift reaches the sign bits' copies (<= 32 - BITS)
            shifts = tl.arange(0, PER_T)[:, None] * BITS + tl.arange(0, 4)[None, :] * 8
            codes = tl.reshape((word[:, None, :, None] >> shifts[None, :, None, :]) & ((1 << BITS) - 1), [N, D])
        else:
            j = tl.arange(0, P_T)
            byte = tl.load(pool_ptr + base[:, None] + j[None, :], mask=live[:, None], other=0).to(tl.int32)
            shifts = tl.arange(0, PER_T) * BITS  # element d is plane d // P of byte d % P
            codes = tl.reshape((byte[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), [N, D])
        half = pool_ptr.to(tl.pointer_type(tl.float16))
        # The halves start P_T bytes in: aligned to the smaller of the two powers of two, in halves.
        if P_T % ALIGN == 0:
            S_ALIGN: tl.constexpr = (ALIGN + 1) // 2
        else:
            S_ALIGN: tl.constexpr = (P_T + 1) // 2
        meta = tl.multiple_of((base + P_T) // 2, S_ALIGN)[:, None] + tl.arange(0, G_T)[None, :]
        scale = tl.load(half + meta, mask=live[:, None], other=0.0).to(tl.float32)
        zero = tl.load(half + meta + G_T, mask=live[:, None], other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [N, G_T, GROUP]), [N, D])
        zero = tl.reshape(tl.broadcast_to(zero[:, :, None], [N, G_T, GROUP]), [N, D])
        x = codes.to(tl.float32) * scale + zero
    elif FAM == 0:  # full precision in the model dtype; bf16 is upcast right after the load
        ESIZE: tl.constexpr = BITS // 8
        ptr = pool_ptr.to(tl.pointer_type(DTYPE))
        first = tl.multiple_of(base // ESIZE, (ALIGN + ESIZE - 1) // ESIZE)
        x = tl.load(ptr + first[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    elif FAM == 1:  # integer codes in planes: element d is plane d // P of byte d % P
        PER: tl.constexpr = 8 // BITS
        P: tl.constexpr = D // PER
        NB: tl.constexpr = D * BITS // 8
        G: tl.constexpr = D // GROUP
        byte = tl.load(pool_ptr + base[:, None] + (d % P)[None, :], mask=m, other=0).to(tl.int32)
        code = (byte >> ((d // P) * BITS)[None, :]) & ((1 << BITS) - 1)
        half = pool_ptr.to(tl.pointer_type(tl.float16))
        meta = ((rec + OFF + NB) // 2)[:, None] + (d // GROUP)[None, :]
        scale = tl.load(half + meta, mask=m, other=0.0).to(tl.float32)
        zero = tl.load(half + meta + G, mask=m, other=0.0).to(tl.float32)
        x = code.to(tl.float32) * scale + zero
    else:  # fp8 e4m3 codes and one fp32 scale, read bytewise (the scale need not be 4-aligned)
        byte = tl.load(pool_ptr + base[:, None] + d[None, :], mask=m, other=0)
        codes = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sb = rec + OFF + D
        w = tl.load(pool_ptr + sb, mask=live, other=0).to(tl.int32)
        w = w | (tl.load(pool_ptr + sb + 1, mask=live, other=0).to(tl.int32) << 8)
        w = w | (tl.load(pool_ptr + sb + 2, mask=live, other=0).to(tl.int32) << 16)
        w = w | (tl.load(pool_ptr + sb + 3, mask=live, other=0).to(tl.int32) << 24)
        x = codes * w.to(tl.float32, bitcast=True)[:, None]
    return x
