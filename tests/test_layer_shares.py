"""Layers sharing a compressed context's room by its reconstruction scores (``TriStateConfig.layer_adaptive``)."""

from __future__ import annotations

import pytest
import torch

import hfkv
from hfkv.cache_state import capture
from hfkv.compress_once import score_context
from hfkv.policy.layer_shares import layer_shares
from hfkv.states import EVICTED
from tests.models import tiny_model

REPEAT = torch.tensor([5, 6, 7, 8])
KW = dict(budget=24, window=4, repeat_prompt=REPEAT, chunk=32)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _brute_shares(scores, kept, lo=0.25, hi=4.0):
    """The top ``kept`` x (rows x heads) scores by a full sort, counted per layer, scaled to a weighted mean of 1 and
    clamped, the clamped-away room shared again among the layers not at a bound (fixed-point rounds)."""
    rows = [s[..., 0].numel() for s in scores]
    owner = torch.cat([torch.full((s.numel(),), i) for i, s in enumerate(scores)])
    order = torch.cat([s.flatten() for s in scores]).argsort(descending=True)
    top = owner[order[: kept * sum(rows)]]
    per = [float((top == i).sum()) / r for i, r in enumerate(rows)]

    free = [True] * len(per)
    share = per[:]
    for _ in range(len(per) + 1):  # each round fixes at least one more layer at a bound, or ends
        fixed = sum(x * r for x, r, f in zip(share, rows, free, strict=True) if not f)
        loose = sum(p * r for p, r, f in zip(per, rows, free, strict=True) if f)
        want = sum(rows) - fixed
        share = [p * want / loose if f else x for p, x, f in zip(per, share, free, strict=True)]
        out = [f and not lo <= x <= hi for x, f in zip(share, free, strict=True)]
        if not any(out):
            break
        share = [min(max(x, lo), hi) if o else x for x, o in zip(share, out, strict=True)]
        free = [f and not o for f, o in zip(free, out, strict=True)]
    return share


def test_shares_count_each_layers_part_of_the_top_scores_against_a_full_sort():
    g = torch.Generator().manual_seed(0)
    # Layers of different widths (rows x heads) and scales: the layer with the large scores holds most of the top.
    scores = [torch.rand(2, heads, 50, generator=g) * scale for heads, scale in ((3, 1), (1, 3), (2, 1))]
    for kept in (5, 12, 30):
        got = layer_shares(scores, kept)
        assert got == pytest.approx(_brute_shares(scores, kept), rel=1e-4)
        rows = [s[..., 0].numel() for s in scores]
        assert sum(x * r for x, r in zip(got, rows, strict=True)) <= sum(rows) * (1 + 1e-9)  # never more room
        assert got[1] > 1 > min(got[0], got[2])


def test_shares_keep_every_layer_between_the_bounds_and_the_total_even():
    """One layer holds every top score: it gets what the others' floor leaves (3 layers: 3 - 2 x 0.25), not 4x."""
    scores = [torch.full((1, 2, 40), 0.9), torch.full((1, 2, 40), 0.1), torch.full((1, 2, 40), 0.2)]
    assert layer_shares(scores, 8) == pytest.approx([2.5, 0.25, 0.25])
    # Too few layers to take the room at the upper bound: the room left over stays unused.
    few = [torch.full((1, 1, 40), 0.9), torch.rand(1, 7, 40) * 0.1]
    assert layer_shares(few, 5) == pytest.approx([4.0, 0.25])  # 40 top scores, all in the first layer
    assert layer_shares([torch.rand(1, 2, 40)] * 3, 8) == pytest.approx([1.0, 1.0, 1.0])  # the same scores: even
    with pytest.raises(ValueError, match="bounds"):
        layer_shares(scores, 8, bounds=(1.5, 4.0))
    with pytest.raises(ValueError, match="kept=0"):
        layer_shares(scores, 0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_compress_gives_each_layer_its_share_of_the_room(backend):
    """Each layer's room is its share of the even split's (the shares of the context's own reconstruction scores);
    a layer holds no more than its room and the cache no more than the even split's total; tokens are still kept by
    rank within a layer."""
    model, context = tiny_model("llama", num_hidden_layers=3), _ids(96, 0)
    shared = hfkv.compress(model, context, "hfkv", layer_adaptive=True, backend=backend, **KW)
    even = hfkv.compress(model, context, "hfkv", backend=backend, **KW)
    _, scores = score_context(model, context, "reconstruction", REPEAT, 32)
    want = layer_shares([scores[i] for i in range(3)], 24)
    assert [layer.budget.share for layer in shared.compressed_layers()] == pytest.approx(want)
    assert max(want) > 1.05 and min(want) < 0.95  # the layers do differ: the test sees the shares act
    for layer, other in zip(shared.compressed_layers(), even.compressed_layers(), strict=True):
        share, budget = layer.budget.share, layer.budget
        assert abs(budget.room - share * other.budget.room) <= 1
        assert 0 < budget.tier_peak <= budget.room  # the fullest head's bytes outside the window
        kept, kept_even = ((c.token_states() != EVICTED).sum() for c in (layer, other))
        assert (kept >= kept_even) if share > 1 else (kept <= kept_even)
        states, score = layer.token_states(), scores[layer.layer_idx]
        lo, hi = layer.cfg.sink_tokens, layer.score_start
        for h in range(states.shape[1]):
            s, gone = score[0, h, lo:hi], states[0, h, lo:hi] == EVICTED
            if gone.any() and (~gone).any():
                assert s[gone].max() <= s[~gone].min()
    rooms = [[c.budget.room for c in cache.compressed_layers()] for cache in (shared, even)]
    assert sum(rooms[0]) <= sum(rooms[1])  # the total: at most the even split's


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_fork_and_a_loaded_copy_keep_the_shares_and_answer_alike(backend, tmp_path):
    """A fork answers as the original would, leaving it bit-identical; save -> load gives the shares back and the
    same logits (Triton's interpreter: the logits only)."""
    model, context, q = tiny_model("llama", num_hidden_layers=3), _ids(96, 0), _ids(5, 1)
    cache = hfkv.compress(model, context, "hfkv", layer_adaptive=True, head_adaptive=True, backend=backend, **KW)
    shares = [layer.budget.share for layer in cache.compressed_layers()]
    before, values = capture(cache)
    before = {k: t.clone() for k, t in before.items()}
    loaded = hfkv.TriStateCache.load(cache.save(tmp_path / "c.safetensors"), model)
    assert [layer.budget.share for layer in loaded.compressed_layers()] == shares
    assert [layer.budget.room for layer in loaded.compressed_layers()] == [
        layer.budget.room for layer in cache.compressed_layers()
    ]
    with torch.no_grad():
        want = model(input_ids=q, past_key_values=cache.fork()).logits
        assert torch.equal(model(input_ids=q, past_key_values=loaded).logits, want)
    after, values_after = capture(cache)
    assert values_after == values and all(torch.equal(after[k], before[k]) for k in before)
    if backend == "triton":
        return
    ids = torch.cat([context, q], 1)
    got = model.generate(ids, past_key_values=cache.fork(), max_new_tokens=12, do_sample=False)
    fresh = hfkv.compress(model, context, "hfkv", layer_adaptive=True, head_adaptive=True, backend=backend, **KW)
    assert torch.equal(got, model.generate(ids, past_key_values=fresh, max_new_tokens=12, do_sample=False))


def test_layer_adaptive_names_where_it_cannot_work():
    model, context = tiny_model("llama"), _ids(96, 0)
    cache = hfkv.TriStateCache(model, "hfkv", budget=24, window=4, layer_adaptive=True)
    with pytest.raises(RuntimeError, match=r"layer_adaptive=True .* hfkv.compress\(model, input_ids, config\)"):
        with torch.no_grad():
            model(input_ids=context, past_key_values=cache)
    with pytest.raises(ValueError, match="layer_adaptive=True shares the room by reconstruction scores"):
        hfkv.compress(model, context, "hfkv", scores="key_norm", layer_adaptive=True, budget=24, window=4)
    for bad, why in (
        (dict(budget_unit="tokens"), "budget_unit='tokens'"),
        (dict(budget=None, oq_ratios=False), "budget is None"),
        (dict(compress=False, budget=None), "compress is false"),
    ):
        with pytest.raises(ValueError, match=f"TriStateConfig.layer_adaptive.*{why}"):
            hfkv.TriStateConfig(layer_adaptive=True, **bad)
