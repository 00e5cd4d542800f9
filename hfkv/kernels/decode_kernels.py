"""The three Triton programs of decode attention (flash-decoding); :mod:`hfkv.kernels.decode_attention` plans
and launches them.

1. ``_partial_kernel``, one launch for every part (window ring, a chunk's exits, each tier; a part's
   pointers are a tuple, its sizes a row of the plan's ``meta`` tensor, its formats a constant tuple,
   ``_partial_part`` its code): a program
   owns a (row, KV head, split of slots, splits numbered across the parts) and all ``g * q`` query
   rows of that KV head (GQA packing, so each record is read once per group), computes masked
   logits, keeps an online softmax in fp32 and writes its partial max / sum / output, plus the
   logits themselves (4 bytes per slot and query row; keys are never read again).
2. ``_combine_kernel``: joins the splits of every part into one softmax per query row and writes
   the output in the query dtype.
3. ``_score_kernel``, one launch for every part (``_score_part``): turns the stored logits into
   probabilities, reduces them over the GQA group (``max`` / ``mean`` / ``l2``) and over the chunk's
   queries, and adds them to the slots' score sums in place (each page's score region, the ring's
   score array): the decode-time significance scores come out of the same pass, with no second
   read of K. Beyond the records, a step moves per slot the logits (written and read back,
   ``4 g q`` bytes each way) and the score's read-modify-write (8 bytes, in sectors shared by a
   page's slots: ``hfkv.quant.record``).

Masking is by logical position, from the slots' tags (``position + 1``, 0 = empty): a slot is
visible to query ``i`` iff it is not empty, not left padding (``pos >= pad_end[row]``) and not in
the future (``pos <= q_start + i``).

Every launch-shape choice (slots per iteration, integer pieces, half dequantisation, the operand fence,
code dots, the page table read ahead) reaches these programs as a ``tl.constexpr`` argument chosen by
the plan, so the programs hold no tuning state of their own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hfkv.kernels.code_products import code_columns, code_products, key_code_queries
from hfkv.kernels.dequant import load_field, load_int_pieces, operand_fence, piece_columns

# Each part's sizes and offsets reach the kernels as a row of a small int64 tensor (the plan's ``meta``),
# not as integer arguments: Triton specialises every integer it is handed inside a tuple (equal to 1, a
# multiple of 16) with no way to turn it off, so each policy run's new sizes compiled new kernel
# instances (the second H200 run: 1.7 s mean decode step, 29 ms median). Loaded, they never do.
META_COLS = 8
META = tl.constexpr(META_COLS)


@triton.jit
def _partial_part(
    q_ptr,
    pad_end_ptr,
    q_start,
    scaling,
    pool_ptr,
    page_bytes,
    part,  # (k, v, pos, table): pointers only (see _meta)
    meta_ptr,  # this part's row of the plan's meta: table_sb, table_sh, (tpp: FMTS), n_slots, split_slots, col0, split0
    sp,  # this program's split within the part
    logits_ptr,
    s_total,
    m_ptr,
    l_ptr,
    acc_ptr,
    ns_total,
    H,
    HQ,
    wk_ptr,
    wv_ptr,
    wk_sb,
    wk_sh,
    wv_sb,
    wv_sh,
    w_slot,
    w_pos,
    FMTS: tl.constexpr,  # every part's _part_constants: (PAGED, WRITE, REC, V_OFF, TAG_AT, K_FAM .. V_DTYPE)
    PI: tl.constexpr,  # this part's index in FMTS
    G: tl.constexpr,
    QLEN: tl.constexpr,
    QB: tl.constexpr,
    NQB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_T: tl.constexpr,
    INT_TILE: tl.constexpr,
    INT_PIECES: tl.constexpr,
    TABLE_AHEAD: tl.constexpr,
    HALF: tl.constexpr,
    COL_SUMS: tl.constexpr,
    FENCE: tl.constexpr,
    SPREAD: tl.constexpr,
    CODE_DOTS: tl.constexpr,
    PTX: tl.constexpr,
):
    """One program's split of one part: masked logits (stored), online softmax, partial max / sum / output."""
    k_ptr, v_ptr, pos_ptr, table_ptr = part[0], part[1], part[2], part[3]
    table_sb = tl.load(meta_ptr + 0)
    table_sh = tl.load(meta_ptr + 1)
    n_slots = tl.load(meta_ptr + 3).to(tl.int32)
    split_slots = tl.load(meta_ptr + 4).to(tl.int32)
    col0 = tl.load(meta_ptr + 5)
    split0 = tl.load(meta_ptr + 6).to(tl.int32)
    # The whole tuple and an index, not FMTS[i]: Triton 3.6 passes a tuple taken out of a constant to
    # a called function as loose Python values and fails to type them.
    FMT: tl.constexpr = FMTS[PI]
    PAGED: tl.constexpr = FMT[0]
    WRITE: tl.constexpr = FMT[1]
    REC: tl.constexpr = FMT[2]
    V_OFF: tl.constexpr = FMT[3]
    TAG_AT: tl.constexpr = FMT[4]  # the page's tag region
    K_FAM: tl.constexpr = FMT[5]
    K_BITS: tl.constexpr = FMT[6]
    K_GROUP: tl.constexpr = FMT[7]
    K_DTYPE: tl.constexpr = FMT[8]
    V_FAM: tl.constexpr = FMT[9]
    V_BITS: tl.constexpr = FMT[10]
    V_GROUP: tl.constexpr = FMT[11]
    V_DTYPE: tl.constexpr = FMT[12]
    K_ALIGN: tl.constexpr = FMT[13]
    V_ALIGN: tl.constexpr = FMT[14]
    K_PC: tl.constexpr = FMT[15] if INT_PIECES and K_FAM == 1 else 0  # piece width, 0: load_field
    V_PC: tl.constexpr = FMT[16] if INT_PIECES and V_FAM == 1 else 0
    # CODE_DOTS: products straight from the codes (hfkv.kernels.code_products), bit 0 the keys', bit 1 the values'
    K_CODE: tl.constexpr = K_PC > 0 and (CODE_DOTS & 1) > 0
    V_CODE: tl.constexpr = V_PC > 0 and (CODE_DOTS & 2) > 0
    K_HALF: tl.constexpr = HALF if K_PC > 0 else 0  # fp16 tiles and fp16 products (HALF_DEQUANT; 2: ASM_DEQUANT)
    V_HALF: tl.constexpr = HALF if V_PC > 0 else 0
    tpp: tl.constexpr = FMT[17]  # records per page
    bh = tl.program_id(0)
    qb = tl.program_id(2)
    b = bh // H
    h = bh % H
    r = tl.arange(0, BLOCK_R)
    gi = r // QB
    qi = qb * QB + r % QB
    row_ok = (gi < G) & (qi < QLEN)
    blk = bh * NQB + qb  # this program's block of query rows
    d = tl.arange(0, BLOCK_D)
    q_rows = ((b * HQ + h * G + gi) * QLEN + qi).to(tl.int64) * D
    if K_PC and not K_CODE:  # the keys' columns come in the pieces' order: the queries are read in it
        q_cols = piece_columns(K_BITS, D, K_PC, SPREAD)
    else:
        q_cols = d
    qf = tl.load(q_ptr + q_rows[:, None] + q_cols[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
    qf = qf.to(tl.float32) * scaling
    if K_CODE:  # the queries by piece, once
        q3 = key_code_queries(q_ptr, q_rows, row_ok, scaling, K_BITS, D, K_PC)
    pad_end = tl.load(pad_end_ptr + b)
    qpos = q_start + qi
    table_row = b.to(tl.int64) * table_sb + h.to(tl.int64) * table_sh  # 64-bit, as every pool offset

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    # COL_SUMS (COLUMN_SUMS): the softmax denominators are summed per column and reduced once at the end, where a
    # row sum per iteration crosses the warps through shared memory. The row maximum still does (every exponent
    # needs it).
    l_i = tl.zeros([BLOCK_R], tl.float32)
    l_acc = tl.zeros([BLOCK_R, BLOCK_N if COL_SUMS else 1], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    lo = sp * split_slots
    hi = tl.minimum(lo + split_slots, n_slots)
    if WRITE:  # the ring's new token: stored by the program whose range holds its slot, read from registers
        d_ok = d < D
        wk = tl.load(wk_ptr + b.to(tl.int64) * wk_sb + h.to(tl.int64) * wk_sh + d, mask=d_ok, other=0.0)
        wv = tl.load(wv_ptr + b.to(tl.int64) * wv_sb + h.to(tl.int64) * wv_sh + d, mask=d_ok, other=0.0)
        # Every operand of the masks below is a vector: the interpreter rejects a mask made with a scalar.
        slot_v = d * 0 + w_slot
        mine = (slot_v >= lo) & (slot_v < hi) & (d * 0 + qb == 0)
        w_row = (bh.to(tl.int64) * n_slots + w_slot) * D
        tl.store(k_ptr + w_row + d, wk, mask=d_ok & mine)
        tl.store(v_ptr + w_row + d, wv, mask=d_ok & mine)
        first = (d == 0) & mine & (d * 0 + bh == 0)  # positions are one row for all: one lane of one program
        tl.store(pos_ptr + slot_v, (w_pos + d * 0).to(tl.int64), mask=first)
    if PAGED and TABLE_AHEAD > 0:  # the pages of the first TABLE_AHEAD blocks
        s_ahead = lo + tl.arange(0, BLOCK_N)
        page_next = tl.load(table_ptr + table_row + s_ahead // tpp, mask=s_ahead < hi, other=0)
        if TABLE_AHEAD > 1:
            s_ahead += BLOCK_N
            page_after = tl.load(table_ptr + table_row + s_ahead // tpp, mask=s_ahead < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        in_range = s < hi
        if PAGED:
            # TABLE_AHEAD > 0: the page table is read that many iterations ahead. Read where it is used, each
            # record's copy waited on its table entry's load, one memory latency after another (sm_90: eight
            # per iteration); the compiler itself issues a block's copies an iteration early (num_stages 2).
            if TABLE_AHEAD == 0:
                page = tl.load(table_ptr + table_row + s // tpp, mask=in_range, other=0)
            elif TABLE_AHEAD == 1:
                page = page_next
                s_ahead = s + BLOCK_N
                page_next = tl.load(table_ptr + table_row + s_ahead // tpp, mask=s_ahead < hi, other=0)
            else:
                page = page_next
                page_next = page_after
                s_ahead = s + 2 * BLOCK_N
                page_after = tl.load(table_ptr + table_row + s_ahead // tpp, mask=s_ahead < hi, other=0)
            page_at = page.to(tl.int64) * page_bytes
            rec = page_at + (s % tpp).to(tl.int64) * REC
            words = pool_ptr.to(tl.pointer_type(tl.int32))
            tag = tl.load(words + (page_at + TAG_AT) // 4 + s % tpp, mask=in_range, other=0)
            if K_CODE:
                k = rec  # read by code_products below
            elif K_PC:
                k = load_int_pieces(pool_ptr, rec, in_range, 0, K_BITS, K_GROUP, D, K_PC, K_ALIGN, K_HALF, SPREAD)
            else:
                k = load_field(
                    pool_ptr, rec, in_range, 0, K_FAM, K_BITS, K_GROUP, K_DTYPE, D, BLOCK_D, BLOCK_N, INT_TILE, K_ALIGN
                )
            if V_CODE:
                v = rec  # read by code_products below
            elif V_PC:
                v = load_int_pieces(pool_ptr, rec, in_range, V_OFF, V_BITS, V_GROUP, D, V_PC, V_ALIGN, V_HALF, SPREAD)
            else:
                v = load_field(
                    pool_ptr, rec, in_range, V_OFF, V_FAM, V_BITS, V_GROUP, V_DTYPE, D, BLOCK_D, BLOCK_N, INT_TILE,
                    V_ALIGN,
                )  # fmt: skip
        else:
            tag = tl.load(pos_ptr + s, mask=in_range, other=-1).to(tl.int32) + 1
            rows = (bh.to(tl.int64) * n_slots + s) * D
            kv_mask = in_range[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            if WRITE:  # whatever this launch's store left there, the new slot's values are these
                is_new = s == w_slot
                k = tl.where(is_new[:, None], wk.to(tl.float32)[None, :], k)
                v = tl.where(is_new[:, None], wv.to(tl.float32)[None, :], v)
                tag = tl.where(is_new, w_pos + 1, tag)
        pos = tag - 1
        allowed = row_ok[:, None] & ((tag > 0) & (pos >= pad_end))[None, :] & (pos[None, :] <= qpos[:, None])
        if K_CODE:
            logits = code_products(q3, pool_ptr, rec, in_range, 0, K_BITS, K_GROUP, D, K_PC, K_ALIGN, PTX, True)
        elif DOT_T == tl.float32:
            logits = tl.dot(qf, tl.trans(k), input_precision="ieee")
        elif K_HALF:
            logits = tl.dot(qf.to(tl.float16), tl.trans(operand_fence(k, FENCE)))
        else:  # tensor cores, fp32 accumulation: the operands rounded to the model dtype, as SDPA's are
            logits = tl.dot(qf.to(DOT_T), tl.trans(operand_fence(k.to(DOT_T), FENCE and K_PC > 0)))
        logits = tl.where(allowed, logits, float("-inf"))
        lg_rows = (blk * (G * QB) + r).to(tl.int64) * s_total + col0  # valid rows only: r < G * QB
        tl.store(logits_ptr + lg_rows[:, None] + s[None, :], logits, mask=row_ok[:, None] & in_range[None, :])
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        if COL_SUMS:
            l_acc = l_acc * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        if V_CODE:
            o = code_products(p.to(tl.float16), pool_ptr, rec, in_range, V_OFF, V_BITS, V_GROUP, D, V_PC, V_ALIGN, PTX,
                              False)  # fmt: skip
            acc = acc * alpha[:, None] + o
        elif DOT_T == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        elif V_HALF:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), operand_fence(v, FENCE))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), operand_fence(v.to(DOT_T), FENCE and V_PC > 0))
        m_i = m_new
    out = (blk * ns_total + split0 + sp).to(tl.int64) * BLOCK_R + r
    tl.store(m_ptr + out, m_i)
    if COL_SUMS:
        l_i = tl.sum(l_acc, 1)
    tl.store(l_ptr + out, l_i)
    if V_CODE:  # the values' columns came in the pieces' tree order: each goes back to its element
        acc_cols = code_columns(V_BITS, D, V_PC)
    elif V_PC:  # the values' columns came in the pieces' order: each goes back to its element
        acc_cols = piece_columns(V_BITS, D, V_PC, SPREAD)
    else:
        acc_cols = d
    tl.store(acc_ptr + out[:, None] * BLOCK_D + acc_cols[None, :], acc)


# Integers that change between steps or policy runs stay runtime values (not specialised on value or
# divisibility by 16), so a new position or size never compiles a new kernel instance.
@triton.jit(
    do_not_specialize=[
        "q_start", "page_bytes", "s_total", "ns_total", "H", "HQ", "wk_sb", "wk_sh", "wv_sb", "wv_sh", "w_slot", "w_pos"
    ]
)  # fmt: skip
def _partial_kernel(
    q_ptr,
    pad_end_ptr,
    q_start,
    scaling,
    pool_ptr,
    page_bytes,
    parts,
    meta_ptr,
    logits_ptr,
    s_total,
    m_ptr,
    l_ptr,
    acc_ptr,
    ns_total,
    H,
    HQ,
    wk_ptr,
    wv_ptr,
    wk_sb,
    wk_sh,
    wv_sb,
    wv_sh,
    w_slot,
    w_pos,
    step_ptr,
    FMTS: tl.constexpr,
    NP: tl.constexpr,
    G: tl.constexpr,
    QLEN: tl.constexpr,
    QB: tl.constexpr,
    NQB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_T: tl.constexpr,
    INT_TILE: tl.constexpr,
    INT_PIECES: tl.constexpr,
    TABLE_AHEAD: tl.constexpr,
    HALF: tl.constexpr,
    COL_SUMS: tl.constexpr,
    FENCE: tl.constexpr,
    SPREAD: tl.constexpr,
    CODE_DOTS: tl.constexpr,
    PTX: tl.constexpr,
    DEV_STEP: tl.constexpr,
):
    """Every part in one launch: program (row x head, split, query block); splits are numbered across the
    parts in order, and each part's code (its formats are constants) runs for its own splits.

    ``DEV_STEP``: the decode step's position and ring slot are read from ``step_ptr`` (``[position, slot]``,
    advanced by the score kernel) instead of ``q_start`` / ``w_slot`` / ``w_pos``, so consecutive steps
    launch with the same arguments and one CUDA graph replays them all."""
    sp = tl.program_id(1)
    if DEV_STEP:
        q_at = tl.load(step_ptr).to(tl.int32)
        w_at = tl.load(step_ptr + 1).to(tl.int32)
        p_at = q_at
    else:
        q_at = q_start
        w_at = w_slot
        p_at = w_pos
    for i in tl.static_range(NP):
        part = parts[i]
        split0 = tl.load(meta_ptr + i * META + 6).to(tl.int32)
        n_splits = tl.load(meta_ptr + i * META + 7).to(tl.int32)
        if (sp >= split0) & (sp < split0 + n_splits):
            _partial_part(
                q_ptr, pad_end_ptr, q_at, scaling, pool_ptr, page_bytes, part, meta_ptr + i * META, sp - split0,
                logits_ptr,
                s_total, m_ptr, l_ptr, acc_ptr, ns_total, H, HQ, wk_ptr, wv_ptr, wk_sb, wk_sh, wv_sb, wv_sh,
                w_at, p_at, FMTS, i, G, QLEN, QB, NQB, BLOCK_R, D, BLOCK_D, BLOCK_N, DOT_T, INT_TILE,
                INT_PIECES, TABLE_AHEAD, HALF, COL_SUMS, FENCE, SPREAD, CODE_DOTS, PTX,
            )  # fmt: skip


@triton.jit(do_not_specialize=["ns_total", "H", "HQ"])
def _combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    ns_total,
    out_ptr,
    mf_ptr,
    lf_ptr,
    H,
    HQ,
    G: tl.constexpr,
    QLEN: tl.constexpr,
    QB: tl.constexpr,
    NQB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    qb = tl.program_id(1)
    blk = bh * NQB + qb
    b = bh // H
    h = bh % H
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    big_m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    big_l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for sp in range(0, ns_total):
        at = (blk * ns_total + sp).to(tl.int64) * BLOCK_R + r
        m_s = tl.load(m_ptr + at)
        l_s = tl.load(l_ptr + at)
        a_s = tl.load(acc_ptr + at[:, None] * BLOCK_D + d[None, :])
        m_new = tl.maximum(big_m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(big_m - m_safe)
        beta = tl.exp(m_s - m_safe)
        big_l = big_l * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        big_m = m_new
    # A query row that sees no slot (a padding query of a chunk) gets zeros, as in the torch path.
    o = tl.where((big_l > 0)[:, None], acc / tl.where(big_l > 0, big_l, 1.0)[:, None], 0.0)
    gi = r // QB
    qi = qb * QB + r % QB
    row_ok = (gi < G) & (qi < QLEN)
    o_rows = ((b * QLEN + qi) * HQ + h * G + gi).to(tl.int64) * D
    tl.store(out_ptr + o_rows[:, None] + d[None, :], o, mask=row_ok[:, None] & (d < D)[None, :])
    tl.store(mf_ptr + blk * BLOCK_R + r, big_m)
    tl.store(lf_ptr + blk * BLOCK_R + r, big_l)


@triton.jit
def _score_part(
    logits_ptr,
    s_total,
    mf_ptr,
    lf_ptr,
    delta_ptr,
    pool_ptr,
    page_bytes,
    part,  # (score, table): pointers only (see _meta)
    meta_ptr,  # this part's row of the plan's score meta: table_sb, table_sh, tpp, n_slots, col0
    j,  # this program's block of slots within the part
    H,
    FMTS: tl.constexpr,  # every part's (PAGED, ADD, REC): REC, a paged part's record body
    PI: tl.constexpr,  # this part's index in FMTS
    WRITE_DELTA: tl.constexpr,
    RED: tl.constexpr,
    G: tl.constexpr,
    QLEN: tl.constexpr,
    QB: tl.constexpr,
    NQB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One block of one part's slots: their probabilities, GQA-reduced, summed over the queries, added."""
    score_ptr, table_ptr = part[0], part[1]
    table_sb = tl.load(meta_ptr + 0)
    table_sh = tl.load(meta_ptr + 1)
    tpp = tl.load(meta_ptr + 2).to(tl.int32)
    n_slots = tl.load(meta_ptr + 3).to(tl.int32)
    col0 = tl.load(meta_ptr + 4)
    # The whole tuple and an index, not FMTS[i]: Triton 3.6 passes a tuple taken out of a constant to
    # a called function as loose Python values and fails to type them.
    FMT: tl.constexpr = FMTS[PI]
    PAGED: tl.constexpr = FMT[0]
    ADD: tl.constexpr = FMT[1]
    REC: tl.constexpr = FMT[2]
    bh = tl.program_id(0)
    s = j * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = s < n_slots
    if ADD:
        # The slots' score fields are found and read first, so the page table's latency and then the
        # scores' can run beside the logits' read. A page's scores lie side by side at its end (the
        # page's score region, RecordLayout): consecutive slots of a page share their sectors.
        # Every slot of the table's pages gets its delta, as in the torch path: empty slots (the null
        # page, vacated slots, page tails) were masked, so they receive exact zeros and stay as they
        # are; no tag needs reading again. Programs of different heads may add 0 to the null page at
        # once, which stores the same zeros whatever the order.
        if PAGED:
            table_row = (bh // H).to(tl.int64) * table_sb + (bh % H).to(tl.int64) * table_sh
            page = tl.load(table_ptr + table_row + s // tpp, mask=in_range, other=0)
            at = page.to(tl.int64) * page_bytes + tpp * (REC + 4)  # the page's score region
            sc = pool_ptr.to(tl.pointer_type(tl.float32)) + at // 4 + s % tpp
        else:
            sc = score_ptr + bh.to(tl.int64) * n_slots + s
        old = tl.load(sc, mask=in_range, other=0.0)
    r = tl.arange(0, BLOCK_R)
    delta = tl.zeros([BLOCK_S], tl.float32)
    for qb in range(0, NQB):
        blk = bh * NQB + qb
        row_ok = (r // QB < G) & (qb * QB + r % QB < QLEN)
        big_m = tl.load(mf_ptr + blk * BLOCK_R + r)
        big_l = tl.load(lf_ptr + blk * BLOCK_R + r)
        lg_rows = (blk * (G * QB) + r).to(tl.int64) * s_total + col0  # valid rows only: r < G * QB
        lg = tl.load(
            logits_ptr + lg_rows[:, None] + s[None, :],
            mask=row_ok[:, None] & in_range[None, :],
            other=float("-inf"),
        )
        seen = (lg > float("-inf")) & (big_l > 0)[:, None]
        m_safe = tl.where(big_m == float("-inf"), 0.0, big_m)
        p = tl.where(seen, tl.exp(lg - m_safe[:, None]) / tl.where(big_l > 0, big_l, 1.0)[:, None], 0.0)
        grouped = tl.reshape(p, [BLOCK_R // QB, QB, BLOCK_S])
        if RED == 0:
            red = tl.max(grouped, 0)
        elif RED == 1:
            red = tl.sum(grouped, 0) / G
        else:
            red = tl.sqrt(tl.sum(grouped * grouped, 0) / G)
        delta += tl.sum(red, 0)  # over the chunk's queries
    if WRITE_DELTA:
        tl.store(delta_ptr + bh.to(tl.int64) * s_total + col0 + s, delta, mask=in_range)
    if ADD:
        tl.store(sc, old + delta, mask=in_range)


@triton.jit(do_not_specialize=["s_total", "page_bytes", "H"])
def _score_kernel(
    logits_ptr,
    s_total,
    mf_ptr,
    lf_ptr,
    delta_ptr,
    pool_ptr,
    page_bytes,
    parts,
    meta_ptr,
    H,
    step_ptr,
    ring_slots,
    FMTS: tl.constexpr,
    NP: tl.constexpr,
    WRITE_DELTA: tl.constexpr,
    RED: tl.constexpr,
    G: tl.constexpr,
    QLEN: tl.constexpr,
    QB: tl.constexpr,
    NQB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DEV_STEP: tl.constexpr,
):
    """Every part in one launch: program (row x head, block of slots numbered across the parts).

    ``DEV_STEP``: program (0, 0) advances the step the partial kernel read (``[position + 1, (slot + 1) %
    ring_slots]``); every partial program has read it by now (the launches run in order)."""
    j = tl.program_id(1)
    if DEV_STEP:
        two = tl.arange(0, 2)
        cur = tl.load(step_ptr + two)
        nxt = tl.where(two == 0, cur + 1, (cur + 1) % ring_slots)
        # vector operands: the interpreter rejects a mask made of scalars
        first = (two * 0 + tl.program_id(0) == 0) & (two * 0 + j == 0)
        tl.store(step_ptr + two, nxt, mask=first)
    for i in tl.static_range(NP):
        part = parts[i]
        block0 = tl.load(meta_ptr + i * META + 5).to(tl.int32)
        n_blocks = tl.load(meta_ptr + i * META + 6).to(tl.int32)
        if (j >= block0) & (j < block0 + n_blocks):
            _score_part(
                logits_ptr, s_total, mf_ptr, lf_ptr, delta_ptr, pool_ptr, page_bytes, part, meta_ptr + i * META,
                j - block0, H,
                FMTS, i, WRITE_DELTA, RED, G, QLEN, QB, NQB, BLOCK_R, BLOCK_S,
            )  # fmt: skip
