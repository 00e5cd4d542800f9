"""The encode+write and record-move kernels against their torch twins (Triton's interpreter on CPU, toy sizes).

Every comparison is over the whole pool, byte for byte: the pool starts as random bytes, records
land in scattered slots over several pages, and bytes outside the records must come back untouched.
The encode tests also decode what was written and hold it to ``QuantFormat.max_abs_error``, so a
twin and kernel that agreed on wrong bytes would still fail.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import hfkv.kernels.encode as encode_mod
from hfkv.kernels.encode import encode_write, encode_write_reference
from hfkv.kernels.move import clear_tags, clear_tags_reference, move_records, move_records_reference
from hfkv.quant.formats import INT_BITS, QuantFormat
from hfkv.quant.record import RecordLayout

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ROW_KINDS = 10


def _ties(fmt: QuantFormat, d: int, g: torch.Generator) -> torch.Tensor:
    """A row whose values sit exactly halfway between two codes of ``fmt`` (round-half-to-even matters)."""
    if fmt.name in INT_BITS:
        # Groups spanning [0, qmax] get scale 1 and zero 0, so k + 0.5 is an exact tie between codes k and k + 1.
        qmax = (1 << fmt.bits) - 1
        x = torch.randint(0, qmax, (d,), generator=g).float() + 0.5
        x[:: fmt.group_size] = 0.0
        x[1 :: fmt.group_size] = float(qmax)
        return x
    if fmt.name == "fp8":
        # amax 448 gives scale 1; midpoints of e4m3 normals (3 mantissa bits) and of subnormals (steps of 2^-9).
        m = torch.randint(0, 8, (d,), generator=g).float()
        e = torch.randint(-6, 8, (d,), generator=g).float()
        x = (1 + (2 * m + 1) / 16) * torch.exp2(e)
        sub = torch.rand(d, generator=g) < 0.3
        x = torch.where(sub, (2 * m + 1) * 2.0**-10, x)
        x = torch.where(torch.rand(d, generator=g) < 0.5, -x, x)
        x[0] = 448.0
        return x.clamp(-448, 448)
    # Model dtype: fp32 values halfway between two fp16 (or bf16) values.
    bits = 10 if fmt.model_dtype == F16 else 7
    j = torch.randint(0, 1 << bits, (d,), generator=g).float()
    e = torch.randint(-8, 8, (d,), generator=g).float()
    return (1 + (2 * j + 1) * 2.0 ** -(bits + 1)) * torch.exp2(e)


def _row(kind: int, fmt: QuantFormat, d: int, g: torch.Generator) -> torch.Tensor:
    group = fmt.group_size if fmt.name in INT_BITS else min(32, d)
    r = torch.randn(d, generator=g)
    if kind == 0:
        return r * 2
    if kind == 1:  # small
        return r * 1e-3
    if kind == 2:  # large, inside fp16 range
        return (r * 1e4).clamp(-6e4, 6e4)
    if kind == 3:
        return torch.zeros(d)
    if kind == 4:  # constant groups (one of them exactly zero), beside a random one
        x = torch.randn(d // group, generator=g).repeat_interleave(group)
        x[:group] = 0.0
        x[-group:] = r[-group:]
        return x
    if kind == 5:  # wide dynamic range: one outlier, the rest in fp8's subnormals
        x = r * 1e-4
        x[3] = 50.0
        return x
    if kind == 6:  # inside one fp16 step (0.5 here) that fp16(min) rounds up out of: a negative scale
        return 1000.3 + torch.rand(d, generator=g) * 0.15
    if kind == 7:
        return _ties(fmt, d, g)
    if kind == 8:  # tiny: fp16 subnormal scales and zeros
        return r * 1e-6
    x = r.clone()  # signed zeros among values
    x[::3] = 0.0
    x[1::3] = -0.0
    return x


def _inputs(fmt: QuantFormat, n: int, dtype: torch.dtype, g: torch.Generator, shift: int) -> torch.Tensor:
    d = fmt.head_dim
    return torch.stack([_row((i + shift) % ROW_KINDS, fmt, d, g) for i in range(n)]).to(dtype)


def _pool_and_dest(layout: RecordLayout, n: int, g: torch.Generator, tpp: int = 3, pages: int = 6):
    """A random-byte pool (with slack bytes after each page's records) and ``n`` distinct scattered slots."""
    page_bytes = tpp * layout.nbytes + 12
    assert layout.records_per_page(page_bytes) == tpp
    pool = torch.randint(0, 256, (pages, page_bytes), generator=g, dtype=torch.uint8)
    slot = torch.randperm(pages * tpp, generator=g)[:n]
    dest = (slot // tpp) * page_bytes + (slot % tpp) * layout.stride
    return pool, dest


def _covered(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(pool.numel(), dtype=torch.bool)
    mask[index] = True
    return mask.view_as(pool)


def _records(pool: torch.Tensor, dest: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """Whole records (body, tag, score) of the slots at ``dest``, read back from their page regions."""
    return pool.view(-1)[layout.record_index(dest, pool.shape[1])]


def _layout(key: str, value: str, dim: int, group: int, dtype: torch.dtype) -> RecordLayout:
    return RecordLayout(QuantFormat(key, dim, group, dtype), QuantFormat(value, dim, group, dtype))


def _check_decoded(fmt: QuantFormat, got: torch.Tensor, x: torch.Tensor) -> None:
    if fmt.name == "model":
        torch.testing.assert_close(got, x.to(fmt.model_dtype).float(), rtol=0, atol=0)
        return
    # max_abs_error models fp16 rounding of scale and zero relative to the values; fp16 subnormal steps
    # (2^-24, the "tiny" rows) and fp32 rounding of the decode itself come on top.
    bound = fmt.max_abs_error(x) + 2.0**-24 + x.float().abs() * 2.0**-22
    err = (got - x.float()).abs()
    assert bool((err <= bound).all()), f"{fmt.name}: worst excess {(err - bound).max().item():.3g}"


def _run_both(layout, k, v, pos, score, g, tpp=3, pages=6, rows=None):
    pool, dest = _pool_and_dest(layout, k.shape[0], g, tpp, pages)
    got, want = pool.clone(), pool.clone()
    encode_write(got, dest, layout, k, v, pos, score, rows=rows)
    encode_write_reference(want, dest, layout, k, v, pos, score)
    return pool, dest, got, want


CASES = [
    # key, value, model dtype, input dtype, head_dim, group
    ("int4", "int2", BF16, BF16, 128, 32),
    ("int8", "int4", F16, F16, 64, 32),
    ("int2", "int2", F32, F32, 64, 64),
    ("int4", "int8", BF16, BF16, 128, 128),
    ("int2", "int4", F16, F16, 16, 16),
    ("int8", "int8", F16, F32, 64, 32),  # fp32 input under an fp16 model: quantized from the fp32 values
    ("fp8", "fp8", F16, F16, 64, 32),
    ("fp8", "fp8", F32, F32, 128, 64),
    ("model", "model", F32, F32, 64, 32),
    ("model", "model", F16, F32, 64, 32),  # fp32 -> fp16 rounding, ties included
    ("model", "model", BF16, F32, 128, 32),  # fp32 -> bf16 rounding, ties included
    ("model", "model", BF16, BF16, 16, 16),
    ("model", "model", F16, BF16, 64, 64),  # bf16 input stored as fp16
    ("int4", "model", F16, F16, 64, 64),
    ("model", "fp8", BF16, BF16, 128, 64),
    ("fp8", "int2", F32, F32, 16, 16),
    ("fp8", "int4", BF16, F32, 128, 128),
]


@pytest.mark.parametrize("key,value,model_dtype,in_dtype,dim,group", CASES)
def test_encode_write_matches_twin_and_decodes(key, value, model_dtype, in_dtype, dim, group):
    _matches_twin_and_decodes(key, value, model_dtype, in_dtype, dim, group, None)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("key,value,model_dtype,in_dtype,dim,group", CASES[:2] + CASES[8:9])
def test_encode_write_several_tokens_per_program(key, value, model_dtype, in_dtype, dim, group, rows):
    """12 tokens in programs of 5 (the last one 2 short) or 16 (one program, 4 short): the same bytes."""
    _matches_twin_and_decodes(key, value, model_dtype, in_dtype, dim, group, rows)


def _matches_twin_and_decodes(key, value, model_dtype, in_dtype, dim, group, rows):
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}{value}{model_dtype}{in_dtype}{dim}{group}".encode()))
    layout = _layout(key, value, dim, group, model_dtype)
    n = 12  # every row kind, and not a power of two
    k = _inputs(layout.key, n, in_dtype, g, 0)
    v = _inputs(layout.value, n, in_dtype, g, 3)
    pos = torch.randint(0, 1 << 20, (n,), generator=g)
    score = torch.rand(n, generator=g) * 10
    pool, dest, got, want = _run_both(layout, k, v, pos, score, g, rows=rows)

    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ from the twin"
    outside = ~_covered(pool, layout.record_index(dest, pool.shape[1]))
    assert torch.equal(got[outside], pool[outside])
    # The semantic check: what was written decodes to the inputs, with the right tags and scores.
    rec = _records(got, dest, layout)
    kd, vd = layout.decode_kv(rec, torch.float32)
    _check_decoded(layout.key, kd, k)
    _check_decoded(layout.value, vd, v)
    assert torch.equal(layout.positions(rec), pos.to(torch.int32))
    assert torch.equal(layout.scores(rec), score)
    if layout.pos_offset > layout.kv_bytes:
        assert not rec[:, layout.kv_bytes : layout.pos_offset].any(), "pad bytes must be zero"


@pytest.mark.parametrize(
    "key,value,model_dtype,dim,group",
    [("int4", "int2", F16, 64, 32), ("fp8", "model", BF16, 128, 64), ("int2", "int8", F32, 16, 16)],
)
def test_encode_write_single_token(key, value, model_dtype, dim, group):
    g = torch.Generator().manual_seed(7)
    layout = _layout(key, value, dim, group, model_dtype)
    k = (torch.randn(1, dim, generator=g) * 3).to(model_dtype)
    v = torch.randn(1, dim, generator=g).to(model_dtype)
    _, _, got, want = _run_both(layout, k, v, torch.tensor([41]), torch.tensor([0.25]), g, tpp=2, pages=3)
    assert torch.equal(got, want)


def test_encode_write_odd_field_offsets_strided_inputs_and_other_dtypes():
    """A value field starting at an odd byte, inputs that are strided views, int32 positions, fp64 scores."""
    g = torch.Generator().manual_seed(3)
    # int2 keys of head_dim 20 in groups of 4: 5 code bytes + 20 meta bytes, so values start at byte 25.
    layout = _layout("int2", "model", 20, 4, F16)
    assert layout.key.nbytes % 2 == 1
    n = 9
    k = _inputs(layout.key, n, F32, g, 0)
    v = torch.randn(n, 40, generator=g)[:, ::2]  # column stride 2
    kt = k.t().contiguous().t()  # row stride 1, column stride n
    pos = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    score = torch.rand(n, generator=g, dtype=torch.float64)
    pool, dest, got, want = _run_both(layout, kt, v, pos, score, g, tpp=2, pages=5)
    assert torch.equal(got, want)
    rec = _records(got, dest, layout)
    _check_decoded(layout.value, layout.decode_kv(rec, torch.float32)[1], v)


def test_encode_write_empty_makes_no_launch(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("encode_write launched a kernel for zero tokens")

    monkeypatch.setattr(encode_mod, "_encode_write_kernel", NoLaunch())
    layout = _layout("int4", "int4", 64, 32, F16)
    pool = torch.randint(0, 256, (2, layout.nbytes * 2), dtype=torch.uint8)
    before = pool.clone()
    empty = torch.empty(0, 64, dtype=F16)
    encode_write(
        pool, torch.empty(0, dtype=torch.int64), layout, empty, empty, torch.empty(0, dtype=torch.int64), torch.empty(0)
    )
    assert torch.equal(pool, before)


@pytest.mark.parametrize("fn", [encode_write, encode_write_reference])
def test_encode_write_rejects_bad_inputs(fn):
    layout = _layout("int4", "int2", 64, 32, F16)
    n = 3
    pool = torch.zeros(2, layout.nbytes * 4, dtype=torch.uint8)
    dest = torch.arange(n) * layout.stride
    k = torch.randn(n, 64, dtype=F16)
    pos, score = torch.arange(n), torch.rand(n)
    ok = dict(pool=pool, dest=dest, layout=layout, k=k, v=k, pos=pos, score=score)
    bad = [
        ({"k": torch.randn(n, 32, dtype=F16)}, r"\bk must have shape \[3, 64\]"),
        ({"v": torch.randn(n + 1, 64, dtype=F16)}, r"\bv must have shape"),
        ({"k": k.double()}, r"\bk has dtype torch.float64"),
        ({"dest": dest.int()}, r"dest must be int64"),
        ({"pos": pos.float()}, r"pos must be an integer \[3\]"),
        ({"score": torch.rand(n + 1)}, r"score must be a float \[3\]"),
        ({"pool": pool.view(torch.int32)}, r"pool must be a contiguous uint8"),
        ({"pool": pool.t()}, r"pool must be a contiguous uint8"),
        ({"pool": torch.zeros(2, 6, dtype=torch.uint8)}, r"whole 4-byte words"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            fn(**{**ok, **change})


# --------------------------------------------------------------------------------------------- moves
@pytest.mark.parametrize("record_bytes,n", [(4, 5), (44, 1), (44, 13), (4 * 1030, 3)])
def test_move_records_matches_twin(record_bytes, n):
    g = torch.Generator().manual_seed(record_bytes + n)
    tpp, pages = 4, max(2, (2 * n + 3) // 4 + 1)
    page_bytes = tpp * record_bytes + 8
    pool = torch.randint(0, 256, (pages, page_bytes), generator=g, dtype=torch.uint8)
    slot = torch.randperm(pages * tpp, generator=g)[: 2 * n]
    offs = (slot // tpp) * page_bytes + (slot % tpp) * record_bytes
    src, dst = offs[:n], offs[n:]
    got, want = pool.clone(), pool.clone()
    move_records(got, src, dst, record_bytes)
    move_records_reference(want, src, dst, record_bytes)
    assert torch.equal(got, want)
    e = torch.arange(record_bytes)
    flat, orig = got.view(-1), pool.view(-1)
    assert torch.equal(flat[dst[:, None] + e], orig[src[:, None] + e])
    untouched = ~_covered(pool, dst[:, None] + torch.arange(record_bytes))
    assert torch.equal(got[untouched], pool[untouched])


@pytest.mark.parametrize("m", [0, 1, 37, 1500])
def test_clear_tags_matches_twin(m):
    g = torch.Generator().manual_seed(m)
    layout = _layout("int4", "int2", 64, 32, F16)
    tpp, pages = 8, 1500 // 8 + 2
    page_bytes = tpp * layout.nbytes + 4
    pool = torch.randint(1, 256, (pages, page_bytes), generator=g, dtype=torch.uint8)
    slot = torch.randperm(pages * tpp, generator=g)[:m]
    at = (slot // tpp) * page_bytes + (slot % tpp) * layout.nbytes + layout.pos_offset
    got, want = pool.clone(), pool.clone()
    clear_tags(got, at)
    clear_tags_reference(want, at)
    assert torch.equal(got, want)
    words = got.view(torch.int32).view(-1)
    assert not words[at // 4].any()
    untouched = ~_covered(pool, at[:, None] + torch.arange(4))
    assert torch.equal(got[untouched], pool[untouched])
    assert int((got != pool).sum()) == (4 * m if m else 0)  # pool bytes are never 0 before, so every tag changes


@pytest.mark.parametrize("fn", [move_records, move_records_reference])
def test_move_records_rejects_bad_inputs(fn):
    pool = torch.zeros(2, 64, dtype=torch.uint8)
    src, dst = torch.tensor([0, 16]), torch.tensor([32, 48])
    with pytest.raises(ValueError, match="record_bytes=6 must be a positive multiple of 4"):
        fn(pool, src, dst, 6)
    with pytest.raises(ValueError, match=r"dst must be int64 \[2\]"):
        fn(pool, src, dst[:1], 16)
    with pytest.raises(ValueError, match="src must be int64"):
        fn(pool, src.int(), dst, 16)
    with pytest.raises(ValueError, match="pool must be a contiguous uint8"):
        fn(pool.float(), src, dst, 16)


@pytest.mark.parametrize("fn", [clear_tags, clear_tags_reference])
def test_clear_tags_rejects_bad_inputs(fn):
    with pytest.raises(ValueError, match="at must be int64"):
        fn(torch.zeros(2, 64, dtype=torch.uint8), torch.tensor([4, 8], dtype=torch.int32))
