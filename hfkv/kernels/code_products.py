"""The decode kernel's two products taken from an integer field's codes as they lie in the pool.

``load_int_pieces`` dequantizes a tile in registers and the products then stage it in shared memory for the tensor
cores: per 64 slots of K4V2 storage, 32 KiB of fp16 stored and loaded back for 8 KiB read from the pool, the traffic
that bounded the quantized pass on the H200 (L1 88% busy, DRAM 24%; docs/kernels.md). Here a piece's codes (a run of
``C`` elements inside one byte plane and one group, ``QuantFormat.chunk``: its bytes are contiguous, one shift reads
it, one scale and one zero serve it) are the tile, and all that stands between its load and the tensor core is
elementwise: a unary conversion of each byte to its code (``code_values``), then the slot's scale and zero. Triton
moves the tile to the products' operand layout while it is still bytes (``HoistLayoutConversion``; with the page table
read one block ahead its pipeliner makes that an asynchronous copy to shared memory) and dequantizes it in registers,
in that layout: no fp16 tile is stored and loaded back. Each piece is its own product (its own scale and zero per
slot): the keys' summed into the logits (the queries by piece read once, before the loop: ``key_code_queries``), the
values' side by side in the output's columns (``code_columns``). The values dequantized are the fp16 tiles' (``code *
scale + zero``, one rounding), so the products equal the default path's up to the order of their sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hfkv.kernels.dequant import bit_reverse, f16_pair, field_meta, log2, scale_zero


@triton.constexpr_function
def code_pair_asm(bits: int, shift: int) -> str:
    """PTX for four code bytes (one 32-bit register, ``pack=4``) to their four fp16 codes: bytes 0-1 and 2-3 spread into
    16-bit lanes (``prmt``), each lane's plane kept and ORed into fp16 1024.0 (one ``lop3`` for two lanes:
    ``1024 + code * 2**shift``, exact), then scaled back to the code exactly (a subtraction of 1024, or with a shift a
    fused ``* 2**-shift - 1024 * 2**-shift``). Lane by lane, so whichever elements the compiler packs, each output is
    its input's; one input and no side effect, which is what lets Triton move the bytes to the operand layout first."""
    if bits + shift > 8:
        raise ValueError(f"code_pair_asm: bits={bits} from shift={shift} reach past a byte")
    mask = ((1 << bits) - 1) << shift
    masks = f"{mask | mask << 16:#x}"
    if shift:
        back = f"mov.b32 a, {f16_pair(-shift)}; mov.b32 b, {f16_pair(10 - shift, True)}; "
        back += "fma.rn.f16x2 $0, t0, a, b; fma.rn.f16x2 $1, t1, a, b; "
    else:
        back = "sub.f16x2 $0, t0, c; sub.f16x2 $1, t1, c; "
    return (
        "{ .reg .b32 t0, t1, a, b, c; mov.b32 c, 0x64006400; "
        "prmt.b32 t0, $2, 0, 0x5150; prmt.b32 t1, $2, 0, 0x5352; "
        f"lop3.b32 t0, t0, {masks}, c, 0xea; lop3.b32 t1, t1, {masks}, c, 0xea; " + back + "}"
    )


@triton.jit
def code_values(tile, BITS: tl.constexpr, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """fp16 codes of the plane at bit ``SHIFT`` of each uint8 of ``tile`` (exact). ``ASM``: as PTX (compiled code for
    NVIDIA GPUs); else the same arithmetic in Triton (the interpreter; unary and elementwise too)."""
    if ASM:
        x = tl.inline_asm_elementwise(
            code_pair_asm(BITS, SHIFT), "=r,=r,r", [tile], dtype=tl.float16, is_pure=True, pack=4
        )
    else:
        MASK: tl.constexpr = ((1 << BITS) - 1) << SHIFT
        x = ((tile.to(tl.int16) & MASK) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        if SHIFT:
            x = x * (1.0 / (1 << SHIFT))
    return x


@triton.jit
def _dequantized(tile, half, meta, live, BITS, G, g, SHIFT, QUADS, ASM):
    # [N, C] fp16 code * scale + zero of the plane at SHIFT of tile, group g's scale and zero per slot (one rounding)
    scale, zero = scale_zero(half, meta, live, G, g, QUADS, True)
    return code_values(tile, BITS, SHIFT, ASM) * scale[:, None] + zero[:, None]


@triton.jit
def key_code_queries(q_ptr, q_rows, row_ok, scaling, BITS: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    """The queries of ``code_products`` (keys), read once before the loop: ``[R, C, D // C]`` fp16, scaled, the pieces
    in ``code_columns``' tree order."""
    cols = code_columns(BITS, D, C)
    q = tl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
    return tl.reshape((q.to(tl.float32) * scaling).to(tl.float16), [q_rows.shape[0], C, D // C])


@triton.jit
def _halves(x):
    # x [R, C, M] split on its last dimension's lowest bit: the join tree's top split (code_columns)
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 2, 2]))


@triton.jit
def _planes(
    x,
    tile,
    half,
    meta,
    live,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    H: tl.constexpr,
    h: tl.constexpr,
    LO: tl.constexpr,
    COUNT: tl.constexpr,
    QUADS: tl.constexpr,
    ASM: tl.constexpr,
    KEYS: tl.constexpr,
):
    # Planes LO .. LO + COUNT - 1 of byte chunk h. KEYS: x [R, C, COUNT] the queries in the tree's order, the pieces'
    # logits summed (Triton chains the sums into the tensor cores' accumulator); else x [R, N] fp16 probabilities,
    # the pieces' products joined.
    if COUNT == 1:
        v = _dequantized(tile, half, meta, live, BITS, G, (LO * H + h) * C // GROUP, LO * BITS, QUADS, ASM)
        if KEYS:
            o = tl.dot(tl.reshape(x, [x.shape[0], C]), tl.trans(v))
        else:
            o = tl.dot(x, v)
    elif KEYS:
        xa, xb = _halves(x)
        o = _planes(xa, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO, COUNT // 2, QUADS, ASM, KEYS)
        o += _planes(xb, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO + COUNT // 2, COUNT // 2, QUADS, ASM, KEYS)
    else:
        o = tl.join(
            _planes(x, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO, COUNT // 2, QUADS, ASM, KEYS),
            _planes(x, tile, half, meta, live, BITS, GROUP, G, C, H, h, LO + COUNT // 2, COUNT // 2, QUADS, ASM, KEYS),
        )
    return o


@triton.jit
def _chunks(
    x,
    pool_ptr,
    base,
    half,
    meta,
    live,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    H: tl.constexpr,
    LO: tl.constexpr,
    COUNT: tl.constexpr,
    QUADS: tl.constexpr,
    ASM: tl.constexpr,
    ALIGN: tl.constexpr,
    KEYS: tl.constexpr,
):
    # Byte chunks LO .. LO + COUNT - 1, each read once for all its planes (x and the result as _planes').
    if COUNT == 1:
        # The hint on the rows' pointers, a new op: put on `rec` itself (the key field's offset is 0), a layout's copy
        # of it lost it and the tile was read a byte per thread, too narrow for an asynchronous copy.
        row = tl.multiple_of(pool_ptr + base, ALIGN)
        tile = tl.load(row[:, None] + (LO * C + tl.arange(0, C))[None, :], mask=live[:, None], other=0)
        o = _planes(x, tile, half, meta, live, BITS, GROUP, G, C, H, LO, 0, 8 // BITS, QUADS, ASM, KEYS)
    elif KEYS:
        xa, xb = _halves(x)
        o = _chunks(xa, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO, COUNT // 2, QUADS, ASM, ALIGN,
                    KEYS)  # fmt: skip
        o += _chunks(xb, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO + COUNT // 2, COUNT // 2, QUADS,
                     ASM, ALIGN, KEYS)  # fmt: skip
    else:
        o = tl.join(
            _chunks(x, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO, COUNT // 2, QUADS, ASM, ALIGN,
                    KEYS),
            _chunks(x, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, LO + COUNT // 2, COUNT // 2, QUADS,
                    ASM, ALIGN, KEYS),
        )  # fmt: skip
    return o


@triton.jit
def code_products(
    x,  # keys: [R, C, D // C] fp16 scaled queries (key_code_queries); values: [R, N] fp16 probabilities
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
    half, meta = field_meta(pool_ptr, base, P_BYTES, ALIGN)
    o = _chunks(x, pool_ptr, base, half, meta, live, BITS, GROUP, G, C, H, 0, H, QUADS, ASM, ALIGN, KEYS)
    if not KEYS:
        o = tl.reshape(o, [x.shape[0], D])
    return o


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
    pl = bit_reverse(t // H, PB)
    h = bit_reverse(t % H, HB)
    return (pl * H + h) * C + f // NP
