"""The paged decode-attention kernels against their torch twin: Triton (its interpreter on CPU, toy sizes)
and the C++ CPU kernel, which keeps the same contract.

Storage is built by the real ``PagedTiers`` (appends, then removals that leave vacated slots and
null-page padding), so the kernel reads exactly the layout the cache writes.
"""

from __future__ import annotations

import pytest
import torch

from hfkv.kernels.cpu.paged_decode import paged_attention_cpu
from hfkv.kernels.decode_attention import DenseSlots, PagedSlots, paged_attention, paged_attention_reference
from hfkv.kernels.environment import interpreter_on
from hfkv.quant.formats import QuantFormat
from hfkv.quant.record import RecordLayout
from hfkv.storage import PagedTiers

KERNELS = {
    # several splits and blocks; integer fields read in pieces (the default), as rows, per element; the page
    # table read one block ahead, where it is used, two blocks ahead (by default two where a tier is quantized);
    # the score pass in blocks of the default size and of 16 slots (several a part, across page boundaries); the
    # softmax denominators summed per column (the default) or per row every iteration
    "triton": lambda *a, **kw: paged_attention(*a, split_slots=32, block_n=16, table_ahead=1, **kw),
    "triton-rows": lambda *a, **kw: paged_attention(
        *a, split_slots=32, block_n=16, int_pieces=False, table_ahead=0, score_block=16, column_sums=False, **kw
    ),
    "triton-per-element": lambda *a, **kw: paged_attention(
        *a, split_slots=32, block_n=16, int_tile=False, int_pieces=False, table_ahead=2, **kw
    ),
    # integer fields dequantized in fp16 and their products in fp16 (the default for 16-bit queries; fp32 ones keep
    # IEEE products) or, here, dequantized in fp32 and rounded to the query's dtype for the products
    "triton-fp32-dequant": lambda *a, **kw: paged_attention(*a, split_slots=32, block_n=16, half_dequant=False, **kw),
    # both products straight from integer codes, scale and zero applied to the logits and probabilities (16-bit
    # queries; fp32 ones keep the dequantized tiles)
    "triton-code-dots": lambda *a, **kw: paged_attention(*a, split_slots=32, block_n=16, code_dots=3, **kw),
    "cpu": paged_attention_cpu,
}
kernels = pytest.mark.parametrize("kernel", list(KERNELS))


def _layout(key: str, value: str, dim: int, dtype: torch.dtype, group: int = 32) -> RecordLayout:
    group = min(group, dim)
    return RecordLayout(QuantFormat(key, dim, group, dtype), QuantFormat(value, dim, group, dtype))


def _storage(layouts, bsz, heads, dim, length, counts, page_bytes, seed):
    """Tiers whose heads hold very different numbers of tokens (``counts[t]``: max per head, 0 = empty tier)."""
    g = torch.Generator().manual_seed(seed)
    tiers = PagedTiers(layouts, bsz, heads, page_bytes)
    perm = torch.stack([torch.randperm(length - 8, generator=g) for _ in range(bsz * heads)]).view(bsz, heads, -1)
    start = 0
    for t, lay in enumerate(layouts):
        n = counts[t]
        if n == 0:
            continue
        pos = perm[..., start : start + n]
        start += n
        # Ragged: each head keeps a different random share, one head may keep none.
        keep = torch.rand(bsz, heads, n, generator=g) < torch.rand(bsz, heads, 1, generator=g)
        k = torch.randn(bsz, heads, n, dim, generator=g) * 2
        v = torch.randn(bsz, heads, n, dim, generator=g)
        score = torch.rand(bsz, heads, n, generator=g)
        tiers.append(t, lay.encode(k, v, pos, score), keep)
        # Remove some: holes are filled from the tail and vacated tags zeroed, as after an eviction.
        m = tiers.max_count(t)
        if m:
            tiers.remove(t, torch.rand(bsz, heads, m, generator=g) < 0.8)
    return tiers


def _window(bsz, heads, dim, dtype, length, cap, filled, seed):
    g = torch.Generator().manual_seed(seed + 1)
    pos = torch.full((cap,), -1, dtype=torch.int64)
    pos[:filled] = torch.arange(length - filled, length)
    k = (torch.randn(bsz, heads, cap, dim, generator=g) * 2).to(dtype)
    v = torch.randn(bsz, heads, cap, dim, generator=g).to(dtype)
    return k, v, pos, torch.rand(bsz, heads, cap, generator=g)


def _run(fn, query, tiers, layouts, win, q_start, pad_end, reduction, **kw):
    pool = tiers.pool.data.clone()
    score = win[3].clone()
    parts = [DenseSlots(win[0], win[1], win[2], score)]
    parts += [PagedSlots(pool, tiers.tables[t], tiers.tpp[t], lay) for t, lay in enumerate(layouts)]
    out, delta = fn(query, parts, q_start, pad_end, query.shape[-1] ** -0.5, reduction, **kw)
    return out, delta, pool, score


def _tier_scores(tiers, layouts, pool):
    """Score fields of every live slot, read through the torch storage code."""
    saved, tiers.pool.data = tiers.pool.data, pool
    try:
        return [tiers.read_meta(t)[1] for t in range(len(layouts))]
    finally:
        tiers.pool.data = saved


CASES = [
    # key, value, model dtype, head_dim, GQA ratio, queries, reduction, page bytes, counts (original, quantized)
    ("model", "model", torch.float32, 64, 1, 1, "max", None, (40, 0)),
    ("int4", "int2", torch.float32, 64, 2, 1, "max", None, (24, 56)),
    ("int8", "int4", torch.float16, 64, 4, 1, "mean", 1024, (30, 40)),
    ("int2", "int2", torch.bfloat16, 128, 2, 1, "l2", None, (10, 50)),
    ("fp8", "fp8", torch.float32, 128, 4, 1, "max", 4096, (16, 33)),
    ("int4", "fp8", torch.float16, 64, 1, 3, "mean", None, (20, 20)),
    ("int4", "int2", torch.bfloat16, 64, 4, 2, "max", 2048, (0, 60)),
    ("int8", "int8", torch.float32, 32, 2, 1, "max", 528, (12, 12)),
    ("int4", "int2", torch.float32, 32, 4, 20, "l2", None, (20, 30)),  # a chunk tiled over 3 query blocks
    # A chunk of 19 queries x 4 at a constant head dim: the CPU kernel's tiles of 64 and 12 rows, each 8 rows at a
    # time with transposed keys and 4 left over.
    ("int8", "int4", torch.float32, 64, 4, 19, "mean", None, (20, 30)),
    # SmolLM2's decode step: a 3-way group at head dim 64, whose three output rows the CPU kernel holds at once
    ("int8", "int4", torch.float32, 64, 3, 1, "max", None, (25, 45)),
]


@kernels
@pytest.mark.parametrize("key,value,dtype,dim,ratio,qlen,reduction,page_bytes,counts", CASES)
def test_decode_kernel_matches_torch_twin(kernel, key, value, dtype, dim, ratio, qlen, reduction, page_bytes, counts):
    bsz, heads, length = 2, 2, 120
    layouts = (_layout("model", "model", dim, dtype), _layout(key, value, dim, dtype))
    tiers = _storage(layouts, bsz, heads, dim, length, counts, page_bytes, seed=dim + ratio + qlen)
    win = _window(bsz, heads, dim, dtype, length, cap=12 + qlen, filled=7 + qlen, seed=3)
    g = torch.Generator().manual_seed(7)
    query = torch.randn(bsz, heads * ratio, qlen, dim, generator=g).to(dtype)
    pad_end = torch.tensor([0, 5])  # row 1 is left-padded: its first 5 positions are never attended
    q_start = length - qlen
    got = _run(KERNELS[kernel], query, tiers, layouts, win, q_start, pad_end, reduction)
    ref = _run(paged_attention_reference, query, tiers, layouts, win, q_start, pad_end, reduction)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[0], ref[0], **tol)
    # Probabilities (GQA-reduced, summed over the queries) agree to fp32 tolerance where the logits are
    # fp32 products; Triton's bf16 / fp16 products round q and k to the model dtype first (tensor cores).
    low = dtype == torch.float16 or dtype == torch.bfloat16 and not interpreter_on()
    rounded = kernel.startswith("triton") and low
    ptol = dict(atol=1e-3, rtol=1e-2) if rounded else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], **ptol)
    torch.testing.assert_close(got[3], ref[3], **ptol)  # the ring's score sums
    for a, b in zip(_tier_scores(tiers, layouts, got[2]), _tier_scores(tiers, layouts, ref[2]), strict=True):
        torch.testing.assert_close(a, b, **ptol)
    # Nothing but score fields changed: records, tags and the null page are untouched.
    changed = (got[2] != tiers.pool.data).view(-1).nonzero().squeeze(-1)
    assert changed.numel() > 0
    for t, lay in enumerate(layouts):
        if tiers.max_count(t):
            part = PagedSlots(got[2], tiers.tables[t], tiers.tpp[t], lay)
            live = tiers.pool.data.view(torch.int32).view(-1)[part.tag_offsets() // 4] > 0
            score_bytes = part.score_offsets()[live].unsqueeze(-1) + torch.arange(4)
            changed = changed[~torch.isin(changed, score_bytes.view(-1))]
    assert changed.numel() == 0
    assert (got[2][0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("key,value", [("int8", "int4"), ("int4", "int2")])
def test_triton_half_dequant_at_length_is_as_close_to_the_twin_as_fp32_dequant(dtype, key, value):
    """Over ~600 slots of Llama's head size, fp16 dequantization (``half_dequant``, the default) is as close to the
    torch twin's fp32 attention, by norm, as fp32 dequantization. An H200 sweep (kernel_variants_h200_run5.json,
    bf16) put the two forms 3% apart at 32k tokens, a gap the toy cases' elementwise tolerance (1e-2) would not see;
    eval/dequant_rounding.py places it on the fp32 form's values rounded to bf16. (bf16 queries run the fp16 form
    compiled only: the interpreter's bf16 products are fp32, so on a CPU the bf16 cases compare a form with
    itself.)"""
    bsz, heads, ratio, dim, length = 1, 1, 4, 128, 1200
    layouts = (_layout("model", "model", dim, dtype), _layout(key, value, dim, dtype))
    tiers = _storage(layouts, bsz, heads, dim, length, (200, 900), None, seed=11)
    win = _window(bsz, heads, dim, dtype, length, cap=16, filled=8, seed=4)
    query = torch.randn(bsz, heads * ratio, 1, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    pad_end = torch.zeros(bsz, dtype=torch.int64)
    args = (tiers, layouts, win, length - 1, pad_end, "max")
    twin = _run(paged_attention_reference, query.float(), *args)[0].float()

    def distance(**launch) -> float:
        out = _run(lambda *a, **kw: paged_attention(*a, **kw, **launch), query, *args)[0].float()
        return float((out - twin).norm() / twin.norm())

    default, half, fp32 = distance(), distance(half_dequant=True), distance(half_dequant=False)
    assert default == half
    assert fp32 < 1e-2  # the model dtype's rounding
    assert half <= max(1.5 * fp32, 2e-3), (half, fp32)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize(
    "case", [CASES[1], CASES[3], CASES[8], CASES[9]], ids=["int4-int2", "bf16-l2", "chunk", "chunk-tiles"]
)
def test_cpu_kernel_on_several_threads_matches_torch_twin(threads, case):
    """Threads share the (row, head) pairs; with min_split=16 every pair's slots are also cut into ranges
    (split-K, more threads than pairs at 7), whose maxima and sums are combined exactly. A chunk past TILE_ROWS
    rows (chunk-tiles) runs its tiles on the threads at once, the score sums added after them."""
    key, value, dtype, dim, ratio, qlen, reduction, page_bytes, counts = case
    bsz, heads, length = 2, 2, 120
    layouts = (_layout("model", "model", dim, dtype), _layout(key, value, dim, dtype))
    tiers = _storage(layouts, bsz, heads, dim, length, counts, page_bytes, seed=dim + qlen)
    win = _window(bsz, heads, dim, dtype, length, cap=12 + qlen, filled=7 + qlen, seed=3)
    query = torch.randn(bsz, heads * ratio, qlen, dim, generator=torch.Generator().manual_seed(9)).to(dtype)
    pad_end, q_start = torch.tensor([0, 5]), length - qlen
    ref = _run(paged_attention_reference, query, tiers, layouts, win, q_start, pad_end, reduction)
    for min_split in (16, 512):
        got = _run(paged_attention_cpu, query, tiers, layouts, win, q_start, pad_end, reduction,
                   threads=threads, min_split=min_split)  # fmt: skip
        tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got[0], ref[0], **tol)
        torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[3], ref[3], atol=1e-6, rtol=1e-5)
        for a, b in zip(_tier_scores(tiers, layouts, got[2]), _tier_scores(tiers, layouts, ref[2]), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cpu_kernel_splits_one_long_head_over_threads():
    """One row, one KV head, 2,000 slots: the split ranges' partial outputs and scores add up to the twin's."""
    dim, dtype = 64, torch.float32
    layouts = (_layout("model", "model", dim, dtype), _layout("int4", "int2", dim, dtype))
    tiers = _storage(layouts, 1, 1, dim, 2100, (300, 1700), None, seed=4)
    win = _window(1, 1, dim, dtype, 2100, cap=16, filled=9, seed=5)
    query = torch.randn(1, 4, 1, dim, generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(1, dtype=torch.long)
    ref = _run(paged_attention_reference, query, tiers, layouts, win, 2099, pad, "max")
    for threads in (2, 5):
        got = _run(paged_attention_cpu, query, tiers, layouts, win, 2099, pad, "max", threads=threads, min_split=64)
        torch.testing.assert_close(got[0], ref[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-5)
        for a, b in zip(_tier_scores(tiers, layouts, got[2]), _tier_scores(tiers, layouts, ref[2]), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cpu_kernel_reuses_its_scratch_whatever_it_holds():
    """The logits scratch outlives calls: a call after one that left NaN (or a larger case's values) in it
    still equals the twin, so the kernel writes every scratch value it reads."""
    from hfkv.kernels.cpu import paged_decode

    key, value, dtype, dim, ratio, qlen, reduction, page_bytes, counts = CASES[1]
    layouts = (_layout("model", "model", dim, dtype), _layout(key, value, dim, dtype))
    tiers = _storage(layouts, 2, 2, dim, 120, counts, page_bytes, seed=11)
    win = _window(2, 2, dim, dtype, 120, cap=13, filled=8, seed=3)
    query = torch.randn(2, 2 * ratio, qlen, dim, generator=torch.Generator().manual_seed(5))
    pad_end = torch.tensor([0, 5])
    ref = _run(paged_attention_reference, query, tiers, layouts, win, 119, pad_end, reduction)
    paged_decode._scratch(1 << 16).fill_(float("nan"))
    for _ in range(2):
        got = _run(paged_attention_cpu, query, tiers, layouts, win, 119, pad_end, reduction)
        torch.testing.assert_close(got[0], ref[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-5)
    assert paged_decode._scratch(1 << 16).data_ptr() == paged_decode._scratch(8).data_ptr()


def test_cpu_kernel_names_a_bad_thread_count():
    win = DenseSlots(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), torch.arange(4), None)
    with pytest.raises(ValueError, match="threads=0"):
        paged_attention_cpu(torch.zeros(1, 1, 1, 8), [win], 3, torch.zeros(1, dtype=torch.long), 1.0, threads=0)


@kernels
def test_masking_is_by_slot_position(kernel):
    """Causal + left padding from the tags alone: a slot at a future position or in padding gets nothing."""
    bsz, heads, dim, dtype = 2, 1, 32, torch.float32
    layouts = (_layout("model", "model", dim, dtype), _layout("int4", "int2", dim, dtype))
    tiers = _storage(layouts, bsz, heads, dim, 60, (20, 20), None, seed=1)
    win = _window(bsz, heads, dim, dtype, 60, cap=8, filled=8, seed=1)
    query = torch.randn(bsz, heads, 4, dim)
    pad_end = torch.tensor([0, 30])
    out, delta, pool, _ = _run(KERNELS[kernel], query, tiers, layouts, win, 56, pad_end, "max")
    pos = torch.cat([win[2].view(1, 1, -1).expand(bsz, heads, -1)] + [tiers.read_meta(t, tiers.max_slots(t))[0].long()
                     for t in range(2)], -1)  # fmt: skip
    # The slot layout of delta is [window | tier slots (whole pages)]; read_meta pads with -1.
    assert delta.shape[-1] == pos.shape[-1]
    assert (delta[pos < 0] == 0).all()
    assert (delta[1][pos[1] < 30] == 0).all()
    assert (delta[pos >= 30] > 0).all()


@kernels
def test_a_query_that_sees_nothing_gives_zeros(kernel):
    bsz, heads, dim = 1, 1, 16
    layouts = (_layout("model", "model", dim, torch.float32), _layout("int4", "int2", dim, torch.float32, 16))
    tiers = PagedTiers(layouts, bsz, heads, None)
    win = _window(bsz, heads, dim, torch.float32, 10, cap=4, filled=2, seed=0)
    query = torch.randn(bsz, heads, 3, dim)
    # Queries at positions 7, 8, 9 with padding up to 9: the first two see no slot (positions 8, 9 only).
    out, delta, _, _ = _run(KERNELS[kernel], query, tiers, layouts, win, 7, torch.tensor([9]), "mean")
    assert (out[0, :2] == 0).all() and out[0, 2].abs().sum() > 0
    torch.testing.assert_close(delta[0, 0, :2].sum(), torch.tensor(1.0))


@kernels
def test_bad_input_is_named(kernel):
    fn = KERNELS[kernel]
    q = torch.randn(1, 2, 1, 16)
    win = DenseSlots(torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16), torch.arange(4))
    with pytest.raises(ValueError, match="reduction='sum'"):
        fn(q, [win], 3, torch.zeros(1, dtype=torch.long), 1.0, "sum")
    with pytest.raises(ValueError, match="pad_end"):
        fn(q, [win], 3, torch.zeros(2, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="query must be"):
        fn(q[0], [win], 3, torch.zeros(1, dtype=torch.long), 1.0)
    if kernel == "triton":
        with pytest.raises(ValueError, match="table_ahead=3; allowed: None, 0, 1, 2"):
            paged_attention(q, [win], 3, torch.zeros(1, dtype=torch.long), 1.0, table_ahead=3)
        with pytest.raises(ValueError, match="score_block=48; allowed: a power of two >= 16"):
            paged_attention(q, [win], 3, torch.zeros(1, dtype=torch.long), 1.0, score_block=48)
        allowed = r"max_registers=100; allowed: None \(per storage\), 0 \(the compiler's\) or one of \(64, "
        with pytest.raises(ValueError, match=allowed):
            paged_attention(q, [win], 3, torch.zeros(1, dtype=torch.long), 1.0, max_registers=100)


@kernels
def test_single_tokens_and_heads_of_very_different_sizes(kernel):
    """One token in a tier, a head holding nothing, a head holding several pages: per-head ragged reads."""
    bsz, heads, dim, dtype = 1, 3, 64, torch.float32
    layouts = (_layout("model", "model", dim, dtype), _layout("int4", "int2", dim, dtype))
    tiers = PagedTiers(layouts, bsz, heads, 1056)  # 4 exact or 14 quantized records per page
    g = torch.Generator().manual_seed(5)
    for t, lay in enumerate(layouts):
        n = 40
        k, v = torch.randn(bsz, heads, n, dim, generator=g), torch.randn(bsz, heads, n, dim, generator=g)
        pos = torch.randperm(80, generator=g)[:n].view(1, 1, n).expand(bsz, heads, n) + 0
        valid = torch.zeros(bsz, heads, n, dtype=torch.bool)
        valid[0, 0, :1] = True  # head 0: a single token
        valid[0, 2] = True  # head 2: every token (several pages); head 1: none
        tiers.append(t, lay.encode(k, v, pos, torch.rand(bsz, heads, n, generator=g)), valid)
    assert tiers.counts[0, :, 1].tolist() == [1, 0, 40] and tiers.max_pages(1) > 1
    win = _window(bsz, heads, dim, dtype, 90, cap=8, filled=1, seed=2)
    query = torch.randn(bsz, heads * 2, 1, dim, generator=g)
    pad = torch.zeros(1, dtype=torch.long)
    got = _run(KERNELS[kernel], query, tiers, layouts, win, 89, pad, "mean")
    ref = _run(paged_attention_reference, query, tiers, layouts, win, 89, pad, "mean")
    torch.testing.assert_close(got[0], ref[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-5)
    # Head 1 attends only its window token: probability 1 there, nothing anywhere else.
    torch.testing.assert_close(got[1][0, 1].sum(), torch.tensor(1.0))
    assert got[1][0, 1, 0] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_write_in_the_partial_pass_equals_writing_first(dtype):
    """A decode step's token handed to the kernel (``window_write``) is stored in the ring (keys, values,
    position) and attended to exactly as if the ring had been written before the call."""
    from hfkv.storage.window import PendingWrite

    bsz, heads, dim, ratio, length, cap, filled = 2, 2, 64, 2, 80, 12, 7
    layouts = (_layout("model", "model", dim, dtype), _layout("int4", "int2", dim, dtype))
    tiers = _storage(layouts, bsz, heads, dim, length, (24, 40), None, seed=5)
    k, v, pos, score = _window(bsz, heads, dim, dtype, length, cap, filled, seed=9)
    score[..., filled:] = 0  # empty slots hold no score (the ring's invariant)
    g = torch.Generator().manual_seed(3)
    new_k = torch.randn(bsz, 1, heads, dim, generator=g).to(dtype).transpose(1, 2)  # strided, as projections give
    new_v = torch.randn(bsz, 1, heads, dim, generator=g).to(dtype).transpose(1, 2)
    query = torch.randn(bsz, heads * ratio, 1, dim, generator=g).to(dtype)
    pad_end = torch.tensor([0, 5])

    def call(ring, write):
        pool = tiers.pool.data.clone()
        parts = [DenseSlots(*ring)]
        parts += [PagedSlots(pool, tiers.tables[t], tiers.tpp[t], lay) for t, lay in enumerate(layouts)]
        out, delta = paged_attention(
            query, parts, length, pad_end, dim**-0.5, "max", split_slots=32, block_n=16, window_write=write
        )
        return out, delta, pool

    written = [t.clone() for t in (k, v, pos, score)]
    written[0][:, :, filled], written[1][:, :, filled], written[2][filled] = new_k[:, :, 0], new_v[:, :, 0], length
    ref = call(written, None)
    ring = [t.clone() for t in (k, v, pos, score)]
    got = call(ring, PendingWrite(new_k, new_v, filled, length))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(ring, written[:3] + [written[3]], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # ring contents, scores included
    with pytest.raises(ValueError, match="window_write slot 12 is outside"):
        call([t.clone() for t in (k, v, pos, score)], PendingWrite(new_k, new_v, cap, length))


def _plan_inputs(layouts, dtype, bsz, length, counts, seed, heads=2, dim=64):
    """Paged parts over random storage, one a layout, and a one-token query and pad_end: what the launch-plan tests
    below hand ``plan_attention``."""
    tiers = _storage(layouts, bsz, heads, dim, length, counts, None, seed=seed)
    parts = [PagedSlots(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay) for t, lay in enumerate(layouts)]
    return parts, torch.zeros(bsz, heads * 2, 1, dim, dtype=dtype), torch.zeros(bsz, dtype=torch.long)


@pytest.mark.parametrize("dtype,half", [(torch.float16, True), (torch.float32, False)])
def test_triton_half_dequant_applies_to_16_bit_queries_only(dtype, half):
    """``half_dequant`` (the default) turns the fp16 form on where the products run in a 16-bit type (the cases
    above with fp16 queries run it, "triton-fp32-dequant" the other form), never for fp32 queries, whose products
    stay IEEE fp32."""
    from hfkv.kernels.decode_attention import ASM_DEQUANT, plan_attention
    from hfkv.kernels.environment import inline_ptx_ok

    layouts = (_layout("model", "model", 64, dtype), _layout("int8", "int4", 64, dtype))
    parts, query, pad_end = _plan_inputs(layouts, dtype, 2, 80, (20, 30), seed=1)
    default = plan_attention(query, parts, pad_end).constants["HALF"]
    off = plan_attention(query, parts, pad_end, half_dequant=False).constants["HALF"]
    # 1: the fp16 arithmetic in Triton; 2: as PTX, on compiled code for NVIDIA GPUs (the first lease after it found
    # this test comparing with True, which only the interpreter's 1 equals).
    want = (2 if ASM_DEQUANT and inline_ptx_ok() else 1) if half else 0
    assert (default, off) == (want, 0)


@pytest.mark.parametrize("dtype,code", [(torch.float16, 3), (torch.bfloat16, 3), (torch.float32, 0)])
def test_code_dots_apply_to_16_bit_products_only_and_read_the_table_one_ahead(dtype, code):
    """``code_dots`` reaches the kernel where the products run in a 16-bit type (under the interpreter bf16 queries
    keep fp32 products, so there it is off for them too), never for fp32 queries; it brings the page table one block
    ahead unless a table_ahead is given; a value outside 0-3 is named."""
    from hfkv.kernels.decode_attention import CODE_DOTS, plan_attention
    from hfkv.kernels.environment import interpreter_on

    layouts = (_layout("model", "model", 64, dtype), _layout("int4", "int2", 64, dtype))
    parts, query, pad_end = _plan_inputs(layouts, dtype, 2, 80, (20, 30), seed=1)
    want = 0 if dtype == torch.bfloat16 and interpreter_on() else code
    on = plan_attention(query, parts, pad_end, code_dots=3).constants
    assert plan_attention(query, parts, pad_end).constants["CODE_DOTS"] == CODE_DOTS == 0
    assert on["CODE_DOTS"] == want and on["TABLE_AHEAD"] == (1 if want else 2)
    assert plan_attention(query, parts, pad_end, code_dots=3, table_ahead=2).constants["TABLE_AHEAD"] == 2
    with pytest.raises(ValueError, match="code_dots=4; allowed: 0"):
        plan_attention(query, parts, pad_end, code_dots=4)


@pytest.mark.parametrize("key,value,group", [("int4", "int2", 32), ("int8", "int4", 32), ("int2", "int4", 64)])
def test_code_dots_at_length_are_as_close_to_the_twin_as_dequantized_tiles(key, value, group):
    """Over up to 1,100 slots a head of Llama's head size (several byte chunks and planes a field: int4 keys two chunks
    of two planes, int2 four planes of one; groups of 64 span two planes), products from codes give the default fp16
    tiles' output up to the order of the sums (the values dequantized are the same, one rounding each), and so lie as
    close to the torch twin's fp32 attention."""
    dtype, bsz, heads, ratio, dim, length = torch.float16, 1, 2, 4, 128, 1200
    layouts = (_layout("model", "model", dim, dtype), _layout(key, value, dim, dtype, group))
    tiers = _storage(layouts, bsz, heads, dim, length, (200, 900), None, seed=13)
    win = _window(bsz, heads, dim, dtype, length, cap=16, filled=8, seed=5)
    query = torch.randn(bsz, heads * ratio, 1, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    pad_end = torch.zeros(bsz, dtype=torch.int64)
    args = (tiers, layouts, win, length - 1, pad_end, "max")
    twin = _run(paged_attention_reference, query.float(), *args)

    def run(**launch):
        return _run(lambda *a, **kw: paged_attention(*a, **kw, **launch), query, *args)

    tiles, codes = run(), run(code_dots=3)
    dist = [float((o[0].float() - twin[0].float()).norm() / twin[0].float().norm()) for o in (tiles, codes)]
    assert dist[1] <= max(1.5 * dist[0], 2e-3), dist
    assert float((codes[0].float() - tiles[0].float()).norm() / tiles[0].float().norm()) < 2e-4
    for mine in run(code_dots=1), run(code_dots=2):  # each product alone
        assert float((mine[0].float() - twin[0].float()).norm() / twin[0].float().norm()) <= max(1.5 * dist[0], 2e-3)
    torch.testing.assert_close(codes[1], twin[1], atol=2e-3, rtol=2e-2)  # the slots' scores


def test_compiled_partial_pass_caps_registers_where_it_reads_integers(monkeypatch):
    """Compiled, the partial pass runs at ``INT_REGISTERS`` a thread where a part holds integer fields (four 4-warp
    programs an SM instead of three; docs/kernels.md) and at ``FULL_REGISTERS`` over full-precision pages alone (the
    compiler's choice by default, 0); 0 asks for no cap, and the interpreter, which has no registers, gets none."""
    from hfkv.kernels import decode_attention as da

    layouts = (_layout("model", "model", 64, torch.float16), _layout("int8", "int4", 64, torch.float16))
    (full, ints), query, pad_end = _plan_inputs(layouts, torch.float16, 2, 80, (20, 30), seed=1)

    def cap(parts, **kw):
        return da.plan_attention(query, parts, pad_end, **kw).constants.get("maxnreg")

    monkeypatch.setattr(da, "interpreter_on", lambda: True)
    assert cap([full, ints]) is None  # the interpreter's plan
    monkeypatch.setattr(da, "interpreter_on", lambda: False)
    full_cap = da.FULL_REGISTERS or None  # 0: the compiler's choice, no cap in the plan
    assert (cap([full]), cap([full, ints]), cap([ints])) == (full_cap, da.INT_REGISTERS, da.INT_REGISTERS)
    monkeypatch.setattr(da, "FULL_REGISTERS", 80)  # a cap over full-precision pages alone reaches the plan
    assert (cap([full]), cap([full, ints])) == (80, da.INT_REGISTERS)
    assert (cap([ints], max_registers=0), cap([full], max_registers=168)) == (None, 168)


def test_operand_fence_is_compiled_code_only_and_follows_the_triton_version():
    """The operand fence and the PTX dequantization are inline PTX, which neither the interpreter nor an AMD GPU runs:
    asked for there, the plan leaves them out (the same values reach the products; the compiled tests on a GPU run
    them). The fence's default is on for the Triton versions whose operand-width heuristic halves at a join (before
    3.8; docs/kernels.md)."""
    from hfkv.kernels import decode_attention as da
    from hfkv.kernels.environment import triton_version

    parts, query, pad_end = _plan_inputs((_layout("int8", "int4", 64, torch.float16),), torch.float16, 1, 40, (20,), 2)
    assert da.plan_attention(query, parts, pad_end, operand_fence=True).constants["FENCE"] is (not interpreter_on())
    assert da.plan_attention(query, parts, pad_end, operand_fence=False).constants["FENCE"] is False

    # the same for the dequantization's arithmetic as PTX (HALF 2; 1: written in Triton, 0: fp32 dequantization)
    def half(**kw):
        return da.plan_attention(query, parts, pad_end, **kw).constants["HALF"]

    assert (half(asm_dequant=True), half(asm_dequant=False)) == (1 if interpreter_on() else 2, 1)
    assert half(asm_dequant=True, half_dequant=False) == 0
    assert da.OPERAND_FENCE is (triton_version() < (3, 8)) and da.launch_defaults()["operand_fence"] is da.OPERAND_FENCE
    # ROCm builds of torch compile for AMD GPUs: no PTX there either
    from hfkv.kernels.environment import inline_ptx_ok

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        assert inline_ptx_ok() is (getattr(torch.version, "hip", None) is None)
        mp.setattr(torch.version, "hip", "6.2.0", raising=False)
        assert inline_ptx_ok() is False
        mp.setattr(torch.version, "hip", None, raising=False)
        assert inline_ptx_ok() is True
        mp.setenv("TRITON_INTERPRET", "1")
        assert inline_ptx_ok() is False
    assert [triton_version(v) for v in ("3.6.0", "3.7.1", "3.10.0+git1a2b", "3.8.0rc1", "4")] == [
        (3, 6), (3, 7), (3, 10), (3, 8), (4, 0)
    ]  # fmt: skip


@pytest.mark.parametrize("first_slot", [7, 11])  # 11: the second step's slot wraps to 0
def test_triton_device_step_replays_the_same_launch_for_the_next_token(first_slot):
    """With ``step`` the decode launches read the position and ring slot from the device and advance them, so
    the same call made twice (same tensors, same host numbers: what a CUDA graph replays), with the next
    token's query, keys and values copied into its inputs, is the next step exactly: output, scores, ring."""
    from hfkv.kernels.decode_attention import plan_attention, run_plan
    from hfkv.storage.window import PendingWrite

    bsz, heads, dim, ratio, length, cap, filled = 2, 2, 32, 2, 80, 12, 7
    layouts = (_layout("model", "model", dim, torch.float32), _layout("int8", "int4", dim, torch.float32))
    tiers = _storage(layouts, bsz, heads, dim, length, (24, 40), None, seed=5)
    k, v, pos, score = _window(bsz, heads, dim, torch.float32, length, cap, filled, seed=9)
    score[..., filled:] = 0
    g = torch.Generator().manual_seed(3)
    new = [
        (torch.randn(bsz, heads * ratio, 1, dim, generator=g), torch.randn(bsz, heads, 1, dim, generator=g),
         torch.randn(bsz, heads, 1, dim, generator=g))
        for _ in range(2)
    ]  # fmt: skip
    pad_end = torch.tensor([0, 5])
    slots = [first_slot, (first_slot + 1) % cap]

    def storage():
        ring = [t.clone() for t in (k, v, pos, score)]
        pool = tiers.pool.data.clone()
        parts = [DenseSlots(*ring)]
        parts += [PagedSlots(pool, tiers.tables[t], tiers.tpp[t], lay) for t, lay in enumerate(layouts)]
        plan = plan_attention(new[0][0], parts, pad_end, "max", split_slots=32, block_n=16, window_write=True)
        return ring, pool, plan

    ring, pool, plan = storage()  # host numbers, one call per step
    want = [
        run_plan(plan, q, length + i, pad_end, dim**-0.5, PendingWrite(nk, nv, slots[i], length + i))[0]
        for i, (q, nk, nv) in enumerate(new)
    ]
    ring_d, pool_d, plan_d = storage()  # the first step's call, made twice
    step = torch.tensor([length, first_slot])
    q_buf, k_buf, v_buf = (t.clone() for t in new[0])
    write = PendingWrite(k_buf, v_buf, first_slot, length)
    got, out_buf = [], torch.empty_like(want[0])  # the output written in place, as a replayed graph reads it
    for i, (q, nk, nv) in enumerate(new):
        q_buf.copy_(q), k_buf.copy_(nk), v_buf.copy_(nv)
        res = run_plan(plan_d, q_buf, length, pad_end, dim**-0.5, write, checked=i == 0, step=step, out=out_buf)[0]
        assert res is out_buf
        got.append(res.clone())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(ring_d + [pool_d], ring + [pool], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # ring (both tokens, scores) and the records' scores
    assert step.tolist() == [length + 2, (first_slot + 2) % cap]
    with pytest.raises(ValueError, match="q_start=81 differs from the window_write's pos=80"):
        run_plan(plan_d, q_buf, length + 1, pad_end, dim**-0.5, write, step=step)
    with pytest.raises(ValueError, match="step must be a contiguous int64"):
        run_plan(plan_d, q_buf, length, pad_end, dim**-0.5, write, step=step.int())
    with pytest.raises(ValueError, match=r"out is \(2, 1, 4, 32\) torch.float64 \(contiguous: True\); allowed"):
        run_plan(plan_d, q_buf, length, pad_end, dim**-0.5, write, out=out_buf.double())


def test_cpu_plan_describes_parts_once_and_refuses_copies():
    """A CpuPlan gives the kernel's results without describing the parts again; a part that would need a
    copy to describe (here a non-contiguous ring) gets no plan, since a copy would go stale."""
    from hfkv.kernels.cpu.paged_decode import plan_cpu

    bsz, heads, dim, ratio, length = 2, 2, 64, 2, 80
    layouts = (_layout("model", "model", dim, torch.float32), _layout("int4", "int2", dim, torch.float32))
    tiers = _storage(layouts, bsz, heads, dim, length, (24, 40), None, seed=5)
    win = _window(bsz, heads, dim, torch.float32, length, 12, 7, seed=9)
    query = torch.randn(bsz, heads * ratio, 1, dim, generator=torch.Generator().manual_seed(1))
    pad_end = torch.tensor([0, 5])

    def parts(ring):
        paged = [PagedSlots(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay) for t, lay in enumerate(layouts)]
        return [DenseSlots(*ring), *paged]

    plan = plan_cpu(query, parts(win))
    assert plan is not None
    ref = paged_attention_cpu(query, parts([t.clone() for t in win]), length, pad_end, dim**-0.5, add_scores=False)
    got = paged_attention_cpu(query, parts(win), length, pad_end, dim**-0.5, add_scores=False, plan=plan)
    torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)
    strided = (win[0].transpose(2, 3).contiguous().transpose(2, 3), *win[1:])  # same values, not contiguous
    assert plan_cpu(query, parts(strided)) is None


@pytest.mark.parametrize("key,value", [("model", "model"), ("int8", "int4"), ("int4", "int2"), ("fp8", "int4")])
@pytest.mark.parametrize("dim,dtype", [(128, torch.bfloat16), (64, torch.float32), (96, torch.float16)])
def test_field_alignment_hint_holds_for_every_record(key, value, dim, dtype):
    """The kernel tells the compiler each field start is a multiple of ``field_align`` (so its loads
    are vectors); the interpreter ignores that hint, so a wrong one would only show on a GPU."""
    from hfkv.kernels.decode_attention import _page_align, _paged_constants
    from hfkv.storage.paged import auto_page_bytes

    lays = [_layout("model", "model", dim, dtype), _layout(key, value, dim, dtype)]
    page_bytes = auto_page_bytes([lay.nbytes for lay in lays])
    pool = torch.zeros(3, page_bytes, dtype=torch.uint8)
    for lay in lays:
        fmt = _paged_constants(lay, _page_align(pool), page_bytes // lay.nbytes)
        k_align, v_align = fmt[13:15]
        tpp = page_bytes // lay.nbytes
        starts = torch.tensor([p * page_bytes + s * lay.stride for p in range(3) for s in range(tpp)])
        base = pool.data_ptr()
        assert ((base + starts) % k_align == 0).all() and ((base + starts + lay.key.nbytes) % v_align == 0).all()
    # the bf16 records of Llama's head size are 16-byte aligned (bodies of keys and values alone, tags and scores
    # in the page's regions): the hint is not a trivial 1, and 16-byte vector loads are allowed
    if dim == 128 and key == "model":
        assert _paged_constants(lays[0], _page_align(pool), 1)[13:15] == (16, 16)


def test_page_table_read_ahead_by_default_follows_the_measured_fastest():
    """Two blocks ahead where a paged part has an integer field, one where every field is full precision or fp8
    (the H100 sweep behind ``TABLE_AHEAD``)."""
    from hfkv.kernels.decode_attention import _table_ahead

    def parts(key, value, tokens=3):
        lay = _layout(key, value, 64, torch.float16)
        tiers = PagedTiers((lay,), 1, 1, None)
        if tokens:
            tiers.append(0, torch.zeros(1, 1, tokens, lay.nbytes, dtype=torch.uint8), torch.ones(1, 1, tokens).bool())
        return [PagedSlots(tiers.pool.data, tiers.tables[0], tiers.tpp[0], lay)]

    assert _table_ahead(parts("model", "model")) == 1
    assert _table_ahead(parts("fp8", "fp8")) == 1
    assert _table_ahead(parts("int4", "fp8")) == 2
    assert _table_ahead(parts("fp8", "int2")) == 2
    assert _table_ahead(parts("model", "model") + parts("int4", "int2", tokens=0)) == 1  # an empty tier runs nothing
    # products from codes read it one ahead: two ahead, the codes' asynchronous copies were not issued (sm_90 code)
    assert _table_ahead(parts("int4", "int2"), code_dots=3) == _table_ahead(parts("int4", "fp8"), code_dots=1) == 1

    # Warps follow the same rule (NUM_WARPS: 4 where an integer field is read, 8 otherwise), as a plan launches them
    from hfkv.kernels import decode_attention as da

    query, pad_end = torch.zeros(1, 2, 1, 64, dtype=torch.float16), torch.zeros(1, dtype=torch.int64)
    for fields, warps in [(("model", "model"), 8), (("fp8", "fp8"), 8), (("int4", "fp8"), 4), (("fp8", "int2"), 4)]:
        assert da.plan_attention(query, parts(*fields), pad_end).constants["num_warps"] == warps
    mixed = parts("model", "model") + parts("int4", "int2", tokens=0)
    assert da.default_num_warps(da._reads_integers(mixed)) == 8  # (two pools here: no plan)
    assert da.plan_attention(query, parts("int4", "fp8"), pad_end, num_warps=8).constants["num_warps"] == 8


def test_split_sizing_fills_one_wave_at_the_occupancy_a_register_cap_buys(monkeypatch):
    """A program's splits are sized to one wave on the device: 16 warps an SM uncapped (two programs of 8, as ncu
    measured on the H100), 65,536 registers over the cap's per program otherwise (three at 80, four at 64); the
    launch never asks for more programs than a wave holds, and a cap off a GPU changes nothing."""
    from hfkv.kernels import decode_attention as da

    monkeypatch.setattr(da, "_sm_count", lambda device: 132)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert da.programs_target(cuda, 8, None) == 264 and da.programs_target(cuda, 4, None) == 528
    assert da.programs_target(cuda, 8, 80) == 396 and da.programs_target(cuda, 8, 64) == 528
    assert da.programs_target(cuda, 4, 80) == 792 and da.programs_target(cpu, 8, 80) == da.SPLIT_PROGRAMS
    for pairs in (1, 8, 24, 64, 300):  # (row, KV head) pairs: batch x KV heads
        for target in (264, 396, 528):
            for n in (100, 8192, 32768):
                split = da._split_slots(n, pairs, 64, None, False, target)
                programs = pairs * -(-n // split)
                assert split % 64 == 0 and (programs <= max(target, pairs))
                # as many splits as the wave holds, short only by the rounding of a split to whole blocks
                assert programs // pairs >= min(-(-n // 64), target // pairs) // 2
    # Llama-3.1-8B at 32k x 8 (64 pairs): four splits a head uncapped, six under the cap of 80
    assert 32768 // da._split_slots(32768, 64, 64, None, False, 264) == 4
    assert -(-32768 // da._split_slots(32768, 64, 64, None, False, 396)) == 6
    assert da._split_slots(32768, 64, 64, 5000, False, 396) == 5056  # an explicit size wins, in whole blocks
