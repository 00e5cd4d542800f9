"""A policy run where nothing competes for the byte budget only admits the window's exits, and ends exactly
where the full run (metadata of every tier, allocate(), moves) ends: same tokens generated, same states,
same records and score sums, whether the budget binds later or never."""

from __future__ import annotations

import pytest
import torch

from hfkv import TriStateCache
from hfkv.layer.budget import Budget
from hfkv.layer.padding import Padding
from hfkv.states import EVICTED
from hfkv.storage.moves import Moves
from tests.models import left_padded_batch, tiny_model


def _state(cache: TriStateCache) -> list:
    out = []
    for layer in cache.layers:
        tiers = layer.tiers
        metas = [tuple(x.clone() for x in tiers.read_meta(t)) for t in range(tiers.num_tiers)]
        out.append((tiers.counts.clone(), metas, cache.token_states(layer.layer_idx).clone()))
    return out


def _generate(model, ids, mask, overrides, slow: bool, monkeypatch) -> tuple:
    original, admit_exits = Budget.nothing_competes, Moves.admit_exits
    answers: list[bool] = []

    def spy(self, exit_pos, padded=True):
        answers.append(False if slow else original(self, exit_pos, padded))
        return answers[-1]

    def spy_exits(self, *args):
        answers.append("exits")
        return admit_exits(self, *args)

    monkeypatch.setattr(Budget, "nothing_competes", spy)
    monkeypatch.setattr(Moves, "admit_exits", spy_exits)
    overrides = dict(overrides)
    if overrides.pop("half_oq", False):  # OQ ratios of 0.5: the cap on exact tokens binds before the bytes do
        monkeypatch.setattr(TriStateCache, "rho", lambda self, i: torch.full((ids.shape[0],), 0.5))
    cache = TriStateCache(model, "hfkv", dense_phase=False, **overrides)  # the tiers' runs from the first token
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=44, do_sample=False)
    monkeypatch.undo()
    return out, _state(cache), answers


@pytest.mark.parametrize(
    "overrides",
    [
        {"budget": 40, "window": 4},  # OQ-ratio cap on exact tokens (the preset's), the budget binds midway
        {"budget": 40, "window": 4, "oq_ratios": False},
        {"budget": 40, "window": 4, "head_adaptive": True},
        {"budget": 400, "window": 4},  # never binds
        {"budget": 40, "window": 4, "alpha_l": 0.05},  # an eviction floor: never admit-only
        {"budget": 60, "window": 4, "half_oq": True},
    ],
)
@pytest.mark.parametrize("lengths", [(12, 7), (12, 12)], ids=["padded", "unpadded"])
def test_admit_only_runs_end_where_full_runs_end(overrides, lengths, monkeypatch):
    """An admit-only run takes the exits as they are (Moves.admit_exits) where none is padding: every decode-time run
    here (the longest padding, 5 tokens, is older than the window's oldest token after the prompt)."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=lengths)
    fast_out, fast_state, answers = _generate(model, ids, mask, overrides, False, monkeypatch)
    fast_answers = [a for a in answers if a != "exits"]
    assert ("exits" in answers) == any(fast_answers)
    slow_out, slow_state, _ = _generate(model, ids, mask, overrides, True, monkeypatch)
    assert torch.equal(fast_out, slow_out)
    for (fc, fm, fs), (sc, sm, ss) in zip(fast_state, slow_state, strict=True):
        assert torch.equal(fc, sc) and torch.equal(fs, ss)
        for a, b in zip(fm, sm, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    if overrides.get("alpha_l"):
        assert not any(fast_answers)
    else:
        assert any(fast_answers)  # the admit-only run was taken ...
    if (overrides["budget"] == 40 and not overrides.get("alpha_l")) or overrides.get("half_oq"):
        assert not all(fast_answers)  # ... and, once the budget binds, the full one


def test_an_unpadded_full_budget_is_decided_on_the_host(monkeypatch):
    """Without padding the fullest row's bytes (kept on the host) decide that a run must rank: the same answer as
    the tensors give, with no tensor operation (so no wait on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    original = Budget.nothing_competes
    seen = []

    def spy(self, exit_pos, padded=True):
        Count.ops = 0
        with Count():
            fast = original(self, exit_pos, padded)
        ops = Count.ops
        slow = original(self, exit_pos, True)  # the tensors' answer
        seen.append((padded, fast, slow, ops))
        return fast

    monkeypatch.setattr(Budget, "nothing_competes", spy)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = TriStateCache(model, "hfkv", budget=40, window=4, oq_ratios=False, dense_phase=False)
    model.generate(ids, past_key_values=cache, max_new_tokens=44, do_sample=False)
    assert seen and all(fast == slow for _, fast, slow, _ in seen)
    assert not any(padded for padded, *_ in seen)  # a prompt without a mask: unpadded, known without a read
    assert any(fast for _, fast, _, _ in seen)  # admit-only runs first ...
    assert any(not fast and ops == 0 for _, fast, _, ops in seen)  # ... then the host says no, with no operation


def test_runs_past_the_longest_padding_take_the_unpadded_paths(monkeypatch):
    """A padded batch's runs treat their exits as possibly padding only while the oldest exit lies inside some row's
    padding (known on the host from the ring's positions and the longest padding, read once): the same tokens and
    storage as runs that always treat them so, and both kinds of run happen here (a window of 16 tokens holds 10 of
    the short row's 22 padding tokens after the prompt)."""
    original = Padding.exits_padded
    seen: list[tuple[int | None, bool]] = []

    def spy(self, first):
        seen.append((first, original(self, first)))
        return seen[-1][1]

    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(28, 6))
    results = []
    for always in (False, True):
        if always:  # every run as if some exit may be padding: the paths before the host knew better
            monkeypatch.setattr(Padding, "exits_padded", lambda self, first: self.padded)
        else:
            monkeypatch.setattr(Padding, "exits_padded", spy)
        cache = TriStateCache(model, "hfkv", budget=40, window=16, dense_phase=False)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, do_sample=False)
        results.append((out, _state(cache)))
        monkeypatch.undo()
    firsts = [first for first, _ in seen]
    assert {padded for _, padded in seen} == {False, True}  # runs inside the padding, then past it
    assert all(padded == (first < 22) for first, padded in seen) and min(firsts) == 12
    (out, state), (ref, ref_state) = results
    assert torch.equal(out, ref)
    for (fc, fm, fs), (sc, sm, ss) in zip(state, ref_state, strict=True):
        assert torch.equal(fc, sc) and torch.equal(fs, ss)
        for a, b in zip(fm, sm, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert (fs[1, :, :22] == EVICTED).all()  # the padding was never kept
