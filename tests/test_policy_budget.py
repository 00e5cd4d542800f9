"""The memory-budget allocator against a loop reference and a brute-force optimum.

``reference_allocate`` (tests/policy_reference.py) is the rule written token by token; the
brute force finds the best value the bytes allow over every assignment of tiny heads (enumerated,
or by dynamic programming over bytes where a row has too many slots to enumerate) and checks that
the vectorised greedy is feasible and within one item of it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfkv.policy.budget import allocate, held_bytes_of, hull_slopes
from hfkv.states import EVICTED, MID, ORIGINAL, QUANTIZED
from tests.policy_reference import reference_allocate


@st.composite
def cases(draw, max_n=7, with_floors=True, with_cap=True, with_prior=True):
    b, h, n = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, max_n))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, h, n, generator=g)
    if draw(st.booleans()):  # coarse scores: ties everywhere, so the tie-break is exercised
        scores = (scores * 4).round() / 4
    c0 = draw(st.sampled_from([8, 16, 264]))
    c2 = draw(st.integers(1, c0))
    f2 = draw(st.sampled_from([0.0, 0.25, 0.6, 0.9, 1.0]))
    if draw(st.booleans()):  # a mid tier between the two (DiffKV's K8V4 between exact and K4V2)
        c1 = draw(st.integers(c2, c0))
        f1 = max(f2, draw(st.sampled_from([0.5 * (f2 + 1.0), 0.95, 1.0])))
    else:
        c1 = f1 = None
    tiers = [t for t, c in ((ORIGINAL, c0), (MID, c1), (QUANTIZED, c2)) if c is not None] + [EVICTED]
    state = torch.tensor(tiers)[torch.randint(0, len(tiers), (b, h, n), generator=g)].to(torch.int8)
    sink = torch.rand(b, h, n, generator=g) < draw(st.sampled_from([0.0, 0.2]))
    length = torch.randint(1, 10, (b,), generator=g)
    if with_floors:
        ah = torch.tensor([draw(st.sampled_from([0.0, 1.0, 3.0, float("inf")])) for _ in range(h)])
        al = torch.minimum(ah, torch.tensor([draw(st.sampled_from([0.0, 0.2, 0.5])) for _ in range(h)]))
    else:
        ah, al = torch.full((h,), float("inf")), torch.zeros(h)
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
        cost=(c0, c1, c2),
        fidelity=(1.0, f1, f2),
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
    assert (new[~sink] >= state[~sink]).all(), "no promotion (original < mid < quantized < evicted)"
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


def _best_by_enumeration(choices: list[list[tuple[int, float]]], room: int) -> float:
    """The largest value of any assignment whose bytes fit ``room``: every combination of the slots' choices."""
    best = -np.inf
    for pick in itertools.product(*choices):
        if sum(c for c, _ in pick) <= room:
            best = max(best, sum(v for _, v in pick))
    return best


def _best_by_bytes(choices: list[list[tuple[int, float]]], room: int) -> float:
    """The same optimum by dynamic programming over bytes used (exact: costs are integers): ``best[u]`` is the largest
    value of the slots so far using exactly ``u`` bytes. Linear in the slots where enumeration is exponential."""
    best = np.full(room + 1, -np.inf)
    best[0] = 0.0
    for options in choices:
        nxt = np.full(room + 1, -np.inf)
        for cost, value in options:
            if cost <= room:
                nxt[cost:] = np.maximum(nxt[cost:], best[: room + 1 - cost] + value)
        best = nxt
    return float(best.max())


@settings(max_examples=150, deadline=None)
@given(cases(max_n=4, with_floors=False, with_cap=False, with_prior=False))
def test_allocate_is_within_one_item_of_the_brute_force_optimum(case):
    """Every feasible assignment (no promotion, sinks fixed, bytes <= room) is considered per row: enumerated where a
    row has at most 6 free slots, else by dynamic programming over bytes (checked against the enumeration on those)."""
    scores, state, sink, ha = case["scores"], case["state"], case["sink"], case["head_adaptive"]
    byte = {t: c for t, c in enumerate(case["cost"]) if c is not None}
    worth = {t: f for t, f in enumerate(case["fidelity"]) if f is not None}
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
        fixed_bytes = sum(byte.get(int(state[s]), 0) for s in fixed if sink[s])
        if fixed_bytes > room:
            continue
        choices = [  # each free slot: its tier (no promotion) or evicted, as (bytes, value)
            [(byte.get(c, 0), float(scores[s]) * worth.get(c, 0.0)) for c in [*byte, EVICTED] if c >= int(state[s])]
            for s in free
        ]
        best = _best_by_bytes(choices, room - fixed_bytes)
        if len(free) <= 6:
            assert best == pytest.approx(_best_by_enumeration(choices, room - fixed_bytes), abs=1e-9)
        got = sum(float(scores[s]) * worth.get(int(new[s]), 0.0) for s in free)
        one_item = max([float(scores[s]) for s in free], default=0.0)
        assert got <= best + 1e-5
        assert got >= best - one_item - 1e-5, (got, best, one_item)


def test_hull_and_two_tier_choices():
    assert hull_slopes([(80, 0.9), (264, 1.0)]) == pytest.approx([0.9 / 80, 0.1 / 184])
    # A quantized point under the line to the exact one: both steps at the exact tier's rate.
    assert hull_slopes([(200, 0.5), (264, 1.0)]) == pytest.approx([1 / 264, 1 / 264])
    # Equal costs: the free step takes the previous step's rate; a middle point on the hull keeps its own.
    assert hull_slopes([(72, 0.64), (72, 0.64), (264, 1.0)]) == pytest.approx([0.64 / 72, 0.64 / 72, 0.36 / 192])
    assert hull_slopes([(72, 0.64), (120, 0.936), (264, 1.0)]) == pytest.approx([0.64 / 72, 0.296 / 48, 0.064 / 144])
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
    new = allocate(scores, state, room=torch.tensor([[264]]), cost=(264, None, 200), fidelity=(1.0, None, 0.5), **kw)
    assert new.tolist() == [[[ORIGINAL, EVICTED, EVICTED]]]
    # When it pays, the same room holds three quantized tokens instead of one exact one.
    new = allocate(scores, state, room=torch.tensor([[264]]), cost=(264, None, 80), fidelity=(1.0, None, 0.9), **kw)
    assert new.tolist() == [[[QUANTIZED, QUANTIZED, QUANTIZED]]]
    # Enough room for all exact: nothing moves (fast path).
    new = allocate(scores, state, room=torch.tensor([[3 * 264]]), cost=(264, None, 80), fidelity=(1.0, None, 0.9), **kw)
    assert torch.equal(new, state)


def test_floors_and_exact_cap():
    scores = torch.tensor([[[0.6, 0.25, 0.1, 0.05]]])
    state = torch.full((1, 1, 4), ORIGINAL, dtype=torch.int8)
    kw = dict(
        sink=torch.zeros(1, 1, 4, dtype=torch.bool),
        logical_len=torch.tensor([4]),
        cost=(100, None, 30),
        fidelity=(1.0, None, 0.9),
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
        head_adaptive=False,
    )
    with pytest.raises(ValueError, match="never more precise"):
        allocate(room=torch.tensor([[10]]), cost=(10, None, 20), fidelity=(1.0, None, 0.5), **kw)
    with pytest.raises(ValueError, match="never more precise"):  # a mid tier less precise than the quantized one
        allocate(room=torch.tensor([[10]]), cost=(30, 20, 10), fidelity=(1.0, 0.4, 0.5), **kw)
    with pytest.raises(ValueError, match="one cost and one fidelity per tier"):
        allocate(room=torch.tensor([[10]]), cost=(20, 10), fidelity=(1.0, 0.5), **kw)
    with pytest.raises(ValueError, match="room must have shape"):
        allocate(room=torch.tensor([10]), cost=(20, None, 10), fidelity=(1.0, None, 0.5), **kw)


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
        cost=(100, None, 30),
        fidelity=(1.0, None, 0.9),
        head_adaptive=False,
    )
    assert allocate(scores, **kw).tolist() == [[[ORIGINAL, EVICTED, EVICTED]]]
    assert allocate(scores, prior=1.0, **kw).tolist() == [[[QUANTIZED, QUANTIZED, QUANTIZED]]]


def test_mid_tier_refines_before_exact():
    """K4V2 / K8V4 / bf16 record sizes at head_dim 64: once every token is kept, bytes go to refining
    tokens to the mid tier (0.30 of fidelity per 48 bytes) long before any exact copy (0.06 per 144).
    With the default prior (16 / N), coverage comes first: every token is kept before any is refined."""
    scores = torch.tensor([[[0.5, 0.3, 0.2]]])
    kw = dict(
        sink=torch.zeros(1, 1, 3, dtype=torch.bool),
        logical_len=torch.tensor([3]),
        alpha_h=torch.tensor([np.inf]),
        alpha_l=torch.tensor([0.0]),
        cost=(264, 120, 72),
        fidelity=(1.0, 0.936, 0.64),
        head_adaptive=False,
        prior=16.0,
    )
    state = torch.full((1, 1, 3), ORIGINAL, dtype=torch.int8)
    room = lambda x: torch.tensor([[x]])  # noqa: E731
    assert allocate(scores, state, room=room(3 * 72), **kw).tolist() == [[[QUANTIZED] * 3]]
    assert allocate(scores, state, room=room(2 * 72 + 120), **kw).tolist() == [[[MID, QUANTIZED, QUANTIZED]]]
    assert allocate(scores, state, room=room(3 * 120), **kw).tolist() == [[[MID] * 3]]
    assert allocate(scores, state, room=room(264 + 2 * 120), **kw).tolist() == [[[ORIGINAL, MID, MID]]]
    # No promotion: a mid token can be kept mid or made coarser, never exact again.
    state = torch.tensor([[[MID, ORIGINAL, QUANTIZED]]], dtype=torch.int8)
    assert allocate(scores, state, room=room(264 + 120 + 72), **kw).tolist() == [[[MID, ORIGINAL, QUANTIZED]]]
    assert allocate(scores, state, room=room(2 * 120 + 72), **kw).tolist() == [[[MID, MID, QUANTIZED]]]
    # Without the prior the heavy hitter is refined before the weakest token is kept at all.
    kw["prior"] = 0.0
    state = torch.full((1, 1, 3), ORIGINAL, dtype=torch.int8)
    assert allocate(scores, state, room=room(3 * 72), **kw).tolist() == [[[MID, QUANTIZED, EVICTED]]]
