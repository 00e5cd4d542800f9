"""``load_int_pieces`` against the formats' torch decode: every integer format, both halves' reads (64-bit words
where records start on 8 bytes, 16-bit halves where on 4), fp32 and the fp16 form (``HALF``: codes in an fp16
mantissa, scale and zero applied in fp16; on compiled code also as PTX, ``HALF`` 2), dead rows reading zeros. Compiled
too (the name holds "triton")."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hfkv.kernels.dequant import load_int_pieces, piece_columns, piece_width
from hfkv.kernels.environment import inline_ptx_ok
from hfkv.quant.formats import QuantFormat


@triton.jit
def _read_kernel(
    pool_ptr, rec_ptr, out_ptr, n_live, N: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    C: tl.constexpr, ALIGN: tl.constexpr, HALF: tl.constexpr, SPREAD: tl.constexpr,
):  # fmt: skip
    n = tl.arange(0, N)
    rec = tl.load(rec_ptr + n)
    x = load_int_pieces(pool_ptr, rec, n < n_live, 0, BITS, GROUP, D, C, ALIGN, HALF, SPREAD)
    cols = piece_columns(BITS, D, C, SPREAD)
    tl.store(out_ptr + n[:, None] * D + cols[None, :], x.to(tl.float32))


@pytest.mark.parametrize("spread", [True, False], ids=["spread", "unspread"])
@pytest.mark.parametrize("half", [0, 1, 2], ids=["fp32", "fp16", "fp16-ptx"])
@pytest.mark.parametrize("align", [8, 4])
@pytest.mark.parametrize("name,dim,group", [("int8", 64, 32), ("int4", 128, 32), ("int2", 64, 64), ("int4", 64, 16)])
def test_triton_int_pieces_read_what_the_format_encoded(name, dim, group, align, half, spread):
    if half == 2 and not inline_ptx_ok():
        pytest.skip("the fp16 form's PTX (HALF 2): the interpreter runs no inline assembly; compiled on an NVIDIA GPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt = QuantFormat(name, dim, group, torch.bfloat16)
    c = piece_width(fmt)
    assert c  # these formats are read in pieces
    n, n_live = 16, 13
    g = torch.Generator().manual_seed(dim + group)
    x = (torch.randn(n, dim, generator=g) * 3 + torch.randn(n, 1, generator=g)).to(torch.bfloat16)
    data = fmt.encode(x)
    stride = -(-fmt.nbytes // 8) * 8 + 8
    # records at offsets that are multiples of `align` (and, for 4, not of 8), in a pool with other bytes between
    offsets = torch.arange(n) * stride + (align if align == 4 else 8)
    pool = torch.randint(0, 256, (int(offsets[-1]) + stride + 16,), dtype=torch.uint8, generator=g)
    for i in range(n):
        pool[offsets[i] : offsets[i] + fmt.nbytes] = data[i]
    out = torch.full((n, dim), float("nan"), device=device)
    _read_kernel[(1,)](pool.to(device), offsets.to(device), out, n_live, N=n, BITS=fmt.bits, GROUP=group, D=dim, C=c,
                       ALIGN=align, HALF=half, SPREAD=spread)  # fmt: skip
    out = out.cpu()
    want = fmt.decode(data, torch.float32)
    assert (out[n_live:] == 0).all()
    if half:  # the fp16 form rounds the product and the sum to fp16 (twice at most): within 2 ulp of the largest
        tol = 2.0 ** -10 * want.abs().amax(dim=-1, keepdim=True)
        assert ((out[:n_live] - want[:n_live]).abs() <= tol[:n_live]).all()
    else:
        torch.testing.assert_close(out[:n_live], want[:n_live], atol=1e-6, rtol=1e-6)


def test_spread_moves_the_lanes_column_bit_to_bit_5_where_it_lies_above():
    """``SPREAD`` relabels the tile's columns of 8-word pieces at head_dim 128 (the two lanes of a piece told apart by
    column 64, now 32) and leaves head_dim 64 alone, where that bit is already 32 (docs/kernels.md, thirteenth
    lease): the columns' elements swap bits 5 and 6 of the column index, nothing else."""

    @triton.jit
    def cols_kernel(out_ptr, BITS: tl.constexpr, D: tl.constexpr, C: tl.constexpr, SPREAD: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, D), piece_columns(BITS, D, C, SPREAD))

    def cols(bits: int, dim: int, c: int, spread: bool) -> torch.Tensor:
        out = torch.empty(dim, dtype=torch.int32)
        cols_kernel[(1,)](out, BITS=bits, D=dim, C=c, SPREAD=spread)
        return out

    f = torch.arange(128)
    swapped = torch.where(((f & 32) > 0) != ((f & 64) > 0), f ^ 96, f)
    for bits in (8, 4, 2):
        plain = cols(bits, 128, 32, False)
        assert sorted(plain.tolist()) == list(range(128))
        assert torch.equal(cols(bits, 128, 32, True), plain[swapped])
    assert torch.equal(cols(4, 64, 32, True), cols(4, 64, 32, False))
