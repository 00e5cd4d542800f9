"""A policy run appends the demoted tokens and the window's exits together, one call per destination tier.
The storage it leaves is the one the tier-by-tier appends left (demoted tokens of each source tier, then
the exits, each head's in their order): same records, byte for byte, in the same slots."""

from __future__ import annotations

import pytest
import torch

from hfkv import TriStateCache
from hfkv.states import EVICTED
from hfkv.storage.moves import Moves
from tests.models import left_padded_batch, tiny_model


def _apply_tier_by_tier(self, news, valids, changes, exits=None):
    """The relocation as it was written before: one append per (source tier, destination tier), then one
    per destination tier for the exits; what changed asked tier by tier (``changes`` unused)."""
    tiers = self.tiers
    moved = []
    for tier, (new, valid) in enumerate(zip(news, valids, strict=True)):
        demote = valid & (new > tier) & (new != EVICTED)
        if bool(demote.any()):
            b, h, s = demote.nonzero(as_tuple=True)
            rec = tiers.gather(tier, b, h, s)
            lay = tiers.layouts[tier]
            k, v = lay.decode_kv(rec, torch.float32)
            moved.append((new[b, h, s], (b, h, k, v, lay.positions(rec), lay.scores(rec))))
    for tier, (new, valid) in enumerate(zip(news, valids, strict=True)):
        if bool((valid & (new != tier)).any()):
            tiers.remove(tier, new == tier)
    for dest, fields in moved:
        for tier in range(tiers.num_tiers):
            sel = dest == tier
            tiers.append_tokens(tier, *(x[sel] for x in fields))
    if exits is not None:
        ek, ev, epos, escore, new_exits = exits
        self.admit(ek, ev, epos, escore, new_exits, check_finite=False)


def _run(model, ids, mask, overrides, reference: bool, monkeypatch):
    if reference:
        monkeypatch.setattr(Moves, "apply", _apply_tier_by_tier)
    moves = []
    apply = Moves.apply

    def spy(self, news, valids, changes, exits=None):
        pairs = list(enumerate(zip(news, valids, strict=True)))
        moves.append(sum(int((v & (n > t) & (n != EVICTED)).sum()) for t, (n, v) in pairs))
        assert [c[0] for c in changes] == [int((v & (n > t) & (n != EVICTED)).sum()) for t, (n, v) in pairs]
        return apply(self, news, valids, changes, exits)

    monkeypatch.setattr(Moves, "apply", spy)
    cache = TriStateCache(model, "hfkv", **overrides)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, do_sample=False)
    monkeypatch.undo()
    state = []
    for layer in cache.layers:
        tiers = layer.tiers
        state.append((tiers.counts.clone(), [tiers.read(t)[0].clone() for t in range(tiers.num_tiers)]))
    return out, state, sum(moves)


@pytest.mark.parametrize(
    "overrides",
    [
        {"budget": 40, "window": 4},
        {"budget": 40, "window": 4, "head_adaptive": True, "backend": "cpu"},
        {"budget": 30, "window": 4, "oq_ratios": False, "alpha_l": 0.05},
    ],
)
def test_relocation_leaves_the_storage_of_tier_by_tier_appends(overrides, monkeypatch):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(12, 7))
    out, state, demoted = _run(model, ids, mask, overrides, False, monkeypatch)
    ref_out, ref_state, _ = _run(model, ids, mask, overrides, True, monkeypatch)
    assert demoted > 0  # the runs re-encoded tokens into lower tiers, not only admitted exits
    assert torch.equal(out, ref_out)
    for (counts, recs), (ref_counts, ref_recs) in zip(state, ref_state, strict=True):
        assert torch.equal(counts, ref_counts)
        for a, b in zip(recs, ref_recs, strict=True):
            assert torch.equal(a, b)  # every record's bytes, slot by slot


def _apply_unplanned(self, new, valid, sizes, exits, weights, plan=None):
    """The Triton backend's relocation before its moves were planned on the device: :meth:`Moves.apply` with what
    changed asked per tier (a plan made a step ahead left unused), and the tier peak read from the counts after it
    (``weights``: each tier's cost and the heads that share a room, as ``Budget.refresh_peak`` weighs them)."""
    m = exits[2].numel()
    news = torch.split(new, [*sizes, m], dim=-1)[: len(sizes)]
    valids = torch.split(valid, [*sizes, m], dim=-1)[: len(sizes)]
    new_exits = torch.split(new, [*sizes, m], dim=-1)[-1]
    self.apply(news, valids, self.tier_changes(new, valid, sizes), (*exits, new_exits) if m else None)
    cost, per = weights
    held = (self.tiers.counts * torch.tensor(cost, device=self.tiers.counts.device)).sum(-1)
    held = held.sum(-1) if per > 1 else held
    return int(held.max()) if held.numel() else 0


def test_triton_planned_moves_leave_the_storage_of_the_unplanned_ones(monkeypatch):
    """The Triton backend plans a run's moves on the device (hfkv.kernels.moves): the same pool, byte for byte
    (records, page tables, counts), as :meth:`Moves.apply`, over runs that demote tokens and admit exits."""
    import hfkv.kernels.moves

    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(12, 7))
    planned = []
    finish_plan_moves = hfkv.kernels.moves.finish_plan_moves

    def spy(*args):  # every plan, made whole at its run or finished from one prepared a step ahead (run_ahead)
        plan = finish_plan_moves(*args)
        if not results:  # the planned generation's (the unplanned one's runs ahead make plans they do not use)
            planned.append((sum(d for d, _ in plan[0]), plan[4].numel(), plan[2]))
        return plan

    results = []
    monkeypatch.setattr(hfkv.kernels.moves, "finish_plan_moves", spy)
    for unplanned in (False, True):
        if unplanned:
            monkeypatch.setattr(Moves, "apply_planned", _apply_unplanned)
        # (Triton's interpreter is slow: a budget that demotes at the first run, runs every 4 steps, a short
        # generation that still makes two of them)
        cache = TriStateCache(model, "hfkv", backend="triton", budget=20, window=4, head_adaptive=True, interval=4)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=9, do_sample=False)
        tiers = [layer.tiers for layer in cache.layers]
        for layer in cache.layers:  # the tier peak the last run left (the plan's, when planned) is the counts'
            peak = layer.budget.tier_peak
            layer.budget.refresh_peak()
            assert layer.budget.tier_peak == peak
        results.append((out, [(t.counts.clone(), [x.clone() for x in t.tables], t.pool.data.clone(),
                               t.pool.n_free, t.pool.free_stack[: t.pool.n_free].clone()) for t in tiers]))  # fmt: skip
    (out, state), (ref_out, ref_state) = results
    demoted, moved = sum(d for d, _, _ in planned), sum(n for _, n, _ in planned)
    assert demoted > 0 and moved > demoted  # runs that re-encoded demoted tokens and admitted exits
    pages = [p for _, _, run in planned for p in run]  # (freed, widest after removal, taken, widest after) per tier
    assert any(p[2] for p in pages)  # appends took new pages, known from the plan (freeing is the kernel test's)
    assert torch.equal(out, ref_out)
    for (counts, tables, pool, n_free, free), (ref_counts, ref_tables, ref_pool, ref_n_free, ref_free) in zip(
        state, ref_state, strict=True
    ):
        assert torch.equal(counts, ref_counts)
        assert all(torch.equal(a, b) for a, b in zip(tables, ref_tables, strict=True))
        assert torch.equal(pool, ref_pool)
        assert n_free == ref_n_free and torch.equal(free, ref_free)  # the same pages free, in the same order
