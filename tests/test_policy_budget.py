"""The memory-budget allocator against a loop reference and a brute-force optimum.

``reference_allocate`` (tests/policy_reference.py) is the rule written token by token; the
brute force enumerates every assignment of tiny heads and checks that the vectorised greedy is
feasible and within one item of the best value the bytes allow.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfkv.policy.budget import allocate, held_bytes_of, quantizing_pays
from hfkv.states import EVICTED, ORIGINAL, QUANTIZED
from tests.policy_reference import reference_allocate


@st.composite
def cases(draw, max_n=7, with_floors=True, with_cap=True, with_prior=True):
    b, h, n = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, max_n))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, h, n, generator=g)
    if draw(st.booleans()):  # coarse scores: ties everywhere, so the tie-break is exercised
        scores = (scores * 4).round() / 4
    state = torch.randint(0, 3, (b, h, n), generator=g).to(torch.int8)
    sink = torch.rand(b, h, n, generator=g) < draw(st.sampled_from([0.0, 0.2]))
    length = torch.randint(1, 10, (b,), generator=g)
    if with_floors:
        ah = torch.tensor([draw(st.sampled_from([0.0, 1.0, 3.0, float("inf")])) for _ in range(h)])
        al = torch.minimum(ah, torch.tensor([draw(st.sampled_from([0.0, 0.2, 0.5])) for _ in range(h)]))
    else:
        ah, al = torch.full((h,), float("inf")), torch.zeros(h)
    c0 = draw(st.sampled_from([8, 16, 264]))
    c1 = draw(st.integers(1, c0))
    fid = (1.0, draw(st.sampled_from([0.0, 0.25, 0.6, 0.9, 1.0])))
    ha = draw(st.booleans())
    rows = (b,) if ha else (b, h)
    room = torch.randint(0, c0 * (n + 1) * (h if ha else 1) + 1, rows, generator=g)
    cap = torch.randint(0, n + 1, rows, generator=g) if with_cap and draw(st.booleans()) else None
    prior = draw(st.sampled_from([0.0, 0.0, 0.5, 4.0])) if with_prior else 0.0
    return dict(
        prior=prior,
        scores=scores,
        state=state,
        sink=sink,
        logical_len=length,
        alpha_h=ah,
        alpha_l=al,
        room=room,
        cost=(c0, c1),
        fidelity=fid,
        head_adaptive=ha,
        exact_cap=cap,
    )


def _per_row(x: torch.Tensor, head_adaptive: bool) -> torch.Tensor:
    return x.sum(1) if head_adaptive else x


@settings(max_examples=400, deadline=None)
@given(cases())
def test_allocate_matches_loop_reference(case):
    got = allocate(**case)
    assert got.dtype == torch.int8
    assert got.tolist() == reference_allocate(**case)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_allocate_fits_the_room_never_promotes_and_keeps_sinks(case):
    new = allocate(**case)
    state, sink, ha = case["state"], case["sink"], case["head_adaptive"]
    assert torch.equal(new[sink], state[sink]), "sinks never change state"
    assert (new[~sink] >= state[~sink]).all(), "no promotion (original < quantized < evicted)"
    held = _per_row(held_bytes_of(new, case["cost"]), ha)
    sinks_alone = _per_row(held_bytes_of(torch.where(sink, state, EVICTED), case["cost"]), ha)
    room = case["room"]
    assert ((held <= room) | (sinks_alone > room)).all()
    if case["exact_cap"] is not None:
        exact = _per_row(((new == ORIGINAL) & ~sink).sum(-1), ha)
        assert (exact <= case["exact_cap"]).all()
    # The floor: tokens under alpha_l / N are gone whatever the room.
    length = case["logical_len"].float().clamp(min=1).view(-1, 1, 1)
    under = (case["scores"] < case["alpha_l"].view(1, -1, 1) / length) & ~sink
    assert (new[under] == EVICTED).all()


def _value(states, scores, fid):
    f = {ORIGINAL: fid[0], QUANTIZED: fid[1], EVICTED: 0.0}
    return sum(float(s) * f[int(t)] for s, t in zip(scores.reshape(-1), states.reshape(-1), strict=True))


@settings(max_examples=150, deadline=None)
@given(cases(max_n=4, with_floors=False, with_cap=False, with_prior=False))
def test_allocate_is_within_one_item_of_the_brute_force_optimum(case):
    """Every feasible assignment (no promotion, sinks fixed, bytes <= room) is enumerated per row."""
    scores, state, sink, ha = case["scores"], case["state"], case["sink"], case["head_adaptive"]
    c0, c1 = case["cost"]
    fid = case["fidelity"]
    new = allocate(**case)
    b, h, n = scores.shape
    groups = (
        [[(bi, hi) for hi in range(h)] for bi in range(b)] if ha else [[(bi, hi)] for bi in range(b) for hi in range(h)]
    )
    for heads in groups:
        slots = [(bi, hi, ni) for bi, hi in heads for ni in range(n)]
        room = int(case["room"][heads[0][0]] if ha else case["room"][heads[0]])
        fixed = [s for s in slots if sink[s] or state[s] == EVICTED]
        free = [s for s in slots if s not in fixed]
        fixed_bytes = sum({ORIGINAL: c0, QUANTIZED: c1}.get(int(state[s]), 0) for s in fixed if sink[s])
        if fixed_bytes > room:
            continue
        best = 0.0
        for choice in itertools.product((ORIGINAL, QUANTIZED, EVICTED), repeat=len(free)):
            if any(c < int(state[s]) for c, s in zip(choice, free, strict=True)):
                continue
            used = fixed_bytes + sum({ORIGINAL: c0, QUANTIZED: c1}.get(c, 0) for c in choice)
            if used <= room:
                best = max(
                    best,
                    sum(
                        float(scores[s]) * {ORIGINAL: 1.0, QUANTIZED: fid[1]}.get(c, 0.0)
                        for c, s in zip(choice, free, strict=True)
                    ),
                )
        got = sum(float(scores[s]) * {ORIGINAL: 1.0, QUANTIZED: fid[1]}.get(int(new[s]), 0.0) for s in free)
        one_item = max([float(scores[s]) for s in free], default=0.0)
        assert got <= best + 1e-5
        assert got >= best - one_item - 1e-5, (got, best, one_item)


def test_quantizing_pays_and_hull():
    assert quantizing_pays((264, 80), (1.0, 0.9))
    assert not quantizing_pays((264, 200), (1.0, 0.5))
    # When it does not pay, tokens are kept exact or dropped: a 1-token room of exact bytes goes to the best.
    scores = torch.tensor([[[0.5, 0.3, 0.2]]])
    state = torch.full((1, 1, 3), ORIGINAL, dtype=torch.int8)
    kw = dict(
        sink=torch.zeros(1, 1, 3, dtype=torch.bool),
        logical_len=torch.tensor([3]),
        alpha_h=torch.tensor([np.inf]),
        alpha_l=torch.tensor([0.0]),
        head_adaptive=False,
    )
    new = allocate(scores, state, room=torch.tensor([[264]]), cost=(264, 200), fidelity=(1.0, 0.5), **kw)
    assert new.tolist() == [[[ORIGINAL, EVICTED, EVICTED]]]
    # When it pays, the same room holds three quantized tokens instead of one exact one.
    new = allocate(scores, state, room=torch.tensor([[264]]), cost=(264, 80), fidelity=(1.0, 0.9), **kw)
    assert new.tolist() == [[[QUANTIZED, QUANTIZED, QUANTIZED]]]
    # Enough room for all exact: nothing moves (fast path).
    new = allocate(scores, state, room=torch.tensor([[3 * 264]]), cost=(264, 80), fidelity=(1.0, 0.9), **kw)
    assert torch.equal(new, state)


def test_floors_and_exact_cap():
    scores = torch.tensor([[[0.6, 0.25, 0.1, 0.05]]])
    state = torch.full((1, 1, 4), ORIGINAL, dtype=torch.int8)
    kw = dict(
        sink=torch.zeros(1, 1, 4, dtype=torch.bool),
        logical_len=torch.tensor([4]),
        cost=(100, 30),
        fidelity=(1.0, 0.9),
        head_adaptive=False,
    )
    # alpha_l / N = 0.075: the last token goes though it would fit; alpha_h / N = 0.2: the first two are exact
    # or nothing (ranked at the exact rate), the third is worth more per byte quantized.
    new = allocate(
        scores, state, alpha_h=torch.tensor([0.8]), alpha_l=torch.tensor([0.3]), room=torch.tensor([[230]]), **kw
    )
    assert new.tolist() == [[[ORIGINAL, ORIGINAL, QUANTIZED, EVICTED]]]
    # A cap of one exact token turns the second upgrade's bytes into keeping the rest quantized.
    new = allocate(
        scores,
        state,
        alpha_h=torch.tensor([np.inf]),
        alpha_l=torch.tensor([0.0]),
        room=torch.tensor([[400]]),
        exact_cap=torch.tensor([[1]]),
        **kw,
    )
    assert new.tolist() == [[[ORIGINAL, QUANTIZED, QUANTIZED, QUANTIZED]]]


def test_allocate_rejects_bad_costs_and_shapes():
    z = torch.zeros(1, 1, 2)
    kw = dict(
        scores=z,
        state=z.to(torch.int8),
        sink=z.bool(),
        logical_len=torch.tensor([2]),
        alpha_h=torch.tensor([1.0]),
        alpha_l=torch.tensor([0.0]),
        fidelity=(1.0, 0.5),
        head_adaptive=False,
    )
    with pytest.raises(ValueError, match="c0 >= c1"):
        allocate(room=torch.tensor([[10]]), cost=(10, 20), **kw)
    with pytest.raises(ValueError, match="room must have shape"):
        allocate(room=torch.tensor([10]), cost=(20, 10), **kw)


def test_prior_keeps_coverage_before_precision():
    """A heavy hitter and two unattended tokens; room for one exact token or three quantized ones.
    Without a prior the heavy hitter is kept exact and the others dropped; a prior keeps all three."""
    scores = torch.tensor([[[0.9, 0.0, 0.0]]])
    state = torch.full((1, 1, 3), ORIGINAL, dtype=torch.int8)
    kw = dict(
        state=state,
        sink=torch.zeros(1, 1, 3, dtype=torch.bool),
        logical_len=torch.tensor([3]),
        alpha_h=torch.tensor([np.inf]),
        alpha_l=torch.tensor([0.0]),
        room=torch.tensor([[100]]),
        cost=(100, 30),
        fidelity=(1.0, 0.9),
        head_adaptive=False,
    )
    assert allocate(scores, **kw).tolist() == [[[ORIGINAL, EVICTED, EVICTED]]]
    assert allocate(scores, prior=1.0, **kw).tolist() == [[[QUANTIZED, QUANTIZED, QUANTIZED]]]
