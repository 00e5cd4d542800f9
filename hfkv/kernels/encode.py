"""Quantizing new tokens and writing their records straight into the byte pool, in one launch.

Appending a token on the torch path costs a chain of small ops (group min/max, fp16 rounding of
scale and zero, codes, packing, ``cat`` of the fields) and then a scatter of the finished records
into their slots; each op is a launch and a round trip of the token through memory. Here one
program owns one token: it reads the key and value rows once, encodes both fields in registers
and stores the record's bytes at its slot. Formats are compile-time constants, so each (key
format, value format, model dtype, head dim, group size) compiles to code for just those formats.

The bytes must be exactly what ``RecordLayout.encode`` writes, since the torch path reads (and
the tests compare) the same pool. That rules out every shortcut whose rounding differs between
the GPU and torch: fp32 divisions use ``div_rn`` (Triton's ``/`` is approximate on CUDA), round-
half-to-even is built from ``floor``, and e4m3 and bf16 bits are rounded with integer ops on the
fp32 bits (the interpreter's fp32 -> fp8 cast rounds small values differently from torch, and its
bf16 arithmetic is wrong, so everything is upcast to fp32 right after its load). Bytes are stored
one by one: a field of one format may start at any byte of the record (a value field after an
odd-sized key field), and byte stores need no alignment to be exact.

``encode_write_reference`` is the torch twin: ``layout.encode`` and a scatter into the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfkv.kernels.dequant import format_constants
from hfkv.kernels.grid import cdiv
from hfkv.quant.formats import QuantFormat
from hfkv.quant.record import RecordLayout

# Model dtypes of the full-precision family (tl.constexpr values; the families are dequant's).
F32, F16, BF16 = 0, 1, 2
_MODEL_CODES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Launch shape of encode_write, as eval/encode_bench.py measured it on an H200 (524,288 tokens of 8 KV heads x 128,
# docs/kernels.md): one warp per program (a row's reductions stay inside the warp), 1.8-2.1x faster than four in
# every format; four tokens per program for full-precision records (0.31 ms against 0.41 at one), one for integer
# ones (0.71 ms against 0.78 at four: their unrolled rows outgrow the instruction cache).
ENCODE_ROWS_MODEL = 4
ENCODE_ROWS = 1
ENCODE_WARPS = 1


# --------------------------------------------------------------------------------------------- helpers
@triton.jit
def _round_half_even(t):
    """``torch.round`` of fp32 values: exact for |t| < 2^22, and larger values are clamped by callers anyway."""
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - t) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _store_le(pool_ptr, addr, bits, mask, NB: tl.constexpr):
    """Store the low ``NB`` bytes of each int32 in ``bits`` little end first at byte offsets ``addr``."""
    e = tl.arange(0, NB)
    byte = ((bits[:, None] >> (8 * e)[None, :]) & 0xFF).to(tl.uint8)
    tl.store(pool_ptr + addr[:, None] + e[None, :], byte, mask=mask[:, None])


@triton.jit
def _fp16_bits(x):
    return x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits, round to nearest even on the integer bits (NaN -> 0x7FC0 like torch's CPU cast)."""
    u = x.to(tl.int32, bitcast=True)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, r)


@triton.jit
def _e4m3_bits(y):
    """fp32 ``y`` (|y| <= 448 after clamping) -> e4m3fn byte, rounding as torch's ``.to(float8_e4m3fn)``.

    Below 2^-6 the codes are subnormal steps of 2^-9: ``|y| * 512`` is exact there, so rounding it
    half to even gives the code. Above, the exponent is rebiased from 127 to 7 and the 23-bit
    mantissa rounded to 3 bits half to even, all on the integer bits (torch's own algorithm).
    """
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    sub = _round_half_even(a.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    # -1006632960 == (7 - 127) << 23: the exponent rebias.
    nrm = (a + (-1006632960 + 0x7FFFF) + ((a >> 20) & 1)) >> 20
    code = tl.where(a < (121 << 23), sub, nrm)
    code = tl.where(a >= 0x43F00000, 0x7F, code)  # >= 480 (excluded by the clamp) or NaN: e4m3fn's NaN
    return code | sign


# --------------------------------------------------------------------------------------------- fields
@triton.jit
def _encode_model(
    pool_ptr, base, src, stride, BITS: tl.constexpr, MODEL_DT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Full precision: the row cast to the model dtype (fp32 -> fp16/bf16 rounds to nearest even)."""
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(src + d * stride, mask=m, other=0.0).to(tl.float32)  # exact for fp32/fp16/bf16 inputs
    ESIZE: tl.constexpr = BITS // 8
    if MODEL_DT == 0:
        bits = x.to(tl.int32, bitcast=True)
    elif MODEL_DT == 1:
        bits = _fp16_bits(x.to(tl.float16))
    else:
        bits = _bf16_bits(x)
    _store_le(pool_ptr, base + d * ESIZE, bits, m, ESIZE)


@triton.jit
def _encode_int(
    pool_ptr,
    base,
    src,
    stride,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    """Group-wise asymmetric codes packed in planes, then fp16 scales and zeros (``QuantFormat._encode_int``).

    Statistics are taken with the row laid out as ``[groups, group]``; codes are computed with it
    laid out as ``[planes, bytes]`` so that packing is a sum over planes. The row is simply read
    twice (it is tiny and cached), and each element finds its group's scale and zero by a one-hot
    select over the few groups (no cross-lane gather needed).
    """
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    P: tl.constexpr = D // PER  # bytes of codes; byte j holds elements j, j + P, ..
    G: tl.constexpr = D // GROUP
    BLOCK_P: tl.constexpr = BLOCK_D // PER

    gi = tl.arange(0, BLOCK_G)
    ci = tl.arange(0, BLOCK_GS)
    gm = (gi < G)[:, None] & (ci < GROUP)[None, :]
    xg = tl.load(src + (gi[:, None] * GROUP + ci[None, :]) * stride, mask=gm, other=0.0).to(tl.float32)
    mn = tl.min(tl.where(gm, xg, float("inf")), 1)
    mx = tl.max(tl.where(gm, xg, float("-inf")), 1)
    mn = tl.where(gi < G, mn, 0.0)  # padding groups: finite, so no inf - inf below
    mx = tl.where(gi < G, mx, 0.0)
    zero16 = mn.to(tl.float16)
    zero = zero16.to(tl.float32)
    scale = tl.where(mx > mn, tl.math.div_rn(mx - zero, QMAX * 1.0), 0.0)
    s16 = scale.to(tl.float16)
    sb = _fp16_bits(s16)
    # Round the stored scale up (nextafter toward +inf) when fp16 made it smaller. In sign-magnitude
    # bits that is +1 for a positive scale and -1 for a negative one (zero16 rounded above a group's
    # max, possible when the group is narrower than an fp16 step).
    sb = tl.where(s16.to(tl.float32) < scale, tl.where(sb >= 0x8000, sb - 1, sb + 1), sb)
    s = sb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    p = tl.arange(0, PER)
    j = tl.arange(0, BLOCK_P)
    e = p[:, None] * P + j[None, :]
    em = (j < P)[None, :] & (p < PER)[:, None]
    x = tl.load(src + e * stride, mask=em, other=0.0).to(tl.float32)
    own = (e // GROUP)[:, :, None] == gi[None, None, :]
    s_e = tl.sum(tl.where(own, s[None, None, :], 0.0), 2)
    z_e = tl.sum(tl.where(own, zero[None, None, :], 0.0), 2)
    pos = s_e > 0
    t = tl.math.div_rn(x - z_e, tl.where(pos, s_e, 1.0))
    code = tl.where(pos, _round_half_even(t), 0.0)
    code = tl.minimum(tl.maximum(code, 0.0), QMAX * 1.0).to(tl.int32)
    packed = tl.sum(code << (p * BITS)[:, None], 0)  # planes occupy disjoint bits: the sum is an OR
    _store_le(pool_ptr, base + j, packed, j < P, 1)

    meta = base + P + 2 * gi
    _store_le(pool_ptr, meta, sb, gi < G, 2)
    _store_le(pool_ptr, meta + 2 * G, _fp16_bits(zero16), gi < G, 2)


@triton.jit
def _encode_fp8(pool_ptr, base, src, stride, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """e4m3 codes of ``x / scale`` and the fp32 scale ``amax / 448`` (1 for an all-zero row)."""
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(src + d * stride, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    _store_le(pool_ptr, base + d, _e4m3_bits(y), m, 1)
    e = tl.arange(0, 4)
    sbits = scale.to(tl.int32, bitcast=True)
    tl.store(pool_ptr + base + D + e, ((sbits >> (8 * e)) & 0xFF).to(tl.uint8))


@triton.jit
def _encode_field(
    pool_ptr,
    base,
    src,
    stride,
    FAM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    MODEL_DT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
):
    if FAM == 0:
        _encode_model(pool_ptr, base, src, stride, BITS, MODEL_DT, D, BLOCK_D)
    elif FAM == 1:
        _encode_int(pool_ptr, base, src, stride, BITS, GROUP, D, BLOCK_D, BLOCK_G, BLOCK_GS)
    else:
        _encode_fp8(pool_ptr, base, src, stride, D, BLOCK_D)


@triton.jit(do_not_specialize=["n"])
def _encode_write_kernel(
    pool_ptr,
    dest_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    score_ptr,
    k_s0,
    k_s1,
    v_s0,
    v_s1,
    pos_s,
    score_s,
    page_bytes,
    tpp,
    n,
    K_FAM: tl.constexpr,
    K_BITS: tl.constexpr,
    K_GROUP: tl.constexpr,
    K_MODEL: tl.constexpr,
    K_D: tl.constexpr,
    K_BLOCK_D: tl.constexpr,
    K_BLOCK_G: tl.constexpr,
    K_BLOCK_GS: tl.constexpr,
    V_FAM: tl.constexpr,
    V_BITS: tl.constexpr,
    V_GROUP: tl.constexpr,
    V_MODEL: tl.constexpr,
    V_D: tl.constexpr,
    V_BLOCK_D: tl.constexpr,
    V_BLOCK_G: tl.constexpr,
    V_BLOCK_GS: tl.constexpr,
    V_OFF: tl.constexpr,
    KV_BYTES: tl.constexpr,
    STRIDE: tl.constexpr,
    ROWS: tl.constexpr,
):
    for r in tl.static_range(ROWS):
        i = tl.program_id(0).to(tl.int64) * ROWS + r
        if i < n:
            _encode_row(
                pool_ptr, dest_ptr, k_ptr, v_ptr, pos_ptr, score_ptr, i, k_s0, k_s1, v_s0, v_s1, pos_s, score_s,
                page_bytes, tpp, K_FAM, K_BITS, K_GROUP, K_MODEL, K_D, K_BLOCK_D, K_BLOCK_G, K_BLOCK_GS, V_FAM,
                V_BITS, V_GROUP, V_MODEL, V_D, V_BLOCK_D, V_BLOCK_G, V_BLOCK_GS, V_OFF, KV_BYTES, STRIDE,
            )  # fmt: skip


@triton.jit
def _encode_row(
    pool_ptr, dest_ptr, k_ptr, v_ptr, pos_ptr, score_ptr, i, k_s0, k_s1, v_s0, v_s1, pos_s, score_s, page_bytes, tpp,
    K_FAM: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_MODEL: tl.constexpr, K_D: tl.constexpr,
    K_BLOCK_D: tl.constexpr, K_BLOCK_G: tl.constexpr, K_BLOCK_GS: tl.constexpr,
    V_FAM: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_MODEL: tl.constexpr, V_D: tl.constexpr,
    V_BLOCK_D: tl.constexpr, V_BLOCK_G: tl.constexpr, V_BLOCK_GS: tl.constexpr,
    V_OFF: tl.constexpr, KV_BYTES: tl.constexpr, STRIDE: tl.constexpr,
):  # fmt: skip
    base = tl.load(dest_ptr + i)
    page_at = base - base % page_bytes
    slot = (base - page_at) // STRIDE
    _encode_field(
        pool_ptr, base, k_ptr + i * k_s0, k_s1, K_FAM, K_BITS, K_GROUP, K_MODEL, K_D, K_BLOCK_D, K_BLOCK_G, K_BLOCK_GS
    )
    _encode_field(
        pool_ptr,
        base + V_OFF,
        v_ptr + i * v_s0,
        v_s1,
        V_FAM,
        V_BITS,
        V_GROUP,
        V_MODEL,
        V_D,
        V_BLOCK_D,
        V_BLOCK_G,
        V_BLOCK_GS,
    )
    if STRIDE > KV_BYTES:  # zero pad up to the next 4-aligned body
        e = tl.arange(0, 4)
        tl.store(pool_ptr + base + KV_BYTES + e, tl.zeros([4], tl.uint8), mask=e < STRIDE - KV_BYTES)
    # tag and score in the page's tag and score regions (RecordLayout)
    words = pool_ptr.to(tl.pointer_type(tl.int32))
    tag = tl.load(pos_ptr + i * pos_s).to(tl.int32) + 1
    score = tl.load(score_ptr + i * score_s).to(tl.float32)
    tl.store(words + (page_at + tpp * STRIDE) // 4 + slot, tag)
    tl.store(words + (page_at + tpp * (STRIDE + 4)) // 4 + slot, score.to(tl.int32, bitcast=True))


# --------------------------------------------------------------------------------------------- host side
def _field_constants(prefix: str, fmt: QuantFormat) -> dict:
    """Constexpr arguments of one field: family, bits, group size, model dtype, sizes and their pow-2 blocks."""
    c = format_constants(fmt)  # the same family / bits / group the decode kernel reads
    fam, bits, group = c["fam"], c["bits"], c["group"]
    d = fmt.head_dim
    return {
        f"{prefix}_FAM": fam,
        f"{prefix}_BITS": bits,
        f"{prefix}_GROUP": group,
        f"{prefix}_MODEL": _MODEL_CODES.get(fmt.model_dtype, F32),
        f"{prefix}_D": d,
        f"{prefix}_BLOCK_D": triton.next_power_of_2(d),
        f"{prefix}_BLOCK_G": triton.next_power_of_2(d // group),
        f"{prefix}_BLOCK_GS": triton.next_power_of_2(group),
    }


def check_pool(pool: torch.Tensor, where: str) -> None:
    """The byte pool the kernels write through byte and 4-byte-word pointers."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
        raise ValueError(
            f"{where}: pool must be a contiguous uint8 [pages, page_bytes] tensor, got {pool.dtype} "
            f"shape {tuple(pool.shape)} (contiguous={pool.is_contiguous()})"
        )
    if pool.shape[1] % 4 or pool.data_ptr() % 4:
        raise ValueError(f"{where}: pool rows must be whole 4-byte words (page_bytes={pool.shape[1]})")


def check_offsets(x: torch.Tensor, name: str, n: int | None, device: torch.device, where: str) -> None:
    if x.dtype != torch.int64 or x.dim() != 1 or (n is not None and x.shape[0] != n):
        want = f"[{n}]" if n is not None else "[N]"
        raise ValueError(f"{where}: {name} must be int64 {want} byte offsets, got {x.dtype} shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{where}: {name} is on {x.device} but pool is on {device}")


def _check_encode_args(
    pool: torch.Tensor,
    dest: torch.Tensor,
    layout: RecordLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
    where: str,
) -> None:
    check_pool(pool, where)
    if dest.dim() != 1:
        raise ValueError(f"{where}: dest must be int64 [N] byte offsets, got shape {tuple(dest.shape)}")
    n = dest.shape[0]
    check_offsets(dest, "dest", n, pool.device, where)
    for name, x, fmt in (("k", k, layout.key), ("v", v, layout.value)):
        if x.dim() != 2 or tuple(x.shape) != (n, fmt.head_dim):
            raise ValueError(f"{where}: {name} must have shape [{n}, {fmt.head_dim}], got {tuple(x.shape)}")
        if x.dtype not in _INPUT_DTYPES:
            raise ValueError(f"{where}: {name} has dtype {x.dtype}; allowed: {list(_INPUT_DTYPES)}")
    if pos.dim() != 1 or pos.shape[0] != n or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"{where}: pos must be an integer [{n}] tensor, got {pos.dtype} shape {tuple(pos.shape)}")
    if score.dim() != 1 or score.shape[0] != n or not score.dtype.is_floating_point:
        raise ValueError(f"{where}: score must be a float [{n}] tensor, got {score.dtype} shape {tuple(score.shape)}")
    for name, x in (("k", k), ("v", v), ("pos", pos), ("score", score)):
        if x.device != pool.device:
            raise ValueError(f"{where}: {name} is on {x.device} but pool is on {pool.device}")


def encode_write(
    pool: torch.Tensor,
    dest: torch.Tensor,
    layout: RecordLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
    rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Encode tokens ``k, v [N, D]`` (positions ``pos``, score sums ``score``) as ``layout`` records and
    write record ``i`` into the slot whose body starts at byte ``dest[i]`` of ``pool`` (its tag and score
    into the page's regions); bit-exact with :func:`encode_write_reference`.

    ``dest`` offsets must be slot starts, ``page * page_bytes + slot * layout.stride`` with ``slot <
    layout.records_per_page(page_bytes)`` (not checked, as that would cost a host sync), and distinct.
    No finiteness check: callers that want one read ``layout.encodable_ends`` first. ``rows`` tokens per
    program and ``num_warps`` set the launch shape (a prompt's ~500k tokens a layer at 8k x 8 were as many
    programs of 128 threads each, ~3 ms of an H200's time; defaults: ``ENCODE_ROWS_MODEL`` for full-precision
    records, else ``ENCODE_ROWS``, and ``ENCODE_WARPS``).
    """
    _check_encode_args(pool, dest, layout, k, v, pos, score, "encode_write")
    n = dest.shape[0]
    if n == 0:
        return
    if rows is None:
        rows = ENCODE_ROWS_MODEL if layout.key.name == layout.value.name == "model" else ENCODE_ROWS
    if rows < 1:
        raise ValueError(f"encode_write: rows={rows} tokens per program must be >= 1")
    _encode_write_kernel[(cdiv(n, rows),)](
        pool,
        dest,
        k,
        v,
        pos,
        score,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        pos.stride(0),
        score.stride(0),
        pool.shape[1],
        layout.records_per_page(pool.shape[1]),
        n,
        **_field_constants("K", layout.key),
        **_field_constants("V", layout.value),
        V_OFF=layout.key.nbytes,
        KV_BYTES=layout.kv_bytes,
        STRIDE=layout.stride,
        ROWS=rows,
        num_warps=ENCODE_WARPS if num_warps is None else num_warps,
    )


def encode_write_reference(
    pool: torch.Tensor,
    dest: torch.Tensor,
    layout: RecordLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
) -> None:
    """Torch twin of :func:`encode_write`: ``layout.encode`` and a scatter of the records into the pool."""
    _check_encode_args(pool, dest, layout, k, v, pos, score, "encode_write_reference")
    if dest.shape[0] == 0:
        return
    pool.view(-1)[layout.record_index(dest, pool.shape[1])] = layout.encode(k, v, pos, score, check_finite=False)
