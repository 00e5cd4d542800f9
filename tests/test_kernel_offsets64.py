"""Every offset the Triton kernels form into the byte pool or a page table is 64-bit.

A layer's pool passes 2 GiB on a GPU long before anything else does (Llama-3.1-8B at 32k tokens x
batch 8 holds 4 GiB of exact records per layer), and an offset formed in 32 bits wraps silently
there: the kernel reads or writes another token's bytes. These tests put records past 2^34 bytes
(16 GiB, so past 2^32 four-byte words too) and page-table rows past 2^31 entries, and check the
kernels against their torch twins.

How, with little real memory: each pool or table is an anonymous private ``mmap`` (``MAP_NORESERVE``)
of up to 16 GiB of address space, wrapped without a copy by ``torch.frombuffer``. Linux backs a
page of it only once it is written, and reads of untouched pages return the shared zero page, so a
test touches a few MB. Triton's interpreter reads and writes raw addresses and does integer
arithmetic in numpy at the widths the compiled kernel uses (an int32 product wraps), so a 32-bit
offset goes wrong here as it would on a GPU: ``test_the_construction_catches_a_32_bit_offset`` shows
it with a kernel that forms its offset in 32 bits on purpose.

Wrapped offsets land on decoys, so a 32-bit bug fails an assertion instead of crashing: a byte
offset ``2^34 + x`` (``x < 2^31``) wraps to ``x``, the start of the same mapping, and so does the word
index ``2^32 + x / 4``; there the tests plant records with the same tags but other keys and values
(or sentinel bytes that must stay unchanged). Page tables are ``as_strided`` views whose rows sit
``b * (2^31 - 2^20)`` entries apart (or the same per KV head): the stride fits in an int32, the
offset of row 2 does not, and it wraps to ``-2^21``, still inside the mapping because the view
starts 2^22 entries in, on a row of decoy page ids.
"""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from hfkv.kernels.environment import interpreter_on

pytestmark = pytest.mark.skipif(
    not interpreter_on() or not sys.platform.startswith("linux"),
    reason="the sparse-mapping construction needs Triton's interpreter (CPU) and Linux's MAP_NORESERVE",
)

GIB = 1 << 30
WRAP = 1 << 32  # what a 32-bit offset loses
FAR = 1 << 34  # records lie past here: a byte offset or a 4-byte word index formed in 32 bits wraps to the start
ROW_STRIDE = (1 << 31) - (1 << 20)  # an int32 stride whose multiples by 2 pass 2^31
TABLE_BASE = 1 << 22  # table views start this many entries in, so a negative wrap stays inside the mapping
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value on x86-64 and arm64


def _sparse(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of ``nbytes`` backed by address space, not memory (module docstring)."""
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, OverflowError, ValueError) as exc:
        pytest.skip(f"no sparse mapping of {nbytes / GIB:.1f} GiB here: {exc}")
    return torch.frombuffer(buf, dtype=dtype)  # holds the mapping alive


def _wrap32(x: int) -> int:
    """``x`` as an int32 computation would leave it."""
    return (x + (1 << 31)) % WRAP - (1 << 31)


def _layout(key: str, value: str, dim: int = 32, dtype: torch.dtype = torch.float32):
    from hfkv.quant.formats import QuantFormat
    from hfkv.quant.record import RecordLayout

    return RecordLayout(QuantFormat(key, dim, 32, dtype), QuantFormat(value, dim, 32, dtype))


# ------------------------------------------------------------------------------------------- control
def test_the_construction_catches_a_32_bit_offset():
    """A kernel that multiplies page by page size in int32 reads the decoy; the same in int64 reads the record."""
    import triton
    import triton.language as tl

    @triton.jit
    def read(pool_ptr, page_ptr, page_bytes, out_ptr, WIDE: tl.constexpr):
        page = tl.load(page_ptr)
        if WIDE:
            at = page.to(tl.int64) * page_bytes
        else:
            at = page * page_bytes
        tl.store(out_ptr, tl.load(pool_ptr + at))

    page_bytes = 4096
    pool = _sparse(WRAP + 2 * page_bytes, torch.uint8)
    page = WRAP // page_bytes  # page * page_bytes == 2^32: 0 in 32 bits
    pool[page * page_bytes] = 7  # the record
    pool[0] = 99  # the decoy a wrapped offset reads
    got = {}
    for wide in (True, False):
        out = torch.zeros(1, dtype=torch.uint8)
        read[(1,)](pool, torch.tensor([page], dtype=torch.int32), page_bytes, out, WIDE=wide)
        got[wide] = int(out)
    assert got == {True: 7, False: 99}


# -------------------------------------------------------------------------------------- decode attention
def _place(pool: torch.Tensor, rec: torch.Tensor, pages: torch.Tensor, page_bytes: int, lay, shift: int = 0):
    """Write records ``rec [B, H, n, nbytes]`` into their pages ``pages [B, H, W]`` (slot i: page i // tpp)."""
    n, tpp = rec.shape[2], lay.records_per_page(page_bytes)
    i = torch.arange(n)
    at = pages.long()[..., i // tpp] * page_bytes + (i % tpp) * lay.stride  # [B, H, n]
    pool[lay.record_index(at.reshape(-1), page_bytes) + shift] = rec.reshape(-1, lay.nbytes)


def _paged_case(bsz: int, heads: int, axis: str, seed: int = 0, dim: int = 32, dtype: torch.dtype = torch.float32):
    """Three paged tiers (model fp32, K4V2, fp8: every dequant family) past 2^34 bytes, with decoys.

    ``axis`` picks the table stride that passes 2^31 entries: ``"batch"`` (rows ``b * ROW_STRIDE``) or
    ``"head"`` (``h * ROW_STRIDE``).
    """
    from hfkv.kernels.parts import PagedSlots
    from hfkv.storage.paged import auto_page_bytes

    g = torch.Generator().manual_seed(seed)
    counts = (21, 37, 13)  # tokens per (row, head) and tier: last pages part-filled
    layouts = [_layout(k, v, dim, dtype) for k, v in (("model", "model"), ("int4", "int2"), ("fp8", "fp8"))]
    page_bytes = auto_page_bytes([lay.nbytes for lay in layouts])
    tpps = [page_bytes // lay.nbytes for lay in layouts]
    widths = [-(-n // t) for n, t in zip(counts, tpps, strict=True)]
    length = sum(counts) + 3
    n_pages = bsz * heads * sum(widths)
    first = -(-FAR // page_bytes)  # the first page whose offset passes 2^34
    pool_flat = _sparse(FAR + 4 * n_pages * page_bytes + (1 << 20), torch.uint8)
    pool = pool_flat[: (first + 2 * n_pages) * page_bytes].view(-1, page_bytes)
    table_flat = _sparse(4 * (TABLE_BASE + 2 * ROW_STRIDE + 4096), torch.int32)
    sb, sh = (ROW_STRIDE, 64) if axis == "batch" else (heads * ROW_STRIDE, ROW_STRIDE)
    assert (bsz if axis == "batch" else heads) >= 3  # row 2 is the one whose offset wraps

    perm = torch.stack([torch.randperm(length - 3, generator=g) for _ in range(bsz * heads)]).view(bsz, heads, -1)
    parts = []
    start, next_page = 0, first
    for t, (lay, n, tpp, w) in enumerate(zip(layouts, counts, tpps, widths, strict=True)):
        pos = perm[..., start : start + n]
        start += n
        score = torch.rand(bsz, heads, n, generator=g)

        def records(lay=lay, pos=pos, score=score, n=n):
            k = torch.randn(bsz, heads, n, dim, generator=g) * 2
            v = torch.randn(bsz, heads, n, dim, generator=g)
            return lay.encode(k.to(dtype), v.to(dtype), pos, score)

        real = torch.arange(next_page, next_page + bsz * heads * w, dtype=torch.int32).view(bsz, heads, w)
        fake = real + n_pages  # pages a wrapped table row names: same tags, other keys and values
        next_page += bsz * heads * w
        _place(pool_flat, records(), real, page_bytes, lay)
        _place(pool_flat, records(), fake, page_bytes, lay)
        _place(pool_flat, records(), real, page_bytes, lay, shift=-FAR)  # where a wrapped pool offset lands
        base = TABLE_BASE + 64 * t
        table = table_flat.as_strided((bsz, heads, w), (sb, sh, 1), base)
        table.copy_(real)
        for b in range(bsz):
            for h in range(heads):
                row = b * sb + h * sh
                if _wrap32(row) != row:
                    at = base + _wrap32(row)
                    assert not table_flat[at : at + w].any(), "a decoy row overlaps a real one"
                    table_flat[at : at + w] = fake[b, h]
        assert torch.equal(table, real)  # the decoys left every real row as it was
        parts.append(PagedSlots(pool, table, tpp, lay))
    decoys = [
        (0, (first + 2 * n_pages) * page_bytes - FAR),
        (first * page_bytes + n_pages * page_bytes, (first + 2 * n_pages) * page_bytes),
    ]
    return parts, decoys, length, pool_flat


def _scores(part) -> torch.Tensor:
    return part.pool.view(torch.float32).view(-1)[part.score_offsets() // 4]


@pytest.mark.parametrize(
    "axis,dim,dtype,launch",
    [("batch", 32, torch.float32, {}), ("head", 32, torch.float32, {}),
     ("head", 64, torch.float16, {"code_dots": 3})],  # the products from codes' own loads (keys' and values' pieces)
)  # fmt: skip
def test_decode_attention_reads_and_scores_past_2_to_the_34(axis, dim, dtype, launch):
    from hfkv.kernels.decode_attention import paged_attention, paged_attention_reference, plan_attention

    bsz, heads, group = (3, 1, 2) if axis == "batch" else (1, 3, 2)
    parts, decoys, length, pool_flat = _paged_case(bsz, heads, axis, dim=dim, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    query = torch.randn(bsz, heads * group, 1, dim, generator=g).to(dtype)
    pad_end = torch.zeros(bsz, dtype=torch.int64)
    q_start, scaling = length - 1, dim**-0.5
    before = [_scores(p) for p in parts]
    decoy_bytes = [pool_flat[a:b].clone() for a, b in decoys]
    assert all(d.any() for d in decoy_bytes)
    if launch:
        assert plan_attention(query, parts, pad_end, **launch).constants["CODE_DOTS"] == launch["code_dots"]
    want, want_delta = paged_attention_reference(query, parts, q_start, pad_end, scaling, "max", add_scores=False)
    got, delta = paged_attention(query, parts, q_start, pad_end, scaling, "max", add_scores=True, **launch)
    exact = dtype == torch.float32  # fp16: the products' operands rounded to it
    torch.testing.assert_close(got, want, **(dict(atol=2e-6, rtol=1e-5) if exact else dict(atol=1e-2, rtol=1e-2)))
    tol = dict(atol=1e-6, rtol=1e-5) if exact else dict(atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(delta, want_delta, **tol)
    assert float(delta.sum()) > 0
    col = 0
    for part, old in zip(parts, before, strict=True):  # scores added where the records lie, nowhere else
        torch.testing.assert_close(_scores(part), old + delta[..., col : col + part.slots], atol=1e-6, rtol=1e-5)
        col += part.slots
    for (a, b), old in zip(decoys, decoy_bytes, strict=True):
        assert torch.equal(pool_flat[a:b], old), "a decoy was written: some offset wrapped"


# --------------------------------------------------------------------------------- encode, move, clear
@pytest.mark.parametrize("key,value,dtype", [("model", "model", torch.bfloat16), ("int4", "int2", torch.float16),
                                             ("fp8", "int8", torch.float32)])  # fmt: skip
def test_encode_write_past_2_to_the_34(key, value, dtype):
    from hfkv.kernels.encode import encode_write

    layout = _layout(key, value, 64, dtype)
    n = 5
    pool = _sparse(FAR + (1 << 20), torch.uint8).view(-1, 4096)
    flat = pool.view(-1)
    assert layout.records_per_page(4096) > 2 * n
    dest = FAR + layout.stride * (1 + 2 * torch.arange(n))  # every other slot of the page at 2^34
    span = layout.record_index(dest, 4096)
    flat[span - FAR] = 0xA5  # sentinels where a wrapped destination would write
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(n, 64, generator=g) * 3).to(dtype), torch.randn(n, 64, generator=g).to(dtype)
    pos, score = torch.randint(0, 1 << 20, (n,), generator=g), torch.rand(n, generator=g)
    encode_write(pool, dest, layout, k, v, pos, score)
    assert torch.equal(flat[span], layout.encode(k, v, pos, score))
    assert bool((flat[span - FAR] == 0xA5).all())


def test_move_records_and_clear_tags_past_2_to_the_34():
    from hfkv.kernels.move import clear_tags, move_records

    rec_bytes, n = 44, 6
    pool = _sparse(FAR + (1 << 20), torch.uint8).view(-1, 4096)
    flat = pool.view(-1)
    g = torch.Generator().manual_seed(2)
    src = FAR + 64 + 48 * torch.arange(n)
    dst = FAR + 8192 + 48 * torch.arange(n)
    e = torch.arange(rec_bytes)
    flat[src[:, None] + e] = torch.randint(1, 256, (n, rec_bytes), generator=g, dtype=torch.uint8)
    flat[src[:, None] + e - FAR] = torch.randint(1, 256, (n, rec_bytes), generator=g, dtype=torch.uint8)
    flat[dst[:, None] + e - FAR] = 0x5A
    moved = flat[src[:, None] + e].clone()
    move_records(pool, src, dst, rec_bytes)
    assert torch.equal(flat[dst[:, None] + e], moved)
    assert bool((flat[dst[:, None] + e - FAR] == 0x5A).all())

    at = dst + 40  # the tags of the moved records
    clear_tags(pool, at)
    words = at[:, None] + torch.arange(4)
    assert not flat[words].any()
    assert bool((flat[words - FAR] == 0x5A).all())
    assert torch.equal(flat[dst[:, None] + torch.arange(40)], moved[:, :40])  # only the tags changed
