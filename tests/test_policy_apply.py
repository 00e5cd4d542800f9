"""A policy run appends the demoted tokens and the window's exits together, one call per destination tier.
The storage it leaves is the one the tier-by-tier appends left (demoted tokens of each source tier, then
the exits, each head's in their order): same records, byte for byte, in the same slots."""

from __future__ import annotations

import pytest
import torch

from hfkv import TriStateCache
from hfkv.cache import TriStateLayer
from hfkv.states import EVICTED
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
            lay = self.layouts[tier]
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
        self._admit(ek, ev, epos, escore, new_exits, check_finite=False)


def _run(model, ids, mask, overrides, reference: bool, monkeypatch):
    if reference:
        monkeypatch.setattr(TriStateLayer, "_apply", _apply_tier_by_tier)
    moves = []
    apply = TriStateLayer._apply

    def spy(self, news, valids, changes, exits=None):
        pairs = list(enumerate(zip(news, valids, strict=True)))
        moves.append(sum(int((v & (n > t) & (n != EVICTED)).sum()) for t, (n, v) in pairs))
        assert [c[0] for c in changes] == [int((v & (n > t) & (n != EVICTED)).sum()) for t, (n, v) in pairs]
        return apply(self, news, valids, changes, exits)

    monkeypatch.setattr(TriStateLayer, "_apply", spy)
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
