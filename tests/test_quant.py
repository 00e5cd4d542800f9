"""Tier byte formats (DESIGN §3 "Tier formats") and the per-token record layout (§5).

Error bounds are computed here from first principles (group min/max, e4m3 precision), not taken
from ``QuantFormat.max_abs_error``, so a wrong bound in the library cannot hide a wrong codec.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hfkv.quant.formats import QuantFormat
from hfkv.quant.record import RecordLayout

HEAD_DIMS = (8, 16, 32, 64, 128)
INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
FP16_MAX = 65504.0
# fp16 rounding of the stored zero/scale: relative 2^-11 for normal numbers (the test allows
# 2^-10 of |min| + |max|), absolute 2^-25 / 2^-24 once they fall into fp16's subnormal range.
FP16_SUBNORMAL_SLACK = 2.0**-24

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_groups(name: str, d: int) -> list[int]:
    per = 8 // INT_BITS[name]
    return [g for g in range(1, d + 1) if d % g == 0 and g % per == 0]


@st.composite
def int_cases(draw):
    name = draw(st.sampled_from(tuple(INT_BITS)))
    d = draw(st.sampled_from(HEAD_DIMS))
    g = draw(st.sampled_from(_valid_groups(name, d)))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    mag = draw(st.sampled_from([1e-7, 1e-5, 1e-3, 0.1, 1.0, 37.0, 1e3, 3e4, FP16_MAX]))
    offset = draw(st.sampled_from([0.0, 1.0, -3.0, 0.5]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    const_p = draw(st.sampled_from([0.0, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, d, generator=gen, dtype=torch.float64) + offset) * mag
    x = x.clamp(-FP16_MAX, FP16_MAX)
    # Make some groups constant (max == min).
    xg = x.reshape(*lead, d // g, g)
    const = torch.rand(*lead, d // g, 1, generator=gen) < const_p
    xg = torch.where(const, xg[..., :1], xg)
    if dtype == torch.bfloat16:  # 65280 is the largest bf16 inside the fp16 range
        xg = xg.clamp(-65280.0, 65280.0)
    x = xg.reshape(*lead, d).to(dtype)
    return QuantFormat(name, d, g), x


def _group_minmax(fmt: QuantFormat, x: torch.Tensor):
    xg = x.double().reshape(*x.shape[:-1], fmt.head_dim // fmt.group_size, fmt.group_size)
    return xg, xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)


# ----------------------------------------------------------------------------- integer formats
@SETTINGS
@given(int_cases())
def test_int_roundtrip_error_bound(case):
    fmt, x = case
    b = INT_BITS[fmt.name]
    enc = fmt.encode(x)
    assert enc.dtype == torch.uint8
    assert enc.shape == (*x.shape[:-1], fmt.nbytes)
    dec = fmt.decode(enc, torch.float32)
    assert dec.shape == x.shape and dec.dtype == torch.float32
    xg, mn, mx = _group_minmax(fmt, x)
    scale = (mx - mn) / (2**b - 1)
    bound = scale / 2 + (mn.abs() + mx.abs()) * 2.0**-10 + FP16_SUBNORMAL_SLACK
    err = (dec.double().reshape(xg.shape) - xg).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()} for {fmt}"
    # Constant groups decode exactly to the fp16 of their value.
    const = (mx == mn).expand_as(xg)
    fp16_of_value = xg.to(torch.float16).double()
    assert torch.equal(dec.double().reshape(xg.shape)[const], fp16_of_value[const])
    # The default decode dtype is the model dtype.
    assert fmt.decode(enc).dtype == fmt.model_dtype


@SETTINGS
@given(st.sampled_from(tuple(INT_BITS)), st.sampled_from(HEAD_DIMS), st.data())
def test_int_packed_size(name, d, data):
    g = data.draw(st.sampled_from(_valid_groups(name, d)))
    fmt = QuantFormat(name, d, g)
    b = INT_BITS[name]
    assert fmt.nbytes == d * b // 8 + 4 * (d // g)
    x = torch.randn(2, d)
    assert fmt.encode(x).shape[-1] == fmt.nbytes


@pytest.mark.parametrize("value", [0.1, -0.1, 1 / 3, 7.77, 1e-6, -2.5e-5, 0.0, FP16_MAX, -FP16_MAX, 1234.567])
@pytest.mark.parametrize("name", tuple(INT_BITS))
def test_int_constant_group_exact(name, value):
    fmt = QuantFormat(name, 16, 8)
    x = torch.full((3, 16), value, dtype=torch.float32)
    expect = torch.tensor(value, dtype=torch.float32).to(torch.float16)
    assert torch.equal(fmt.decode(fmt.encode(x), torch.float32), expect.float().expand(3, 16))
    assert torch.equal(fmt.decode(fmt.encode(x)), expect.expand(3, 16))


def _fp16_bytes(v: float) -> list[int]:
    return list(struct.pack("<e", v))


def test_int2_bit_layout_planar_little_end_first():
    fmt = QuantFormat("int2", 8, 8)
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0])  # min 0, max 3 -> scale 1, codes = x
    enc = fmt.encode(x).tolist()
    # Byte j holds elements j, j + 2, j + 4, j + 6; element j + 2p at bits [2p, 2p + 2).
    assert enc[0] == 0b01111000  # codes of elements 0, 2, 4, 6: [0, 2, 3, 1]
    assert enc[1] == 0b00101101  # codes of elements 1, 3, 5, 7: [1, 3, 2, 0]
    assert enc[2:] == _fp16_bytes(1.0) + _fp16_bytes(0.0)  # scale, zero (fp16 little endian)


def test_int4_bit_layout_and_meta():
    fmt = QuantFormat("int4", 16, 8)
    c0 = [0, 15, 1, 14, 2, 13, 3, 12]  # group 0: scale 2, zero -4
    c1 = [5, 6, 7, 8, 9, 10, 0, 15]  # group 1: scale 0.5, zero 1
    x = torch.tensor([c * 2.0 - 4.0 for c in c0] + [c * 0.5 + 1.0 for c in c1])
    enc = fmt.encode(x).tolist()
    codes = c0 + c1
    assert len(enc) == fmt.nbytes == 8 + 2 * 2 + 2 * 2
    assert enc[:8] == [codes[i] | (codes[i + 8] << 4) for i in range(8)]  # planes: element j low, j + 8 high
    assert enc[0] == 0x50  # element 0 (code 0) in the low nibble, element 8 (code 5) in the high one
    # all scales (fp16, one per group), then all zeros
    assert enc[8:] == _fp16_bytes(2.0) + _fp16_bytes(0.5) + _fp16_bytes(-4.0) + _fp16_bytes(1.0)
    assert torch.equal(fmt.decode(fmt.encode(x), torch.float32), x)


def test_int8_bit_layout():
    fmt = QuantFormat("int8", 8, 8)
    x = torch.tensor([0.0, 255.0, 1.0, 254.0, 128.0, 7.0, 100.0, 200.0])  # scale 1, zero 0
    enc = fmt.encode(x).tolist()
    assert enc[:8] == [0, 255, 1, 254, 128, 7, 100, 200]
    assert enc[8:] == _fp16_bytes(1.0) + _fp16_bytes(0.0)


# ----------------------------------------------------------------------------- fp8
@st.composite
def fp8_cases(draw):
    d = draw(st.sampled_from(HEAD_DIMS))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    mag = draw(st.sampled_from([1e-20, 1e-6, 1e-3, 1.0, 300.0, 1e4, 1e20]))
    seed = draw(st.integers(0, 2**31 - 1))
    zero_rows = draw(st.booleans())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=gen) * mag
    # heavy tails: a few large outliers stress the per-token scale
    x = x * torch.where(torch.rand(*lead, d, generator=gen) < 0.05, 100.0, 1.0)
    if zero_rows and x.dim() > 1:
        x[..., 0, :] = 0.0
    return QuantFormat("fp8", d), x


@SETTINGS
@given(fp8_cases())
def test_fp8_error_bound(case):
    fmt, x = case
    assert fmt.nbytes == fmt.head_dim + 4
    enc = fmt.encode(x)
    assert enc.shape == (*x.shape[:-1], fmt.head_dim + 4)
    dec = fmt.decode(enc, torch.float32)
    xd = x.double()
    scale = xd.abs().amax(-1, keepdim=True) / 448.0
    bound = xd.abs() * 2.0**-4 + scale * 2.0**-9
    err = (dec.double() - xd).abs()
    assert bool((err <= bound * (1 + 2.0**-20)).all()), f"max excess {(err - bound).max().item()}"
    zero = (x == 0).all(-1)
    assert bool((dec[zero] == 0).all())


def test_fp8_zero_vector_and_scale_bytes():
    fmt = QuantFormat("fp8", 16)
    enc = fmt.encode(torch.zeros(2, 16))
    assert torch.equal(fmt.decode(enc, torch.float32), torch.zeros(2, 16))
    x = torch.arange(16, dtype=torch.float32) - 4.5
    enc = fmt.encode(x)
    scale = np.frombuffer(bytes(enc[16:].tolist()), dtype="<f4")[0]
    assert scale == np.float32(10.5) / np.float32(448.0)
    # The largest magnitude maps to the e4m3 maximum 448 (0x7E), sign bit for negatives.
    assert enc[15].item() == 0x7E


# ----------------------------------------------------------------------------- model dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_model_format_bit_exact(dtype, d):
    fmt = QuantFormat("model", d, model_dtype=dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    assert fmt.nbytes == d * esize
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(3, 2, d, generator=gen) * 10.0 ** torch.randint(-30, 30, (3, 2, 1), generator=gen)).to(dtype)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
    x[0, 1, :2] = torch.finfo(dtype).tiny / 4  # subnormal (or flushed) values survive bit-exactly too
    enc = fmt.encode(x)
    assert enc.shape == (3, 2, d * esize)
    dec = fmt.decode(enc, dtype)
    int_t = {4: torch.int32, 2: torch.int16}[esize]
    assert torch.equal(dec.view(int_t), x.view(int_t))
    # Non-contiguous input is fine.
    xt = x.transpose(0, 1)
    assert torch.equal(fmt.decode(fmt.encode(xt), dtype).view(int_t), xt.contiguous().view(int_t))


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rejected(name, bad):
    fmt = QuantFormat(name, 16, 8)
    x = torch.randn(2, 16)
    x[1, 5] = bad
    with pytest.raises(ValueError, match="non-finite"):
        fmt.encode(x)
    with pytest.raises(ValueError, match="non-finite"):
        RecordLayout(fmt, fmt).encode(x, x, torch.zeros(2), torch.zeros(2))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_beyond_fp16_range_rejected(name):
    fmt = QuantFormat(name, 8, 8)
    with pytest.raises(ValueError, match="fp16 range"):
        fmt.encode(torch.tensor([0.0] * 7 + [7e4]))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(name="int3", head_dim=16), "name"),
        (dict(name="fp16", head_dim=16), "name"),
        (dict(name="", head_dim=16), "name"),
        (dict(name="int4", head_dim=0), "head_dim"),
        (dict(name="model", head_dim=-4), "head_dim"),
        (dict(name="int4", head_dim=16, group_size=0), "group_size"),
        (dict(name="int4", head_dim=16, group_size=-8), "group_size"),
        (dict(name="int4", head_dim=16, group_size=12), "group_size"),
        (dict(name="int8", head_dim=16, group_size=32), "group_size"),
        (dict(name="int4", head_dim=16, group_size=1), "group_size"),
        (dict(name="int2", head_dim=16, group_size=2), "group_size"),
        (dict(name="int2", head_dim=16, group_size=8.0), "group_size"),
    ],
)
def test_bad_format_arguments(kwargs, field):
    with pytest.raises(ValueError, match=rf"QuantFormat\.{field}="):
        QuantFormat(**kwargs)


def test_wrong_shapes_rejected():
    fmt = QuantFormat("int4", 16, 8)
    with pytest.raises(ValueError, match="head_dim"):
        fmt.encode(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="nbytes"):
        fmt.decode(torch.zeros(2, fmt.nbytes + 1, dtype=torch.uint8))


# ----------------------------------------------------------------------------- record layout
FORMAT_CHOICES = ("model", "int8", "int4", "int2", "fp8")


@st.composite
def layouts(draw):
    d = draw(st.sampled_from(HEAD_DIMS))
    model_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))

    def fmt():
        name = draw(st.sampled_from(FORMAT_CHOICES))
        g = draw(st.sampled_from(_valid_groups(name, d))) if name in INT_BITS else 32
        return QuantFormat(name, d, g, model_dtype)

    return RecordLayout(fmt(), fmt())


@SETTINGS
@given(layouts(), st.lists(st.integers(1, 3), min_size=0, max_size=2), st.integers(0, 2**31 - 1))
def test_record_layout_roundtrip(lay, lead, seed):
    lead = tuple(lead)
    kv = lay.key.nbytes + lay.value.nbytes
    assert lay.kv_bytes == kv
    assert lay.pos_offset % 4 == 0 and kv <= lay.pos_offset < kv + 4
    assert lay.score_offset == lay.pos_offset + 4
    assert lay.nbytes % 4 == 0 and lay.nbytes == lay.pos_offset + 8
    # in a page: bodies, then tags, then scores, in exactly the bytes of tpp whole records
    assert lay.stride == lay.pos_offset
    for tpp in (1, 7):
        assert lay.tag_region(tpp) == tpp * lay.stride and lay.score_region(tpp) == lay.tag_region(tpp) + 4 * tpp
        assert lay.score_region(tpp) + 4 * tpp == tpp * lay.nbytes
        assert lay.records_per_page(tpp * lay.nbytes + 3) == tpp
    gen = torch.Generator().manual_seed(seed)
    d = lay.key.head_dim
    k = torch.randn(*lead, d, generator=gen, dtype=torch.float32)
    v = torch.randn(*lead, d, generator=gen, dtype=torch.float32) * 3
    pos = torch.randint(-(2**31), 2**31 - 1, lead, generator=gen, dtype=torch.int64)
    score = torch.randn(lead, generator=gen) * 1e3
    rec = lay.encode(k, v, pos, score)
    assert rec.dtype == torch.uint8 and rec.shape == (*lead, lay.nbytes)
    assert torch.equal(lay.positions(rec), pos.to(torch.int32))
    assert torch.equal(lay.scores(rec).view(torch.int32), score.view(torch.int32))
    assert bool((rec[..., kv : lay.pos_offset] == 0).all())  # padding is zeroed
    dk, dv = lay.decode_kv(rec, torch.float32)
    assert torch.equal(dk, lay.key.decode(lay.key.encode(k), torch.float32))
    assert torch.equal(dv, lay.value.decode(lay.value.encode(v), torch.float32))
    dk2, _ = lay.decode_kv(rec)
    assert dk2.dtype == lay.key.model_dtype


def test_record_decode_single_unaligned_record():
    # int2 keys of head_dim 8 take 6 bytes, so the fp8 value's fp32 scale sits at byte 14 of the
    # record; decoding one 1-D record (a contiguous slice) must not depend on storage alignment.
    lay = RecordLayout(QuantFormat("int2", 8, 8), QuantFormat("fp8", 8))
    k, v = torch.randn(8), torch.randn(8)
    rec = lay.encode(k, v, torch.tensor(7), torch.tensor(0.5))
    batch = lay.encode(k[None], v[None], torch.tensor([7]), torch.tensor([0.5]))
    dk, dv = lay.decode_kv(rec, torch.float32)
    bk, bv = lay.decode_kv(batch, torch.float32)
    assert torch.equal(dk, bk[0]) and torch.equal(dv, bv[0])
    assert int(lay.positions(rec)) == 7 and float(lay.scores(rec)) == 0.5


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp8", "model"])
@pytest.mark.parametrize("d", [16, 64])
def test_decode_at_reads_fields_in_place_at_any_offset(name, d):
    """The decode step reads fields straight out of gathered records (word-wise where aligned,
    byte-wise elsewhere); every offset must give exactly what ``decode`` of the field gives."""
    fmt = QuantFormat(name, d, 8 if name in INT_BITS else 32, torch.bfloat16)
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d))
    enc = fmt.encode(x)
    expect = fmt.decode(enc, torch.float32)
    for offset in (0, 2, 4, 6, 8):
        if not fmt.aligned_at(offset):
            continue
        rec = torch.zeros(3, 5, (offset + fmt.nbytes + 3) // 4 * 4 + 4, dtype=torch.uint8)
        rec[..., offset : offset + fmt.nbytes] = enc
        assert torch.equal(fmt.decode_at(rec, offset, torch.float32), expect), offset
