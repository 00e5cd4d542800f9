"""Records of given slots, decoded, in one launch: what a policy run reads of the tokens it demotes.

A demoted token is read from its slot, decoded to fp32 and re-encoded into its new tier. In torch the read is a
page lookup and a gather, the decode a score of operations per integer field (planes, scales, zeros, the
interleave back to natural order); a run demotes from up to two tiers, and on a GPU a run is bound by its
launches (docs/kernels.md, "Runs on a GPU"). Here one program decodes a block of slots, finding each record
through the page table, with ``load_field`` (the decode kernel's reader). The arithmetic is torch's, operation by
operation (the launch turns off the compiler's fused multiply-add), so the values are equal bit for bit: the
torch path of :meth:`hfkv.storage.paged.PagedTiers.gather_decoded` (``gather``, then ``RecordLayout.decode_kv``)
is the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfkv.kernels.dequant import format_constants, load_field
from hfkv.kernels.encode import check_pool
from hfkv.kernels.grid import cdiv
from hfkv.quant.record import RecordLayout

__all__ = ["gather_decode"]

_BLOCK_N = 16


@triton.jit(do_not_specialize=["n", "table_w", "heads", "tpp", "page_bytes", "code"])
def _gather_decode_kernel(
    pool_ptr, table_ptr, table_w, heads, b_ptr, h_ptr, s_ptr, n, tpp, page_bytes, k_ptr, v_ptr, pos_ptr, score_ptr,
    src_ptr, code, WHERE: tl.constexpr,
    K_FAM: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_DTYPE: tl.constexpr,
    V_FAM: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_DTYPE: tl.constexpr,
    V_OFF: tl.constexpr, REC: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = i < n
    if WHERE:  # only the rows of one source (a move plan's), the others left to their own launch
        live = live & (tl.load(src_ptr + i, mask=live, other=-1) == code)
    b = tl.load(b_ptr + i, mask=live, other=0).to(tl.int64)
    h = tl.load(h_ptr + i, mask=live, other=0).to(tl.int64)
    s = tl.load(s_ptr + i, mask=live, other=0).to(tl.int64)
    page = tl.load(table_ptr + (b * heads + h) * table_w + s // tpp, mask=live, other=0).to(tl.int64)
    page_at = page * page_bytes
    rec = page_at + (s % tpp) * REC
    d = tl.arange(0, BLOCK_D)
    out = i[:, None] * D + d[None, :]
    m = live[:, None] & (d < D)[None, :]
    k = load_field(pool_ptr, rec, live, 0, K_FAM, K_BITS, K_GROUP, K_DTYPE, D, BLOCK_D, N=BLOCK_N)
    tl.store(k_ptr + out, k, mask=m)
    v = load_field(pool_ptr, rec, live, V_OFF, V_FAM, V_BITS, V_GROUP, V_DTYPE, D, BLOCK_D, N=BLOCK_N)
    tl.store(v_ptr + out, v, mask=m)
    words = pool_ptr.to(tl.pointer_type(tl.int32))
    tag_at = (page_at + tpp * REC) // 4 + s % tpp  # the page's tag region, then its score region
    tag = tl.load(words + tag_at, mask=live, other=0)
    tl.store(pos_ptr + i, (tag - 1).to(tl.int64), mask=live)
    score = tl.load(pool_ptr.to(tl.pointer_type(tl.float32)) + tag_at + tpp, mask=live, other=0.0)
    tl.store(score_ptr + i, score, mask=live)


def gather_decode(
    pool: torch.Tensor, table: torch.Tensor, tpp: int, layout: RecordLayout, b: torch.Tensor, h: torch.Tensor,
    s: torch.Tensor,
    where: tuple[torch.Tensor, int] | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(k, v [n, D] fp32, pos [n] int64, score [n] fp32)`` of the live slots ``(b, h, s)`` of one tier
    (``table [B, H, W]`` its page table, ``tpp`` records per page), equal to ``PagedTiers.gather_decoded``'s torch
    path. With ``where=(source, code)`` only rows whose ``source`` is ``code`` are read (a move plan's rows of this
    tier), into ``out`` (the others keep what they hold)."""
    check_pool(pool, "gather_decode")
    n, dim = s.numel(), layout.key.head_dim
    if out is None:
        out = (torch.empty(n, dim, dtype=torch.float32, device=pool.device),
               torch.empty(n, dim, dtype=torch.float32, device=pool.device),
               torch.empty(n, dtype=torch.int64, device=pool.device),
               torch.empty(n, dtype=torch.float32, device=pool.device))  # fmt: skip
    k, v, pos, score = out
    if n == 0:
        return k, v, pos, score
    kc, vc = format_constants(layout.key), format_constants(layout.value)
    _gather_decode_kernel[(cdiv(n, _BLOCK_N),)](
        pool, table.contiguous(), table.shape[-1], table.shape[1], b.contiguous(), h.contiguous(), s.contiguous(), n,
        tpp, pool.shape[1], k, v, pos, score, s if where is None else where[0], 0 if where is None else where[1],
        WHERE=where is not None, K_FAM=kc["fam"], K_BITS=kc["bits"], K_GROUP=kc["group"], K_DTYPE=kc["dtype"],
        V_FAM=vc["fam"], V_BITS=vc["bits"], V_GROUP=vc["group"], V_DTYPE=vc["dtype"],
        V_OFF=layout.key.nbytes, REC=layout.stride, D=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=_BLOCK_N,
        enable_fp_fusion=False,  # code * scale + zero rounded twice, as torch computes it
    )  # fmt: skip
    return k, v, pos, score
