"""The torch decode path of the integer formats against the formula it replaced.

``QuantFormat.decode_at`` used to unpack natural order with masks and shifts on int32 words, then
``codes.float().mul_(scale).add_(zero)`` and a cast; it now reads the field factored in chunk
order (``chunk_codes_at``) and interleaves at the end. ``_reference_decode`` below is that old
formula written out per element, so the new path must match it bit for bit, at every offset
(odd ones included), group size, head dim and model dtype. Attention over factored parts must
equal attention over the dequantized tiers up to fp32 rounding.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hfkv
from hfkv.kernels.slots import factored_pays, slot_attention, slot_attention_received
from hfkv.policy import reduce_gqa
from hfkv.quant.formats import ChunkCodes, QuantFormat, chunks_to_natural
from hfkv.quant.record import RecordLayout
from tests.models import tiny_model

INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _reference_decode(fmt: QuantFormat, enc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HEAD's natural-order decode, element by element: element ``j + pP`` is bits ``[pb, (p+1)b)`` of byte ``j``."""
    b, d, g = INT_BITS[fmt.name], fmt.head_dim, fmt.groups
    per, nb = 8 // b, fmt.head_dim * INT_BITS[fmt.name] // 8
    packed = enc[..., :nb].to(torch.int64)
    idx = torch.arange(d)
    codes = (packed[..., idx % nb] >> (idx // nb * b)) & ((1 << b) - 1)
    meta = enc[..., nb:].contiguous().view(torch.float16).float()
    scale, zero = meta[..., :g, None], meta[..., g:, None]
    x = codes.to(torch.uint8).view(*enc.shape[:-1], g, fmt.group_size).float().mul_(scale).add_(zero)
    assert per * nb == d
    return x.view(*enc.shape[:-1], d).to(dtype)


def _cases():
    for name, d, gs, dtype in itertools.product(INT_BITS, (16, 64, 128), (16, 32, 64, 128), DTYPES):
        if d % gs == 0:
            yield name, d, gs, dtype


def _encoded(fmt: QuantFormat, lead=(3, 5), seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, fmt.head_dim, generator=gen) + 0.7) * 5
    x[..., : fmt.group_size] = 1.25  # one constant group: scale 0
    return fmt.encode(x.to(fmt.model_dtype))


@pytest.mark.parametrize(("name", "d", "gs", "dtype"), list(_cases()))
def test_decode_matches_the_natural_order_formula_at_every_offset(name, d, gs, dtype):
    fmt = QuantFormat(name, d, gs, dtype)
    enc = _encoded(fmt)
    for out_dtype in (None, torch.float32):
        expect = _reference_decode(fmt, enc, out_dtype or dtype)
        assert torch.equal(fmt.decode(enc, out_dtype), expect)
        for offset in range(8):  # odd offsets: fields that are not 2-, 4- or 8-byte aligned
            rec = torch.full((3, 5, offset + fmt.nbytes + 5), 0xA5, dtype=torch.uint8)
            rec[..., offset : offset + fmt.nbytes] = enc
            got = fmt.decode_at(rec, offset, out_dtype)
            assert got.dtype == (out_dtype or dtype) and torch.equal(got, expect), offset


@pytest.mark.parametrize(("name", "d", "gs"), [(n, d, g) for n, d, g, dt in _cases() if dt == torch.float32])
def test_chunk_codes_are_the_values_in_chunk_order(name, d, gs):
    fmt = QuantFormat(name, d, gs, torch.float32)
    enc = _encoded(fmt, lead=(2, 3, 4), seed=1)
    cc = fmt.chunk_codes_at(enc, 0)
    k, n = d // fmt.chunk, fmt.chunk
    assert cc.codes.shape == (k, 2, 3, 4, n) and cc.scale.shape == cc.zero.shape == (k, 2, 3, 4)
    assert cc.codes.is_contiguous() and cc.scale.is_contiguous() and cc.zero.is_contiguous()
    # a chunk lies in one group and one byte plane, and chunk c holds elements [c n, (c + 1) n)
    assert gs % n == 0 and (d * INT_BITS[name] // 8) % n == 0
    values = _reference_decode(fmt, enc, torch.float32)
    assert torch.equal(chunks_to_natural(cc.dequantize(), torch.float32), values)
    g = gs // n
    meta = enc[..., d * INT_BITS[name] // 8 :].contiguous().view(torch.float16).float()
    assert torch.equal(cc.scale, meta[..., : fmt.groups].repeat_interleave(g, -1).movedim(-1, 0))
    assert torch.equal(cc.zero, meta[..., fmt.groups :].repeat_interleave(g, -1).movedim(-1, 0))
    assert cc.codes.dtype == torch.uint8 and int(cc.codes.max()) < 2 ** INT_BITS[name]


@pytest.mark.parametrize("name", list(INT_BITS))
def test_decode_reads_strided_empty_and_single_records(name):
    fmt = QuantFormat(name, 64, 32, torch.float16)
    enc = _encoded(fmt, lead=(4, 6))
    expect = _reference_decode(fmt, enc, torch.float32)
    wide = torch.zeros(6, 4, fmt.nbytes + 3, dtype=torch.uint8)
    wide[..., 1 : 1 + fmt.nbytes] = enc.transpose(0, 1)
    rec = wide.transpose(0, 1)  # [4, 6, R]: rows not in memory order, field at byte 1
    assert torch.equal(fmt.decode_at(rec, 1, torch.float32), expect)
    strided = torch.zeros(4, 6, fmt.nbytes, 2, dtype=torch.uint8)
    strided[..., 0] = enc
    assert torch.equal(fmt.decode_at(strided[..., 0], 0, torch.float32), expect)  # last-dim stride 2
    assert torch.equal(fmt.decode(enc[1, 2], torch.float32), expect[1, 2])  # one 1-D record
    assert fmt.decode(enc[:0], torch.float32).shape == (0, 6, 64)
    empty = fmt.chunk_codes_at(enc[:, :0], 0)
    assert empty.codes.shape[1:-1] == (4, 0) and empty.scale.shape[1:] == (4, 0)


def test_chunk_codes_at_refuses_unpacked_formats():
    with pytest.raises(ValueError, match="not an integer format"):
        QuantFormat("fp8", 16).chunk_codes_at(torch.zeros(2, 20, dtype=torch.uint8), 0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (("int4", 32), ("int2", 32)),  # the default preset's quantized tier
        (("int8", 16), ("int4", 64)),
        (("int2", 8), ("fp8", 32)),  # fp8 values at a byte offset that is not word-aligned
        (("int4", 16), ("model", 32)),
        (("model", 32), ("int2", 128)),
    ],
)
def test_decode_kv_for_attention_is_decode_kv_factored(key, value):
    d = 8 if key == ("int2", 8) else 64
    lay = RecordLayout(*(QuantFormat(name, d, min(gs, d), torch.float16) for name, gs in (key, value)))
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 11, d, generator=gen), torch.randn(2, 3, 11, d, generator=gen)
    rec = lay.encode(k, v, torch.arange(11).expand(2, 3, 11), torch.zeros(2, 3, 11))
    nk, nv = lay.decode_kv(rec, torch.float32)
    for got, natural, f in zip(lay.decode_kv_for_attention(rec), (nk, nv), (lay.key, lay.value), strict=True):
        if f.name in INT_BITS:
            assert isinstance(got, ChunkCodes)
            got = chunks_to_natural(got.dequantize(), torch.float32)
        assert torch.equal(got, natural)


def _factored_parts(gen, bsz, hkv, sizes, d, specs):
    parts, natural, positions = [], [], []
    for n, (kspec, vspec) in zip(sizes, specs, strict=True):
        lay = RecordLayout(QuantFormat(kspec[0], d, kspec[1]), QuantFormat(vspec[0], d, vspec[1]))
        k = torch.randn(bsz, hkv, n, d, generator=gen) * 2 + 0.5
        v = torch.randn(bsz, hkv, n, d, generator=gen) * 3
        pos = torch.randint(0, 40, (bsz, hkv, n), generator=gen)
        pos[torch.rand(bsz, hkv, n, generator=gen) < 0.2] = -1  # empty slots
        rec = lay.encode(k, v, pos, torch.zeros(bsz, hkv, n))
        parts.append(lay.decode_kv_for_attention(rec))
        natural.append(lay.decode_kv(rec, torch.float32))
        positions.append(pos)
    return parts, natural, torch.cat(positions, -1)


def _attention_fp64(query, parts, slot_index, mask, scaling):
    """The same attention in fp64 over dense parts: what both fp32 evaluations approximate."""
    keys, values = (torch.cat([p[i] for p in parts], 2).double() for i in (0, 1))
    bsz, hq, q, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    logits = (query.double().reshape(bsz, hkv, g * q, d) * scaling) @ keys.transpose(-1, -2)
    m = torch.nn.functional.pad(mask[:, 0], (1, 0), value=False)
    allowed = torch.gather(m.unsqueeze(1).expand(bsz, hkv, q, -1), 3, slot_index.unsqueeze(2).expand(bsz, hkv, q, s))
    logits = torch.where(allowed.unsqueeze(2), logits.view(bsz, hkv, g, q, s), float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return (probs.view(bsz, hkv, g * q, s) @ values).view(bsz, hq, q, d).transpose(1, 2), probs


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_slot_attention_over_factored_parts_equals_dequantized_parts(q, d):
    gen = torch.Generator().manual_seed(q * 1000 + d)
    bsz, hq, hkv, length = 2, 8, 2, 44
    specs = [(("int4", 32 if d >= 32 else 16), ("int2", 16)), (("int8", 16), ("int4", d)), (("int2", 8), ("int8", d))]
    window = (torch.randn(bsz, hkv, 5, d, generator=gen), torch.randn(bsz, hkv, 5, d, generator=gen))
    parts, natural, pos = _factored_parts(gen, bsz, hkv, (37, 9, 20), d, specs)
    wpos = torch.randint(0, length - q, (bsz, hkv, 5), generator=gen)
    slot_index = torch.cat([wpos, pos], -1) + 1
    query = torch.randn(bsz, hq, q, d, generator=gen)
    qpos = torch.arange(length - q, length)
    mask = (torch.arange(length).view(1, -1) <= qpos.view(-1, 1)).expand(bsz, 1, q, length).clone()
    mask[0, :, :, :3] = False
    out, probs = slot_attention(query, [window, *parts], slot_index, mask, 0.2)
    ref_out, ref_probs = slot_attention(query, [window, *natural], slot_index, mask, 0.2)
    exact, exact_probs = _attention_fp64(query, [window, *natural], slot_index, mask, 0.2)
    # Scale and zero applied to logits and outputs round differently from dequantizing first: both
    # fp32 evaluations stay within fp32 rounding of the fp64 attention (outputs here reach ~10).
    tol = dict(rtol=0, atol=5e-6 * float(exact.abs().max()))
    torch.testing.assert_close(out.double(), exact, **tol)
    torch.testing.assert_close(ref_out.double(), exact, **tol)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.double(), exact_probs, rtol=1e-5, atol=1e-6)
    # a factored part may also come first, and a query may need grad (a model run outside no_grad)
    out2, _ = slot_attention(query.requires_grad_(), [*parts, window], torch.cat([pos, wpos], -1) + 1, mask, 0.2)
    torch.testing.assert_close(out2.detach().double(), exact, **tol)


def test_many_query_rows_dequantize_first_exactly():
    """A prefill chunk (rows x chunks > head_dim) attends over the tiers dequantized as ``decode`` does:
    the same bits as attention over natural-order parts; a decode step keeps the factored path."""
    gen = torch.Generator().manual_seed(11)
    bsz, hq, hkv, d, q = 1, 8, 2, 64, 40
    specs = [(("int4", 32), ("int2", 32)), (("int8", 32), ("int4", 32))]
    parts, natural, pos = _factored_parts(gen, bsz, hkv, (30, 12), d, specs)
    length = 80
    query = torch.randn(bsz, hq, q, d, generator=gen)
    qpos = torch.arange(length - q, length)
    mask = (torch.arange(length).view(1, -1) <= qpos.view(-1, 1)).expand(bsz, 1, q, length)
    slot_index = pos + 1
    rows = hq // hkv * q
    assert not factored_pays(rows, parts[0][1].codes.shape[0], d) and factored_pays(hq // hkv, 4, d)
    out, probs = slot_attention(query, parts, slot_index, mask, 0.125)
    ref_out, ref_probs = slot_attention(query, natural, slot_index, mask, 0.125)
    assert torch.equal(out, ref_out) and torch.equal(probs, ref_probs)


@pytest.mark.parametrize("reduction", ["max", "mean", "l2"])
@pytest.mark.parametrize("tile_bytes", [1, 4 * 2 * 2 * 4 * 61 * 5, 1 << 30])
def test_chunk_in_query_tiles_equals_the_whole_chunk(reduction, tile_bytes):
    """A chunk taken in tiles of queries (one query, five, all 23) gives the whole chunk's output and its
    probabilities reduced over each group and summed over the queries, over factored tiers, a bf16 window,
    a left-padded row and a padding query that sees nothing."""
    gen = torch.Generator().manual_seed(3)
    bsz, hq, hkv, d, q, length = 2, 8, 2, 32, 23, 90
    specs = [(("int4", 32), ("int2", 16)), (("int8", 16), ("int4", 32))]
    window = tuple(torch.randn(bsz, hkv, 4, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    parts, _, pos = _factored_parts(gen, bsz, hkv, (40, 17), d, specs)
    wpos = torch.arange(length - q - 4, length - q).expand(bsz, hkv, 4)
    slot_index = torch.cat([wpos, pos], -1) + 1
    query = torch.randn(bsz, hq, q, d, generator=gen)
    qpos = torch.arange(length - q, length)
    mask = (torch.arange(length).view(1, -1) <= qpos.view(-1, 1)).expand(bsz, 1, q, length).clone()
    mask[1, :, :, :6] = False  # row 1 left-padded
    mask[1, :, 0] = False  # ... and its first query sees nothing
    ref_out, probs = slot_attention(query, [window, *parts], slot_index, mask, 0.2)
    ref = reduce_gqa(probs.flatten(1, 2), hkv, reduction).sum(2)
    out, received = slot_attention_received(query, [window, *parts], slot_index, mask, 0.2, reduction, tile_bytes)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(received, ref, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all() and (out[1, 0] == 0).all()


def test_torch_decode_step_equals_attention_over_dequantized_tiers(monkeypatch):
    """End to end: generation with factored tiers gives the logits of natural-order dequantized tiers."""
    model = tiny_model("llama", head_dim=64, num_attention_heads=4, hidden_size=256)
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(5))

    def run():
        cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("hfkv", budget=24, window=4))
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=cache)
            tok, steps = out.logits[:, -1:].argmax(-1), []
            for _ in range(6):
                out = model(input_ids=tok, past_key_values=cache)
                steps.append(out.logits[:, -1])
                tok = out.logits[:, -1:].argmax(-1)
        return torch.stack(steps), cache

    factored, cache = run()
    assert any(int(c) > 0 for c in cache.layers[0].tiers.counts[..., -1].flatten())  # quantized tier in use
    monkeypatch.setattr(RecordLayout, "decode_kv_for_attention", lambda self, rec: self.decode_kv(rec, torch.float32))
    natural, _ = run()
    torch.testing.assert_close(factored, natural, rtol=1e-4, atol=1e-4)
