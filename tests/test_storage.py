"""Paged tier storage, page pool, window ring and memory accounting (DESIGN §5 "Paged storage").

The core is a stateful test: random appends / removals / score updates / resets / row selections
on a ``PagedTiers`` with tiny pages, checked after every step against a shadow model (python
dicts of record bytes per (row, head, tier)) and against the page-accounting invariants.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hfkv.quant.formats import QuantFormat
from hfkv.quant.record import RecordLayout
from hfkv.storage import PagedTiers, PagePool, WindowRing, dense_kv_bytes, held_bytes
from hfkv.storage.pool import GROWTH, NULL_PAGE, RESERVED_PAGES

D = 16
BF16 = torch.bfloat16
LAYOUTS = (
    RecordLayout(QuantFormat("model", D, model_dtype=BF16), QuantFormat("model", D, model_dtype=BF16)),
    RecordLayout(QuantFormat("int4", D, 8, BF16), QuantFormat("int2", D, 8, BF16)),
)
MAX_PER_HEAD = 90  # keeps the per-step checks cheap; pages still fill and empty constantly


def test_layout_sizes():
    assert [lay.nbytes for lay in LAYOUTS] == [72, 36]


def _records(lay: RecordLayout, shape: tuple[int, ...], ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    k = torch.randn(*shape, D, generator=gen).to(BF16)
    v = (torch.randn(*shape, D, generator=gen) * 4).to(BF16)
    score = torch.randn(*shape, generator=gen) * 10
    return lay.encode(k, v, ids, score)


def _ceil_div(a, b):
    return -(-a // b)


def check_page_accounting(pt: PagedTiers) -> None:
    """(2) no page leaked or freed twice, (3) tables consistent with counts and exactly as wide as needed,
    (4) every slot past a head's count reads as empty (zero tag), so attention never sees it."""
    pool = pt.pool
    counts = pt.counts.numpy()
    assert pool.data.shape == (pool.num_pages, pool.page_bytes)
    assert pool.free_stack.numel() == pool.num_pages
    assert 0 <= pool.n_free <= pool.num_pages - RESERVED_PAGES
    tables = [t.numpy() for t in pt.tables]
    owned = np.concatenate([t[t != NULL_PAGE] for t in tables])
    free = pool.free_stack[: pool.n_free].numpy()
    every = np.sort(np.concatenate([owned, free]))
    assert np.array_equal(every, np.arange(RESERVED_PAGES, pool.num_pages)), "page leaked, duplicated or freed twice"
    assert not pool.data[NULL_PAGE].any(), "the null page must stay zero (padded reads decode it)"
    for t, tpp in enumerate(pt.tpp):
        table = tables[t]
        npages = _ceil_div(counts[..., t], tpp)  # [B, H]
        assert table.shape == (pt.batch, pt.heads, int(npages.max()) if npages.size else 0)
        col = np.arange(table.shape[-1])
        lead = col[None, None, :] < npages[..., None]
        assert (table[lead] != NULL_PAGE).all()
        assert (table[~lead] == NULL_PAGE).all()
        tags = pt.read_slots(t)[1].numpy()
        beyond = np.arange(tags.shape[-1])[None, None, :] >= counts[..., t][..., None]
        assert (tags[beyond] == 0).all(), "a slot past the count must read as empty"
        assert (tags[~beyond] > 0).all()
    assert pool.pages_in_use == int(pt.pages_per_head().sum()) == owned.size


# ----------------------------------------------------------------------------- state machine
class PagedTiersMachine(RuleBasedStateMachine):
    @initialize(
        batch=st.integers(2, 3),
        heads=st.integers(2, 4),
        page_bytes=st.sampled_from([72, 144, 216, 300]),
        initial_pages=st.integers(1, 4),
    )
    def setup(self, batch, heads, page_bytes, initial_pages):
        self.pt = PagedTiers(LAYOUTS, batch, heads, page_bytes, initial_pages=initial_pages)
        self.shadow = [[[{} for _ in LAYOUTS] for _ in range(heads)] for _ in range(batch)]
        self.next_id = 1
        self.slot_ids = [None] * len(LAYOUTS)  # refreshed by every invariant check

    # helpers
    def _slot_ids(self, tier: int) -> list[list[list[int]]]:
        """Current id of every live slot, per (b, h), as read (and verified) by the last invariant check."""
        return self.slot_ids[tier]

    # rules
    @rule(tier=st.integers(0, 1), n=st.integers(0, 8), p=st.sampled_from([0.0, 0.3, 0.8, 1.0]), seed=st.integers())
    def append(self, tier, n, p, seed):
        self._append(tier, n, p, seed)

    @rule(tier=st.integers(0, 1), n=st.integers(9, 40), seed=st.integers())
    def append_burst(self, tier, n, seed):
        self._append(tier, n, 0.9, seed)

    def _append(self, tier, n, p, seed):
        pt = self.pt
        n = max(0, min(n, MAX_PER_HEAD - pt.max_count(tier)))
        gen = torch.Generator().manual_seed(seed % 2**63)
        shape = (pt.batch, pt.heads, n)
        valid = torch.rand(shape, generator=gen) < p
        ids = torch.arange(self.next_id, self.next_id + valid.numel(), dtype=torch.int64).reshape(shape)
        self.next_id += valid.numel()
        recs = _records(LAYOUTS[tier], shape, ids, gen)
        pt.append(tier, recs, valid)
        recs_np, valid_np, ids_np = recs.numpy(), valid.numpy(), ids.numpy()
        for b, h, i in zip(*np.nonzero(valid_np), strict=True):
            self.shadow[b][h][tier][int(ids_np[b, h, i])] = recs_np[b, h, i].copy()

    @rule(
        tier=st.integers(0, 1),
        p_keep=st.sampled_from([0.0, 0.2, 0.6, 0.9, 1.0]),
        extra=st.integers(0, 3),
        seed=st.integers(),
    )
    def remove(self, tier, p_keep, extra, seed):
        pt = self.pt
        ids = self._slot_ids(tier)
        gen = torch.Generator().manual_seed(seed % 2**63)
        m = pt.max_count(tier) + extra
        keep = torch.rand(pt.batch, pt.heads, m, generator=gen) < p_keep
        if extra:  # slots beyond the count are not live: their keep flags must not matter
            keep[..., m - extra :] = True
        pt.remove(tier, keep)
        keep_np = keep.numpy()
        for b in range(pt.batch):
            for h in range(pt.heads):
                for s, rid in enumerate(ids[b][h]):
                    if not keep_np[b, h, s]:
                        del self.shadow[b][h][tier][rid]

    @rule(tier=st.integers(0, 1), extra=st.integers(0, 3), seed=st.integers())
    def add_scores(self, tier, extra, seed):
        pt = self.pt
        lay = LAYOUTS[tier]
        ids = self._slot_ids(tier)
        gen = torch.Generator().manual_seed(seed % 2**63)
        m = pt.max_count(tier) + extra
        delta = (torch.randn(pt.batch, pt.heads, m, generator=gen) * 3).float()
        delta[torch.arange(m) >= pt.counts[..., tier].unsqueeze(-1)] = 0.0  # the contract: zero past the count
        pt.add_scores(tier, delta)
        d_np = delta.numpy()
        so = lay.score_offset
        for b in range(pt.batch):
            for h in range(pt.heads):
                for s, rid in enumerate(ids[b][h]):
                    rec = self.shadow[b][h][tier][rid]
                    score = rec[so : so + 4].view(np.float32)
                    score += d_np[b, h, s]  # fp32 + fp32, as the storage does it

    @rule()
    def reset(self):
        self.pt.reset()
        for row in self.shadow:
            for head in row:
                for tier in head:
                    tier.clear()

    @rule(data=st.data())
    def select_rows(self, data):
        pt = self.pt
        index = data.draw(st.lists(st.integers(0, pt.batch - 1), min_size=1, max_size=3), label="index")
        pt.select_rows(torch.tensor(index, dtype=torch.long))
        self.shadow = [
            [[{k: r.copy() for k, r in tier.items()} for tier in self.shadow[b][h]] for h in range(pt.heads)]
            for b in index
        ]

    @precondition(lambda self: self.pt.pool.num_pages < 512)
    @rule()
    def grow_pool(self):
        # Demand more than is free: the pool must grow and keep every live page's bytes.
        pool = self.pt.pool
        before = pool.num_pages
        ids = pool.allocate(pool.n_free + 1)
        assert pool.num_pages == before + max(1, math.ceil(GROWTH * before))
        pool.release(ids)

    # checks after every step
    @invariant()
    def storage_matches_shadow(self):
        pt = self.pt
        assert pt.counts.shape == (pt.batch, pt.heads, len(LAYOUTS))
        counts = pt.counts.numpy()
        for t, lay in enumerate(LAYOUTS):
            rows, valid = pt.read(t)
            assert rows.shape[:3] == valid.shape and rows.shape[-1] == lay.nbytes
            rows_np, valid_np = rows.numpy(), valid.numpy()
            pos = lay.positions(rows).numpy()
            self.slot_ids[t] = [
                [pos[b, h, : counts[b, h, t]].tolist() for h in range(pt.heads)] for b in range(pt.batch)
            ]
            for b in range(pt.batch):
                for h in range(pt.heads):
                    n = int(counts[b, h, t])
                    exp = self.shadow[b][h][t]
                    assert n == len(exp)
                    assert valid_np[b, h, :n].all() and not valid_np[b, h, n:].any()
                    if not n:
                        continue
                    live = rows_np[b, h, :n]
                    ids = pos[b, h, :n]
                    order = np.argsort(ids, kind="stable")
                    want_ids = sorted(exp)
                    assert ids[order].tolist() == want_ids, "wrong or duplicated tokens in a head"
                    # Bit-identical records (K, V, pad, position and score) as a multiset.
                    want = np.stack([exp[i] for i in want_ids])
                    assert np.array_equal(live[order], want)

    @invariant()
    def pages_consistent(self):
        check_page_accounting(self.pt)


PagedTiersMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=70,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestPagedTiersStateful = PagedTiersMachine.TestCase


# ----------------------------------------------------------------------------- memory bound
def _live_bytes(pt: PagedTiers) -> int:
    return sum(int(pt.counts[..., t].sum()) * lay.nbytes for t, lay in enumerate(pt.layouts))


def _overhead(pt: PagedTiers) -> tuple[int, int, int]:
    used = pt.pool.pages_in_use * pt.pool.page_bytes
    meta = held_bytes([pt.counts, *pt.tables, pt.pool.free_stack])
    return used, _live_bytes(pt), meta


def _random_records(pt: PagedTiers, tier: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes with a valid (non-zero) tag: a zero tag would mean an empty slot."""
    lay = pt.layouts[tier]
    rec = torch.randint(0, 256, (pt.batch, pt.heads, n, lay.nbytes), generator=gen, dtype=torch.uint8)
    rec.view(torch.int32)[..., lay.pos_offset // 4] = torch.randint(1, 2**30, (pt.batch, pt.heads, n), generator=gen)
    return rec


def _fill(pt: PagedTiers, target: int, gen: torch.Generator, p_remove: float) -> int:
    """Append random amounts to random tiers (with random removals) until every head holds ``target``.

    Returns the peak number of pages in use along the way.
    """
    peak = pt.pool.pages_in_use
    while int(pt.counts.sum(-1).min()) < target:
        tier = int(torch.randint(0, 2, (), generator=gen))
        n = int(torch.randint(1, 17, (), generator=gen))
        need = (target - pt.counts.sum(-1)).clamp_min(0)  # [B, H]
        valid = torch.rand(pt.batch, pt.heads, n, generator=gen) < 0.8
        valid &= torch.arange(n) < need.unsqueeze(-1)
        pt.append(tier, _random_records(pt, tier, n, gen), valid)
        if float(torch.rand((), generator=gen)) < p_remove:
            t = int(torch.randint(0, 2, (), generator=gen))
            keep = torch.rand(pt.batch, pt.heads, pt.max_count(t), generator=gen) < 0.85
            pt.remove(t, keep)
        check_page_accounting(pt)
        peak = max(peak, pt.pool.pages_in_use)
    return peak


def test_memory_bound_small_pages():
    gen = torch.Generator().manual_seed(0)
    pt = PagedTiers(LAYOUTS, 2, 4, page_bytes=216, initial_pages=2)
    assert pt.tpp == [3, 6]
    peak = 0
    for _ in range(2):
        peak = max(peak, _fill(pt, 256, gen, p_remove=0.3))
        used, live, meta = _overhead(pt)
        assert used <= 1.05 * live + meta, (used, live, meta)
        # geometric growth keeps the pool's capacity within (1 + GROWTH) x of the peak demand
        assert pt.pool.num_pages - RESERVED_PAGES <= (1 + GROWTH) * peak + 1
        # heavy removal, then refill
        for t in range(2):
            pt.remove(t, torch.rand(pt.batch, pt.heads, pt.max_count(t), generator=gen) < 0.3)
        check_page_accounting(pt)
        used, live, meta = _overhead(pt)
        partial = sum((tpp - 1) * lay.nbytes for tpp, lay in zip(pt.tpp, LAYOUTS, strict=True))
        assert used <= live + pt.batch * pt.heads * partial  # at most one partial page per (b, h, tier)
    _fill(pt, 256, gen, p_remove=0.3)
    used, live, meta = _overhead(pt)
    assert used <= 1.05 * live + meta, (used, live, meta)
    pct = 100.0 * (used - live) / live
    print(f"storage overhead: {pct:.2f}%")
    print(
        f"  (head_dim 16, page_bytes 216, 2x4 heads x 256 tokens: pages in use {used} B over live records "
        f"{live} B; metadata {meta} B = {100.0 * meta / live:.2f}% more; "
        f"pool capacity {pt.pool.num_pages} pages, peak in use {peak})"
    )


@given(sizes=st.lists(st.integers(9, 1200).map(lambda n: 4 * n), min_size=1, max_size=3))
@settings(max_examples=60, deadline=None)
def test_auto_page_bytes_starts_pages_on_sectors_where_that_costs_little(sizes):
    """Against a brute force over every byte count: the page holds 8 of the largest record and tiles every tier
    within 1%; it is the smallest 32-byte multiple that does where that is at most 1/8 larger than the smallest
    multiple of the largest record that does (the page size before sectors counted), else that one."""
    from hfkv.storage.paged import PAGE_ALIGN, PAGE_GROWTH, auto_page_bytes

    def waste(page: int) -> float:
        return sum(page % r for r in sizes) / page

    def smallest(step: int) -> int | None:
        lo = -(-8 * max(sizes) // step) * step
        return next((p for p in range(lo, 16385, step) if waste(p) <= 0.01), None)

    page, packed, aligned = auto_page_bytes(sizes), smallest(max(sizes)), smallest(PAGE_ALIGN)
    assert page // max(sizes) >= 8
    if packed is not None and aligned is not None:
        assert page == (aligned if aligned <= PAGE_GROWTH * packed else packed)
        assert waste(page) <= 0.01
    if page % PAGE_ALIGN:
        assert aligned is None or aligned > PAGE_GROWTH * page


def test_auto_page_bytes_of_the_shapes_the_project_measures():
    """Llama-3.1-8B's bf16 and K4V2 records (the GPU lease's storage) start on sectors; SmolLM2's (head_dim 64) keep
    their 2,376-byte pages, which a sector-aligned page would grow by a third."""
    from hfkv.storage.paged import auto_page_bytes

    assert auto_page_bytes([520, 136]) == 5728 and auto_page_bytes([264, 72]) == 2376


def test_auto_page_bytes_names_a_bad_record_size():
    from hfkv.storage.paged import auto_page_bytes

    with pytest.raises(ValueError, match=r"record_sizes=\[520, 0\]"):
        auto_page_bytes([520, 0])


@pytest.mark.parametrize("page_bytes", [4096, None])
def test_memory_realistic_head_dim_128(page_bytes):
    """Default formats at head_dim 128. ``None`` (the config default) picks a page size that the
    520-byte and 136-byte records tile with < 1% tail waste; 4096 shows what a power of two costs."""
    hd, g = 128, 32
    layouts = (
        RecordLayout(QuantFormat("model", hd, model_dtype=BF16), QuantFormat("model", hd, model_dtype=BF16)),
        RecordLayout(QuantFormat("int4", hd, g, BF16), QuantFormat("int2", hd, g, BF16)),
    )
    assert [lay.nbytes for lay in layouts] == [520, 136]
    gen = torch.Generator().manual_seed(1)
    pt = PagedTiers(layouts, 1, 8, page_bytes=page_bytes)
    pb = pt.pool.page_bytes
    assert pt.tpp == ([7, 30] if page_bytes else [pb // 520, pb // 136])
    _fill(pt, 512, gen, p_remove=0.1)
    counts = pt.counts
    expect_pages = sum(int(_ceil_div(counts[..., t], tpp).sum()) for t, tpp in enumerate(pt.tpp))
    assert pt.pool.pages_in_use == expect_pages
    used, live, meta = _overhead(pt)
    assert used == expect_pages * pb
    pct = 100.0 * (used - live) / live
    if page_bytes is None:
        assert sum(pb % lay.nbytes for lay in layouts) / pb <= 0.01
        assert used <= 1.05 * live + meta, (used, live, meta)
    frac = float(counts[..., 0].sum()) / float(counts.sum())
    print(f"storage overhead (page_bytes={page_bytes} -> {pb}): {pct:.2f}%")
    print(
        f"  (head_dim 128 bf16 / int4-int2 g32, page {pb} B, 8 heads x 512 tokens, {100 * frac:.0f}% original: "
        f"pages in use {used} B over live records {live} B; metadata {meta} B = {100.0 * meta / live:.2f}% more; "
        f"tail waste per page {pb % 520} B (original) / {pb % 136} B (quantized))"
    )


# ----------------------------------------------------------------------------- window ring
@st.composite
def ring_scripts(draw):
    window = draw(st.integers(1, 6))
    ops = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("push"), st.integers(0, 2 * window + 2)),
                st.tuples(st.just("push"), st.just(1)),
                st.tuples(st.just("score"), st.integers(0, 2**16)),
            ),
            min_size=1,
            max_size=25,
        )
    )
    return draw(st.integers(1, 2)), draw(st.integers(1, 2)), window, ops


@settings(max_examples=120, deadline=None)
@given(ring_scripts())
def test_window_ring_against_deque(script):
    batch, heads, window, ops = script
    hd = 4
    ring = WindowRing(batch, heads, window, hd, torch.float16, "cpu")
    ref: collections.deque = collections.deque()  # (pos, k [B,H,D], v, score [B,H])
    next_pos = 0
    for op, arg in ops:
        if op == "score":
            gen = torch.Generator().manual_seed(arg)
            delta = torch.randint(-8, 9, (batch, heads, window), generator=gen).float()  # exact sums
            delta[:, :, ring.pos < 0] = 0  # add_scores' contract: attention gives empty slots exact zeros
            slots = ring.order().tolist()
            for j, slot in enumerate(slots):
                ref[j][3].add_(delta[:, :, slot])
            ring.add_scores(delta)
            continue
        n = arg
        pos = torch.arange(next_pos, next_pos + n)
        k = torch.arange(batch * heads * n * hd, dtype=torch.float32).reshape(batch, heads, n, hd) + next_pos * 100
        k = k.to(torch.float16)
        v = -k
        next_pos += n
        out_k, out_v, out_pos, out_score = ring.push(k, v, pos)
        for i in range(n):
            ref.append((int(pos[i]), k[:, :, i], v[:, :, i], torch.zeros(batch, heads)))
        fell = [ref.popleft() for _ in range(max(0, len(ref) - window))]
        m = len(fell)
        assert out_pos.tolist() == [f[0] for f in fell]
        assert out_k.shape == (batch, heads, m, hd) and out_score.shape == (batch, heads, m)
        for j, f in enumerate(fell):
            assert torch.equal(out_k[:, :, j], f[1]) and torch.equal(out_v[:, :, j], f[2])
            assert torch.equal(out_score[:, :, j], f[3])
        order = ring.order()
        assert ring.count == len(ref) == order.numel()
        assert ring.pos[order].tolist() == [r[0] for r in ref]
        for j, r in enumerate(ref):
            slot = int(order[j])
            assert torch.equal(ring.k[:, :, slot], r[1]) and torch.equal(ring.v[:, :, slot], r[2])
            assert torch.equal(ring.score[:, :, slot], r[3]), "a new slot must start with score 0"


def test_window_ring_pop_keeps_a_pending_token_unless_it_is_popped():
    """A policy run pops the oldest tokens while the step's own token is pending for the decode kernel: the pop
    returns the oldest as pushed and leaves the pending write to the kernel; popping it too writes it first."""
    g = torch.Generator().manual_seed(0)
    ring = WindowRing(1, 2, 3, 4, torch.float32, "cpu", extra=2)
    toks = [(torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)) for _ in range(5)]
    for p, (k, v) in enumerate(toks[:4]):
        ring.push(k, v, p)
    slot = ring.push_deferred(*toks[4], 4)
    k, v, pos, _ = ring.pop_oldest(2)
    assert ring.pending is not None and ring.pending.slot == slot and ring.count == 3
    assert pos.tolist() == [0, 1] and torch.equal(k, torch.cat([toks[0][0], toks[1][0]], dim=2))
    assert ring.raw()[2][slot] == -1  # not written: the kernel of this step writes it
    k, v, pos, _ = ring.pop_oldest(3)  # the pending token among them: written, then popped
    assert ring.pending is None and pos.tolist() == [2, 3, 4]
    assert torch.equal(k[:, :, 2:], toks[4][0]) and torch.equal(v[:, :, 2:], toks[4][1])


def test_window_ring_pops_as_views_what_pop_oldest_returns_and_leaves_the_same_ring():
    """A policy run takes its exits as views (``pop_oldest_views``) and empties their slots afterwards
    (``clear_popped``): what it reads and the ring it leaves are ``pop_oldest``'s, whether or not the popped slots
    wrap around the ring's end (then it gathers, as ``pop_oldest``); a change of the ring before the clear runs it.
    ``peek_oldest`` gives the same positions and scores beforehand, leaving the ring as it is."""
    g = torch.Generator().manual_seed(3)
    for extra in (0, 2, 3):
        a = WindowRing(2, 2, 4, 3, torch.float32, "cpu", extra=extra)
        b = WindowRing(2, 2, 4, 3, torch.float32, "cpu", extra=extra)
        wrapped = viewed = 0
        for p in range(60):
            k, v = torch.randn(2, 2, 1, 3, generator=g), torch.randn(2, 2, 1, 3, generator=g)
            for ring in (a, b):
                ring.push(k, v, p)
                ring.add_scores(torch.full((2, 2, ring.capacity), float(p)))
            n = int(torch.randint(0, a.count + 1, (1,), generator=g))
            wrap = a.start + n > a.capacity
            peeked = [x.clone() for x in b.peek_oldest(n)]  # what a run prepared a step ahead classifies
            got = b.pop_oldest_views(n)
            want = a.pop_oldest(n)
            assert torch.equal(peeked[0], want[2]) and torch.equal(peeked[1], want[3])
            viewed += (not wrap) and n > 0 and got[0]._base is b._k
            wrapped += wrap
            for x, y in zip(got, want, strict=True):
                assert torch.equal(x, y)
            if p % 2:
                b.clear_popped()  # else the next push must run it
        b.clear_popped()
        assert a.start == b.start and a.count == b.count
        for x, y in zip(a.raw(), b.raw(), strict=True):
            assert torch.equal(x, y)
        assert viewed > 0 and (extra == 0 or wrapped > 0)


def test_window_ring_rejects_empty_window():
    with pytest.raises(ValueError, match="window"):
        WindowRing(1, 1, 0, 4, torch.float16, "cpu")


# ----------------------------------------------------------------------------- held bytes
def test_held_bytes_counts_each_storage_once_with_capacity():
    base = torch.zeros(100, dtype=torch.float32)
    assert held_bytes([base]) == 400
    assert held_bytes([base, base[:10], base.view(10, 10), base[50:], base.view(torch.uint8)]) == 400
    assert held_bytes([base[:3]]) == 400  # a slice holds its whole storage
    other = torch.zeros(7, dtype=torch.bfloat16)
    assert held_bytes([base[10:20], other, None, other.view(7, 1)]) == 400 + 14
    assert held_bytes([]) == 0
    expanded = torch.zeros(1, 4).expand(1000, 4)  # a broadcast view holds only its 16 bytes
    assert held_bytes([expanded]) == 16


def test_held_bytes_of_paged_tiers_tracks_pool_capacity():
    pt = PagedTiers(LAYOUTS, 1, 2, page_bytes=216, initial_pages=2)
    gen = torch.Generator().manual_seed(3)
    pt.append(1, _random_records(pt, 1, 40, gen), torch.ones(1, 2, 40, dtype=torch.bool))
    pool = pt.pool
    assert pool.num_pages >= 14
    tables = sum(t.numel() * 4 for t in pt.tables)
    assert tables == 2 * math.ceil(40 / pt.tpp[1]) * 4  # one int32 per page in use, nothing for the empty tier
    expect = pool.num_pages * 216 + pool.free_stack.numel() * 4 + pt.counts.numel() * 8 + tables
    assert held_bytes(pt.held_tensors()) == expect
    pt.reset()  # pages return to the free stack; capacity is kept, tables shrink to nothing
    assert pool.n_free == pool.num_pages - RESERVED_PAGES
    assert held_bytes(pt.held_tensors()) == expect - tables


def test_dense_kv_bytes():
    assert dense_kv_bytes(2, 4, 10, 16, torch.bfloat16) == 2 * 2 * 4 * 10 * 16 * 2
    assert dense_kv_bytes(1, 1, 0, 128, torch.float32) == 0


# ----------------------------------------------------------------------------- misc
def test_page_size_validation():
    with pytest.raises(ValueError, match="page_bytes"):
        PagedTiers(LAYOUTS, 1, 1, page_bytes=64)
    with pytest.raises(ValueError, match="page_bytes"):
        PagePool(70)
    with pytest.raises(ValueError, match="n=-1"):
        PagePool(72).allocate(-1)
    with pytest.raises(ValueError, match="record size"):
        pt = PagedTiers(LAYOUTS, 1, 1, page_bytes=216)
        pt.append(0, torch.zeros(1, 1, 1, 36, dtype=torch.uint8), torch.ones(1, 1, 1, dtype=torch.bool))


def test_select_rows_repeated_rows_get_own_pages():
    gen = torch.Generator().manual_seed(5)
    pt = PagedTiers(LAYOUTS, 2, 2, page_bytes=144)
    pt.append(0, _random_records(pt, 0, 5, gen), torch.ones(2, 2, 5, dtype=torch.bool))
    before, _ = pt.read(0)
    pt.select_rows(torch.tensor([1, 1, 0]))
    check_page_accounting(pt)
    after, _ = pt.read(0)
    assert torch.equal(after, before[[1, 1, 0]])
    pt.remove(0, torch.tensor([[[False] * 5] * 2, [[True] * 5] * 2, [[True] * 5] * 2]))
    check_page_accounting(pt)
    rows, _ = pt.read(0)
    assert torch.equal(rows[1:], before[[1, 0]])


def test_read_slots_and_meta_agree_with_records_and_pad_with_finite_values():
    """The attention path's page-wise gather and the policy's metadata gather see exactly the live records."""
    gen = torch.Generator().manual_seed(5)
    pt = PagedTiers(LAYOUTS, 2, 3, page_bytes=216, initial_pages=1)

    def encoded(tier: int, n: int) -> torch.Tensor:  # real encodings: the only bytes storage ever holds
        lay = LAYOUTS[tier]
        k, v = (
            torch.randn(2, 3, n, lay.key.head_dim, generator=gen),
            torch.randn(2, 3, n, lay.key.head_dim, generator=gen),
        )
        return lay.encode(k, v, torch.randint(0, 1000, (2, 3, n), generator=gen), torch.rand(2, 3, n, generator=gen))

    def check_read_slots(tier: int) -> None:
        # The decode path's cached page list must follow every change of the tier, and only its tier:
        # compare with the slot-by-slot gather, which caches nothing.
        lay = LAYOUTS[tier]
        rows, valid = pt.read(tier)
        rec, tags = pt.read_slots(tier)
        pos = tags - 1
        m = rows.shape[2]
        assert torch.equal(pos[..., :m] >= 0, valid) and not (pos[..., m:] >= 0).any()
        assert torch.equal(rec[..., :m, :][valid][:, : lay.kv_bytes], rows[valid][:, : lay.kv_bytes])
        assert torch.equal(pos[..., :m][valid], lay.positions(rows)[valid])

    for step in range(30):
        tier = step % 2
        pt.append(tier, encoded(tier, 7), torch.rand(2, 3, 7, generator=gen) < 0.7)
        check_read_slots(0)
        check_read_slots(1)
        if step % 3 == 2:
            pt.remove(tier, torch.rand(2, 3, pt.max_count(tier), generator=gen) < 0.6)
            check_read_slots(tier)
    for tier, lay in enumerate(LAYOUTS):
        rows, valid = pt.read(tier)
        mpos, mscore, mvalid = pt.read_meta(tier)  # whole pages of the widest head, known on the host
        m = valid.shape[-1]
        assert mvalid.shape[-1] == pt.max_slots(tier) and not mvalid[..., m:].any()
        mpos, mscore, mvalid = mpos[..., :m], mscore[..., :m], mvalid[..., :m]
        assert torch.equal(mvalid, valid)
        assert torch.equal(mpos[valid], lay.positions(rows)[valid])
        assert torch.equal(mscore[valid], lay.scores(rows)[valid])
        # padding (null page, zeroed pages, stale records of the same tier) decodes to finite values;
        # 0 * NaN in the attention's probs @ V would leak otherwise
        k, v = lay.decode_kv(pt.read_slots(tier)[0], torch.float32)
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
