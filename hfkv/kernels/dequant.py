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


def piece_width(fmt: QuantFormat) -> int:
    """Elements per *piece* of an integer field for ``load_int_pieces`` (0: not read in pieces).

    A piece is the format's chunk (``QuantFormat.chunk``: a run of elements inside one code plane and
    one group), so its codes come from contiguous bytes with one shift, and one scale and one zero
    serve all of them.
    """
    if fmt.name not in INT_BITS:
        return 0
    c, d = fmt.chunk, fmt.head_dim
    return c if c >= 16 and not c & (c - 1) and not d & (d - 1) else 0


@triton.constexpr_function
def spread_lane_bit(D: int, C: int, SPREAD: bool) -> int:
    """The tile column (a power of two) whose bit ``load_int_pieces`` swaps with column bit 5 (``SPREAD``), 0: none.

    A piece of 8 words is read by two lanes (16 bytes each), so word bit 2 is a lane bit; the joins put it at
    column ``D // C * 16`` (see ``piece_columns``). The tile goes to shared memory for the tensor cores in 16-byte
    vectors of 16-bit columns, a quarter-warp (eight lanes) a wavefront, and the products' operand layout swizzles
    vectors by XOR with the row: a quarter-warp's four rows spread over vector bits 0 and 1 of the bank group. A lane
    bit at column bit 5 (vector bit 2) spreads it over all eight bank groups; at column bit 6 or above it lands where
    column 0 does, every store two wavefronts a quarter-warp (ncu, H200: 8 a 16-byte store where 4 would do)."""
    lane = D // C * 16
    return lane if SPREAD and C == 32 and 32 < lane < D else 0


@triton.jit
def piece_columns(BITS: tl.constexpr, D: tl.constexpr, C: tl.constexpr, SPREAD: tl.constexpr = True):
    """``[D]``: the element of the field each column of ``load_int_pieces``' tile holds (``SPREAD``: as it read
    them with the same flag)."""
    PER: tl.constexpr = 8 // BITS
    H: tl.constexpr = D // PER // C  # pieces per code plane
    NSUB: tl.constexpr = D // C * 4  # (piece, byte of a word) sub-tiles, joined in a tree
    f = tl.arange(0, D)
    LANE: tl.constexpr = spread_lane_bit(D, C, SPREAD)
    if LANE:  # load_int_pieces swapped column bits 5 and LANE
        flip = ((f & 32) > 0) != ((f & LANE) > 0)
        f = tl.where(flip, f ^ (32 | LANE), f)
    # load_int_pieces moves the byte index's high bit (j) behind the tree's dimensions: column i, t, j holds what the
    # tree put at i, j, t
    q = f % NSUB
    r = q // (NSUB // 2) * (NSUB // 2) + q % 2 * (NSUB // 4) + q % (NSUB // 2) // 2
    s = bit_reverse(r, log2(NSUB))  # the join tree puts sub-tile s at column w * NSUB + bitreverse(s)
    k = s % 4
    pl = s // 4 % PER
    h = s // (4 * PER)
    return (pl * H + h) * C + 4 * (f // NSUB) + k


@triton.jit
def bit_reverse(x, BITS: tl.constexpr):
    """``x``'s low ``BITS`` bits in reverse order: where a tree of ``tl.join`` puts its leaves (each join's new
    dimension goes last, so the first split lands on the lowest column bit)."""
    y = x * 0
    for b in tl.static_range(BITS):
        y = y * 2 + ((x >> b) & 1)
    return y


@triton.constexpr_function
def log2(n: int) -> int:
    """``log2`` of a power of two, at compile time (a constexpr inside a kernel)."""
    return int(n).bit_length() - 1


@triton.constexpr_function
def f16_pair(exponent: int, negative: bool = False) -> str:
    """The 32-bit word holding ``+-2**exponent`` in both fp16 lanes (a normal fp16: -14 <= exponent <= 15), as PTX
    hex: the constants of the codes' exact rescaling."""
    bits = int(negative) << 15 | (15 + exponent) << 10
    return f"{bits | bits << 16:#x}"


@triton.constexpr_function
def half_pair_asm(bits: int, shift: int = 0) -> str:
    """The fp16 form's arithmetic for a pair of 16-bit lanes in one register, as PTX (``ASM_DEQUANT``): the ``bits``
    of each lane from bit ``shift`` up ORed into fp16 1024.0 (one ``lop3`` for both lanes: ``1024 + code * 2**shift``,
    exact below 1024), scaled back to the code exactly (a subtraction of 1024, or with ``shift`` a fused
    ``* 2**-shift - 1024 * 2**-shift``), then ``code * scale + zero`` with one rounding. A code plane is read where it
    lies, without a shift of its word. Lane by lane, so whichever elements the compiler pairs in a register, each
    output is its own input's. Written out where Triton 3.6 left half the pairs' operations on one lane and repacked
    the rest (``PRMT``), for a third of the quantized loop's instructions (docs/kernels.md). A constexpr function:
    kernels build the text for their constant ``(bits, shift)``."""
    if bits + shift > 8:
        raise ValueError(f"half_pair_asm: bits={bits} from shift={shift} reach past a byte")
    mask = ((1 << bits) - 1) << shift
    lop = f"lop3.b32 t, $1, {mask | mask << 16:#x}, 0x64006400, 0xea; "  # 0xea: (a & b) | c
    if shift:
        back = f"mov.b32 a, {f16_pair(-shift)}; mov.b32 c, {f16_pair(10 - shift, True)}; fma.rn.f16x2 t, t, a, c; "
    else:
        back = "mov.b32 c, 0x64006400; sub.f16x2 t, t, c; "
    return "{ .reg .b32 t, a, c; " + lop + back + "fma.rn.f16x2 $0, t, $2, $3; }"


@triton.jit
def _half_pairs_asm(lanes, scale, zero, MASK: tl.constexpr, SHIFT: tl.constexpr):
    # fp16 ``code * scale + zero`` of each uint16 lane's code (MASK) at bit SHIFT, two lanes a register (half_pair_asm)
    ASM: tl.constexpr = half_pair_asm(log2(MASK + 1), SHIFT)
    return tl.inline_asm_elementwise(ASM, "=r,r,r,r", [lanes, scale, zero], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _piece_bytes(
    word,
    scale,
    zero,
    SHIFT: tl.constexpr,
    MASK: tl.constexpr,
    LO: tl.constexpr,
    COUNT: tl.constexpr,
    HALF: tl.constexpr = False,
):
    # the four bytes of each word, each one code of the plane at SHIFT, dequantised; joined lowest byte first
    if HALF and COUNT == 4:
        # Two codes per 32-bit op: bytes 0 and 2 (then 1 and 3) of the word, each in a 16-bit lane ORed into
        # fp16 1024.0, so a pair is one register and one HADD2 / HFMA2; joined in the order [b0, b2, b1, b3],
        # which is the order the fp32 form's tree below gives.
        if HALF == 2:  # the arithmetic as PTX, on the word's two 16-bit halves side by side (packed back into it)
            w13 = word >> 8
            l02 = tl.join(word.to(tl.uint16), (word >> 16).to(tl.uint16))
            l13 = tl.join(w13.to(tl.uint16), (w13 >> 16).to(tl.uint16))
            s = tl.broadcast_to(scale[:, None, None], l02.shape)
            z = tl.broadcast_to(zero[:, None, None], l02.shape)
            a = _half_pairs_asm(l02, s, z, MASK, SHIFT)
            b = _half_pairs_asm(l13, s, z, MASK, SHIFT)
        else:
            u02 = word >> SHIFT
            u13 = word >> (SHIFT + 8)
            m2: tl.constexpr = MASK | (MASK << 16)
            t02 = (u02 & m2) | 0x64006400
            t13 = (u13 & m2) | 0x64006400
            j02 = tl.join((t02 & 0xFFFF).to(tl.int16), (t02 >> 16).to(tl.int16)).to(tl.float16, bitcast=True)
            j13 = tl.join((t13 & 0xFFFF).to(tl.int16), (t13 >> 16).to(tl.int16)).to(tl.float16, bitcast=True)
            s = scale[:, None, None]
            z = zero[:, None, None]
            a = (j02 - 1024.0) * s + z
            b = (j13 - 1024.0) * s + z
        x = tl.permute(tl.join(a, b), (0, 1, 3, 2))
    elif COUNT == 1:
        x = ((word >> (8 * LO + SHIFT)) & MASK).to(tl.float32) * scale[:, None] + zero[:, None]
    else:
        a = _piece_bytes(word, scale, zero, SHIFT, MASK, LO, COUNT // 2)
        x = tl.join(a, _piece_bytes(word, scale, zero, SHIFT, MASK, LO + COUNT // 2, COUNT // 2))
    return x  # one return: Triton 3.6 types every return of a function alike, constexpr branches included


@triton.jit
def half_at(quads, q0, live, IDX: tl.constexpr, HALF: tl.constexpr = False):
    """Half ``IDX`` of a field's scale/zero halves (fp32; fp16 with ``HALF``), from the 64-bit words holding four each
    (little-endian): one load per record serves four halves."""
    w = tl.load(quads + q0 + IDX // 4, mask=live, other=0)
    h = ((w >> (16 * (IDX % 4))) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    if not HALF:
        h = h.to(tl.float32)
    return h


@triton.jit
def field_meta(pool_ptr, base, P_BYTES: tl.constexpr, ALIGN: tl.constexpr):
    """``(pointer, index)`` of an integer field's scale/zero halves, which follow its ``P_BYTES`` code bytes: as 64-bit
    words (``QUADS``, four halves each: one load per four) where they start on 8 bytes, else as halves. On sm_90 one
    16-bit load per half was two thirds of the sectors the quantized loop asked of L1 (ncu, H100). A field's halves
    are ``2 D / GROUP``; a last word reaching past them reads the record's next bytes (another field, or the tag and
    score that end it)."""
    if ALIGN >= 8 and P_BYTES % 8 == 0:
        return pool_ptr.to(tl.pointer_type(tl.int64)), (base + P_BYTES) // 8
    else:
        return pool_ptr.to(tl.pointer_type(tl.float16)), (base + P_BYTES) // 2


@triton.jit
def scale_zero(half, meta, live, G: tl.constexpr, g: tl.constexpr, QUADS: tl.constexpr, HALF: tl.constexpr = False):
    """Group ``g``'s scale and zero of each record (``field_meta``'s pointer and index; ``G`` groups a field), fp32,
    or fp16 as stored with ``HALF``; 0 where not ``live``."""
    if QUADS:
        scale = half_at(half, meta, live, g, HALF)
        zero = half_at(half, meta, live, G + g, HALF)
    else:
        scale = tl.load(half + meta + g, mask=live, other=0.0)
        zero = tl.load(half + meta + G + g, mask=live, other=0.0)
        if not HALF:
            scale, zero = scale.to(tl.float32), zero.to(tl.float32)
    return scale, zero


@triton.jit
def _piece_planes(
    word,
    half,
    meta,
    live,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,
    H: tl.constexpr,
    h: tl.constexpr,
    LO: tl.constexpr,
    COUNT: tl.constexpr,
    QUADS: tl.constexpr,
    HALF: tl.constexpr = False,
):
    # planes LO .. LO + COUNT - 1 of the bytes at h * C: piece j = plane * H + h, with its group's scale and zero
    if COUNT == 1:
        scale, zero = scale_zero(half, meta, live, D // GROUP, (LO * H + h) * C // GROUP, QUADS, HALF)
        return _piece_bytes(word, scale, zero, LO * BITS, (1 << BITS) - 1, 0, 4, HALF)
    else:
        a = _piece_planes(word, half, meta, live, BITS, GROUP, D, C, H, h, LO, COUNT // 2, QUADS, HALF)
        b = _piece_planes(word, half, meta, live, BITS, GROUP, D, C, H, h, LO + COUNT // 2, COUNT // 2, QUADS, HALF)
        return tl.join(a, b)


@triton.jit
def _piece_words(
    words,
    w0,
    half,
    meta,
    live,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,
    LO: tl.constexpr,
    COUNT: tl.constexpr,
    QUADS: tl.constexpr,
    HALF: tl.constexpr = False,
):
    # the code bytes h * C .. h * C + C - 1 for h in LO .. LO + COUNT - 1, read once as words
    PER: tl.constexpr = 8 // BITS
    H: tl.constexpr = D // PER // C
    if COUNT == 1:
        word = tl.load(words + w0[:, None] + (LO * C // 4 + tl.arange(0, C // 4))[None, :], mask=live[:, None], other=0)
        return _piece_planes(word, half, meta, live, BITS, GROUP, D, C, H, LO, 0, PER, QUADS, HALF)
    else:
        a = _piece_words(words, w0, half, meta, live, BITS, GROUP, D, C, LO, COUNT // 2, QUADS, HALF)
        b = _piece_words(words, w0, half, meta, live, BITS, GROUP, D, C, LO + COUNT // 2, COUNT // 2, QUADS, HALF)
        return tl.join(a, b)


@triton.jit
def operand_fence(x, ON: tl.constexpr):
    """``x`` itself, through an instruction Triton's layout heuristics cannot look past (``ON``; compiled code only).

    Triton 3.6 picks the width of a product's operand fragments (mma v2 ``kWidth``) from the narrowest load the
    operand derives from, and halves it when any ``tl.join`` lies on the way: the pieces' join tree made it 4 for
    fp16 tiles where the tensor cores take pairs, so every HMMA waited on register moves that rebuilt its operand
    quads (sm_90: 202 ``IMAD.MOV`` an iteration of the quantized loop, 168 registers). A side-effecting identity
    (``mov.b32`` on each pair) ends that backward walk at the tile, which then gets the standard width 2
    (docs/kernels.md). The interpreter runs no inline assembly: there ``ON`` is off and the value the same.
    """
    if ON:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)
    return x


@triton.jit
def load_int_pieces(
    pool_ptr,
    rec,  # [N] int64: byte offset of each record
    live,  # [N] bool: records to read (others give 0)
    OFF: tl.constexpr,  # byte offset of the field inside the record
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,  # piece width (``piece_width``)
    ALIGN: tl.constexpr,  # a power of two (4 or more) dividing every ``rec + OFF``
    HALF: tl.constexpr = False,  # fp16 values (above); 2: their arithmetic as PTX (``half_pair_asm``)
    SPREAD: tl.constexpr = True,  # the columns ordered for bank-conflict-free shared stores (spread_lane_bit)
):
    """``[N, D]`` fp32 values of an integer field (``code * scale + zero``, as ``load_field``), its columns in
    the order ``piece_columns`` gives; fp16 with ``HALF``: each code OR'd into the mantissa of 1024.0 (exact
    for codes below 1024), 1024 subtracted and ``scale`` / ``zero`` applied in fp16 (the stored halves as
    they are), so sm_90 runs a pair of elements per HADD2 / HFMA2 and converts nothing to or from fp32.
    Each piece's codes are read as words and spread by shifts alone, and the pieces and bytes are put side
    by side with ``tl.join`` (a new innermost dimension, held by the same thread), so no reshape moves an
    element between threads. ``load_field``'s rows and groups went to element order through shared memory,
    per element and at 255 registers, on sm_90 (docs/kernels.md). The caller multiplies in this order: the
    queries are read in it, the output columns stored from it."""
    PER: tl.constexpr = 8 // BITS
    H: tl.constexpr = D // PER // C
    base = tl.multiple_of(rec + OFF, ALIGN)
    words = pool_ptr.to(tl.pointer_type(tl.int32))
    w0 = tl.multiple_of(base // 4, ALIGN // 4)
    QUADS: tl.constexpr = ALIGN >= 8 and (D // PER) % 8 == 0
    half, meta = field_meta(pool_ptr, base, D // PER, ALIGN)
    x = _piece_words(words, w0, half, meta, live, BITS, GROUP, D, C, 0, H, QUADS, HALF)
    # [N, word, i, j, tree...]: bytes i + 2 j of each word, the planes' and pieces' joins behind them. j goes last, so
    # the fp16 form's pairs (j = 0, 1: one register) are neighbouring columns, which the tile's trip to shared memory
    # stores as they are (sm_90: no PRMT repacking them); free in registers, and piece_columns follows
    x = tl.reshape(x, [rec.shape[0], C // 4, 2, 2, PER * H])
    x = tl.permute(x, (0, 1, 2, 4, 3))
    LANE: tl.constexpr = spread_lane_bit(D, C, SPREAD)
    if LANE:  # the lanes' column bit to bit 5 and bit 5 to the lanes' place: a relabelling, nothing moves
        x = tl.reshape(x, [rec.shape[0], D // (2 * LANE), 2, LANE // 64, 2, 32])
        x = tl.permute(x, (0, 1, 4, 3, 2, 5))
    return tl.reshape(x, [rec.shape[0], D])
