"""The decode kernel's two products taken from an integer field's codes as they lie in the pool.

``load_int_pieces`` dequantizes a tile in registers and the products then stage it in shared memory for the tensor
cores: per 64 slots of K4V2 storage, 32 KiB of fp16 stored and loaded back for 8 KiB read from the pool, the traffic
that bounded the quantized pass on the H200 (L1 88% busy, DRAM 24%; docs/kernels.md). Here a piece's codes (a run of
``C`` elements inside one byte plane and one group, ``QuantFormat.chunk``: its bytes are contiguous, one shift reads
it, one scale and one zero serve it) are the tile, and all that stands between its load and the tensor core is
elementwise: a unary conversion of each byte (``code_values``) and, for values, the slot's scale and zero. Triton then
moves the tile to the products' operand layout while it is still bytes (``HoistLayoutConversion``; with the page
table read one block ahead, its pipeliner makes that an asynchronous copy to shared memory) and converts it in
registers: no fp16 tile is stored and loaded back. The scale and zero go where they are cheap:

- keys: ``q . (s c + z) = s (q . c) + z sum(q)`` per piece, as the CPU kernel's ``ChunkCodes`` contract: one product
  of the piece's queries with its codes, the slot's scale and zero applied to the [rows, slots] logits (the queries by
  piece and their sums read once, before the loop: ``key_code_queries``);
- values: each piece's codes dequantized in the operand layout (``code * scale + zero`` in fp16, one rounding, as the
  fp16 tiles' ``HALF`` form), one product per piece. (Scaling the probabilities instead, per piece, sent a copy of
  them through shared memory per piece: more traffic, sm_90 code, Triton 3.6.)

The codes enter as ``code * 2**shift`` (a plane read where it lies, exact in fp16 below 1024); the ``2**-shift`` is
folded into the scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hfkv.kernels.dequant import half_at


def code_pair_asm(bits: int, shift: int) -> str:
    """PTX for four code bytes (one 32-bit register, ``pack=4``) to four fp16 ``code * 2**shift``: bytes 0-1 and
    2-3 spread into 16-bit lanes (``prmt``), each lane's plane kept and ORed into fp16 1024.0 (one ``lop3`` for two
    lanes), 1024 subtracted (exact). Lane by lane, so whichever elements the compiler packs, each output is its
    input's; one input and no side effect, which is what lets Triton convert the bytes to the operand layout before
    this runs."""
    if bits + shift > 8:
        raise ValueError(f"code_pair_asm: bits={bits} from shift={shift} reach past a byte")
    mask = ((1 << bits) - 1) << shift
    masks = f"{mask | mask << 16:#x}"
    return (
        "{ .reg .b32 t0, t1, c; mov.b32 c, 0x64006400; "
        "prmt.b32 t0, $2, 0, 0x5150; prmt.b32 t1, $2, 0, 0x5352; "
        f"lop3.b32 t0, t0, {masks}, c, 0xea; lop3.b32 t1, t1, {masks}, c, 0xea; "
        "sub.f16x2 $0, t0, c; sub.f16x2 $1, t1, c; }"
    )


# Every (bits, plane shift) a format reads: int2 planes at bits 0, 2, 4, 6 of a byte, int4 at 0, 4, int8 at 0.
_CODE_2_0 = tl.constexpr(code_pair_asm(2, 0))
_CODE_2_2 = tl.constexpr(code_pair_asm(2, 2))
_CODE_2_4 = tl.constexpr(code_pair_asm(2, 4))
_CODE_2_6 = tl.constexpr(code_pair_asm(2, 6))
_CODE_4_0 = tl.constexpr(code_pair_asm(4, 0))
_CODE_4_4 = tl.constexpr(code_pair_asm(4, 4))
_CODE_8_0 = tl.constexpr(code_pair_asm(8, 0))


@triton.jit
def code_values(tile, BITS: tl.constexpr, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """fp16 ``code * 2**SHIFT`` of the plane at bit ``SHIFT`` of each uint8 of ``tile`` (exact). ``ASM``: as PTX
    (compiled code for NVIDIA GPUs); else the same arithmetic in Triton (the interpreter; unary and elementwise too)."""
    if ASM:
        if BITS == 8:
            A: tl.constexpr = _CODE_8_0
        elif BITS == 4:
            if SHIFT == 0:
                A: tl.constexpr = _CODE_4_0
            else:
                A: tl.constexpr = _CODE_4_4
        elif SHIFT == 0:
            A: tl.constexpr = _CODE_2_0
        elif SHIFT == 2:
            A: tl.constexpr = _CODE_2_2
        elif SHIFT == 4:
            A: tl.constexpr = _CODE_2_4
        else:
            A: tl.constexpr = _CODE_2_6
        x = tl.inline_asm_elementwise(A, "=r,=r,r", [tile], dtype=tl.float16, is_pure=True, pack=4)
    else:
        MASK: tl.constexpr = ((1 << BITS) - 1) << SHIFT
        x = ((tile.to(tl.int16) & MASK) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return x


@triton.jit
def _field_meta(pool_ptr, base, P_BYTES: tl.constexpr, ALIGN: tl.constexpr):
    # the field's scale/zero halves start P_BYTES in: as 64-bit words (four halves each) where they start on 8 bytes
    QUADS: tl.constexpr = ALIGN >= 8 and P_BYTES % 8 == 0
    if QUADS:
        half = pool_ptr.to(tl.pointer_type(tl.int64))
        meta = (base + P_BYTES) // 8
    else:
        half = pool_ptr.to(tl.pointer_type(tl.float16))
        meta = (base + P_BYTES) // 2
    return half, meta


@triton.jit
def _scale_zero(half, meta, live, G: tl.constexpr, g: tl.constexpr, QUADS: tl.constexpr):
    # group g's fp32 scale and zero of each slot (0 where not live)
    if QUADS:
        scale = half_at(half, meta, live, g)
        zero = half_at(half, meta, live, G + g)
    else:
        scale = tl.load(half + meta + g, mask=live, other=0.0).to(tl.float32)
        zero = tl.load(half + meta + G + g, mask=live, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def key_code_queries(q_ptr, q_rows, row_ok, scaling, BITS: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    """The queries of ``code_products`` (KEYS), read once before the loop: ``([R, C, D // C] fp16 scaled queries,
    [R, D // C] fp32 their sums)``, pieces in ``code_columns``' tree order."""
    NP: tl.constexpr = D // C
    cols = code_columns(BITS, D, C)
    q = tl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
    q = tl.reshape((q.to(tl.float32) * scaling).to(tl.float16), [q_rows.shape[0], C, NP])
    return q, tl.sum(q.to(tl.float32), 1)


@triton.jit
def _halves(x, y):
    # x [R, C, M] and y [R, M] split on their last dimension's lowest bit: the join tree's top split (code_columns)
    M: tl.constexpr = x.shape[2]
    xa, xb = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], M // 2, 2]))
    ya, yb = tl.split(tl.reshape(y, [y.shape[0], M // 2, 2]))
    return xa, xb, ya, yb


@triton.jit
def _planes(
    x, xs, tile, half, meta, live, BITS: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
    H: tl.constexpr, h: tl.constexpr, LO: tl.constexpr, COUNT: tl.constexpr, QUADS: tl.constexpr, ASM: tl.constexpr,
    KEYS: tl.constexpr,
):
    # Planes LO .. LO + COUNT - 1 of byte chunk h. KEYS: x [R, C, COUNT] queries, xs [R, COUNT] their sums, in the
    # tree's order; the pieces' logits summed. Else x [R, N] fp16 probabilities; the pieces' products joined.
    if COUNT == 1:
        scale, zero = _scale_zero(half, meta, live, G, (LO * H + h) * C // GROUP, QUADS)
        scale = scale * (1.0 / (1 << (LO * BITS)))  # the codes come as code * 2**shift
        codes = code_values(tile, BITS, LO * BITS, ASM)
        if KEYS:
            prod = tl.dot(tl.reshape(x, [x.shape[0], C]), tl.trans(codes))
            o = prod * scale[None, :] + tl.reshape(xs, [x.shape[0]])[:, None] * zero[None, :]
        else:
            o = tl.dot(x, codes * scale.to(tl.float16)[:, None] + zero.to(tl.float16)[:, None])
    elif KEYS:
        xa, xb, sa, sb = _halves(x, xs)
        o = _planes(xa, sa, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO, COUNT // 2, QUADS, ASM, KEYS)
        o += _planes(xb, sb, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO + COUNT // 2, COUNT // 2, QUADS, ASM,
                     KEYS)  # fmt: skip
    else:
        o = tl.join(
            _planes(x, xs, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO, COUNT // 2, QUADS, ASM, KEYS),
            _planes(x, xs, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO + COUNT // 2, COUNT // 2, QUADS, ASM,
                    KEYS),
        )  # fmt: skip
    return o


@triton.jit
def _chunks(
    x, xs, pool_ptr, base, half, meta, live, BITS: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr,
    C: tl.constexpr, H: tl.constexpr, LO: tl.constexpr, COUNT: tl.constexpr, QUADS: tl.constexpr, ASM: tl.constexpr,
    ALIGN: tl.constexpr, KEYS: tl.constexpr,
):
    # Byte chunks LO .. LO + COUNT - 1, each read once for all its planes (x, xs and the result as _planes').
    if COUNT == 1:
        # The hint on the rows' pointers, a new op: put on `rec` itself (the key field's offset is 0), a layout's copy
        # of it lost it and the tile was read a byte per thread, too narrow for an asynchronous copy.
        row = tl.multiple_of(pool_ptr + base, ALIGN)
        tile = tl.load(row[:, None] + (LO * C + tl.arange(0, C))[None, :], mask=live[:, None], other=0)
        o = _planes(x, xs, tile, half, meta, live, BITS, GROUP, G, C, H, LO, 0, 8 // BITS, QUADS, ASM, KEYS)
    elif KEYS:
        xa, xb, sa, sb = _halves(x, xs)
        o = _chunks(xa, sa, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO, COUNT // 2, QUADS, ASM, ALIGN,
                    KEYS)  # fmt: skip
        o += _chunks(xb, sb, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO + COUNT // 2, COUNT // 2,
                     QUADS, ASM, ALIGN, KEYS)  # fmt: skip
    else:
        o = tl.join(
            _chunks(x, xs, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO, COUNT // 2, QUADS, ASM, ALIGN,
                    KEYS),
            _chunks(x, xs, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO + COUNT // 2, COUNT // 2, QUADS,
                    ASM, ALIGN, KEYS),
        )  # fmt: skip
    return o


@triton.jit
def code_products(
    x,  # keys: [R, C, D // C] fp16 scaled queries (key_code_queries); values: [R, N] fp16 probabilities
    xs,  # keys: [R, D // C] fp32 the queries' sums; values: unused
    pool_ptr,
    rec,  # [N] int64: byte offset of each record
    live,  # [N] bool: records to read (others give 0)
    OFF: tl.constexpr,  # byte offset of the field inside the record
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,  # piece width (``piece_width``)
    ALIGN: tl.constexpr,  # a power of two dividing every ``rec + OFF``
    ASM: tl.constexpr,
    KEYS: tl.constexpr,
):
    """``KEYS``: ``[R, N]`` fp32 logits ``q . k`` of each row and slot; else ``[R, D]`` fp32 ``p . v`` of each row,
    its columns in ``code_columns``' order. One product per piece (module doc)."""
    PER: tl.constexpr = 8 // BITS
    P_BYTES: tl.constexpr = D // PER  # code bytes; piece j: plane j // H of bytes (j % H) * C ..
    H: tl.constexpr = P_BYTES // C
    G: tl.constexpr = D // GROUP
    QUADS: tl.constexpr = ALIGN >= 8 and P_BYTES % 8 == 0
    base = tl.multiple_of(rec + OFF, ALIGN)
    half, meta = _field_meta(pool_ptr, base, P_BYTES, ALIGN)
    o = _chunks(x, xs, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, 0, H, QUADS, ASM, ALIGN, KEYS)
    if not KEYS:
        o = tl.reshape(o, [x.shape[0], D])
    return o


@triton.constexpr_function
def log2(n: int) -> int:
    return int(n).bit_length() - 1


@triton.jit
def _bit_reverse(x, BITS: tl.constexpr):
    y = x * 0
    for b in tl.static_range(BITS):
        y = y * 2 + ((x >> b) & 1)
    return y


@triton.jit
def code_columns(BITS: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    """``[D]``: the element each column of ``code_products``' values product holds. Column ``c * NP + t`` is element
    ``c`` of the piece at join-tree position ``t``: the planes' joins (inner) and the chunks' (outer) each put their
    first split last, so ``t`` is the plane's bits reversed, then the chunk's."""
    PER: tl.constexpr = 8 // BITS
    H: tl.constexpr = D // PER // C
    NP: tl.constexpr = D // C
    PB: tl.constexpr = log2(PER)
    HB: tl.constexpr = log2(H)
    f = tl.arange(0, D)
    t = f % NP
    pl = _bit_reverse(t // H, PB)
    h = _bit_reverse(t % H, HB)
    return (pl * H + h) * C + f // NP
