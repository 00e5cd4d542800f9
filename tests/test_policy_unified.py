"""The unified tri-state policy: vectorised ``classify`` against a brute-force reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hfkv.policy import budget_target, classify, expected_held_bound
from hfkv.states import EVICTED, ORIGINAL, QUANTIZED

try:
    from policy_reference import reference_classify
except ImportError:  # tests/ imported as a package
    from tests.policy_reference import reference_classify

INF = float("inf")
TIE_VALUES = [0.0, -0.0, 0.01, 0.02, 0.05, 0.1, 0.125, 0.25, 0.5, 1.0]
ALPHA_VALUES = [0.0, 0.02, 0.1, 0.5, 1.0, 2.0, 5.0, INF]


def _run_both(case):
    got = classify(**case)
    want = reference_classify(**case)
    assert got.dtype == torch.int8
    assert got.shape == case["scores"].shape
    assert got.tolist() == want, f"classify != reference for {case}"
    return got


@st.composite
def policy_cases(draw, head_adaptive=None, with_budget=None):
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 4))
    n = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    score_mode = draw(st.sampled_from(["ties", "uniform", "tiny"]))
    if score_mode == "ties":
        scores = rng.choice(np.array(TIE_VALUES, dtype=np.float32), size=(b, h, n))
    elif score_mode == "uniform":
        scores = rng.random((b, h, n), dtype=np.float32)
    else:
        scores = (rng.random((b, h, n)) * 0.1).astype(np.float32)
    p_evicted = draw(st.sampled_from([0.0, 0.2, 0.5]))
    p_quant = draw(st.sampled_from([0.0, 0.3]))
    u = rng.random((b, h, n))
    state = np.where(u < p_evicted, EVICTED, np.where(u < p_evicted + p_quant, QUANTIZED, ORIGINAL))
    p_sink = draw(st.sampled_from([0.0, 0.1, 0.3]))
    sink = rng.random((b, h, n)) < p_sink

    def alpha():
        if draw(st.booleans()):
            return torch.full((h,), draw(st.sampled_from(ALPHA_VALUES)), dtype=torch.float32)
        vals = [draw(st.one_of(st.sampled_from(ALPHA_VALUES), st.floats(0, 5, width=32))) for _ in range(h)]
        return torch.tensor(vals, dtype=torch.float32)

    window = draw(st.integers(0, 8))
    budget = (
        None
        if (with_budget is False or (with_budget is None and draw(st.booleans())))
        else draw(st.integers(0, n + window + 5))
    )
    rho = None
    if draw(st.booleans()):
        rho = torch.tensor(
            [draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0, 1, width=32))) for _ in range(b)],
            dtype=torch.float32,
        )
    return dict(
        scores=torch.from_numpy(scores.astype(np.float32)),
        state=torch.from_numpy(state.astype(np.int8)),
        sink=torch.from_numpy(sink),
        logical_len=torch.tensor([draw(st.integers(0, 60)) for _ in range(b)], dtype=torch.int64),
        window_count=torch.tensor([draw(st.integers(0, window)) for _ in range(b)], dtype=torch.int64),
        alpha_h=alpha(),
        alpha_l=alpha(),
        budget=budget,
        window=window,
        slack=draw(st.one_of(st.sampled_from([0.5, 0.75, 1.0]), st.floats(0, 1))),
        head_adaptive=draw(st.booleans()) if head_adaptive is None else head_adaptive,
        rho=rho,
    )


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(policy_cases())
def test_classify_matches_reference(case):
    _run_both(case)


@pytest.mark.parametrize("partial_max", [0, 10**9])
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(case=policy_cases(with_budget=True))
def test_sort_and_partial_topk_selection_both_match_reference(monkeypatch, partial_max, case):
    """The few-picks top-k path and the full-sort path must pick exactly the same slots."""
    import hfkv.policy.unified as unified

    monkeypatch.setattr(unified, "_PARTIAL_SELECT_MAX", partial_max)
    _run_both(case)


def _check_invariants(case, got):
    state, sink, scores = case["state"], case["sink"], case["scores"]
    # No promotion; sinks never change.
    assert bool((got >= state).all())
    assert torch.equal(got[sink], state[sink])
    budget, window, slack = case["budget"], case["window"], case["slack"]
    rule1 = classify(**{**case, "budget": None})
    if budget is None:
        assert torch.equal(got, rule1)
        return
    h = scores.shape[1]
    kept = (got != EVICTED).sum(-1)  # [B, H]
    held = kept + case["window_count"].unsqueeze(-1)
    target = budget_target(budget, window, slack)
    n_sinks_kept = ((state != EVICTED) & sink).sum(-1)
    rule1_kept = (rule1 != EVICTED).sum(-1)
    rule1_held = rule1_kept + case["window_count"].unsqueeze(-1)
    if case["head_adaptive"]:
        over = rule1_held.sum(1) > h * budget
        total, sinks_total = rule1_kept.sum(1), n_sinks_kept.sum(1)
        floor_ = torch.maximum(torch.full_like(total, h * target), sinks_total)
        want = torch.where(over, torch.minimum(total, floor_), total)
        assert torch.equal(kept.sum(1), want)
        if bool((n_sinks_kept.sum(1) <= h * target).all()) and budget >= window and slack <= 1:
            assert bool((held.sum(1) <= h * budget).all())
    else:
        over = rule1_held > budget
        cap_kept = torch.maximum(torch.full_like(rule1_kept, target), n_sinks_kept)
        want = torch.where(over, torch.minimum(rule1_kept, cap_kept), rule1_kept)
        assert torch.equal(kept, want)
        if bool((n_sinks_kept <= target).all()) and budget >= window and slack <= 1:
            assert bool((held <= budget).all())
            assert bool((held[over] <= expected_held_bound(budget, window, slack)).all())
    # Evicted-by-budget slots never outrank surviving evictable ones.
    by_budget = (rule1 != EVICTED) & (got == EVICTED)
    survivors = (got != EVICTED) & ~sink
    for b in range(scores.shape[0]):
        if case["head_adaptive"]:
            ev, sv = scores[b][by_budget[b]], scores[b][survivors[b]]
            if ev.numel() and sv.numel():
                assert ev.max() <= sv.min()
        else:
            for hh in range(h):
                ev, sv = scores[b, hh][by_budget[b, hh]], scores[b, hh][survivors[b, hh]]
                if ev.numel() and sv.numel():
                    assert ev.max() <= sv.min()
    if case["rho"] is not None:
        cap = torch.round(case["rho"] * float(budget - window)).clamp(min=0).long()
        orig = ((got == ORIGINAL) & ~sink).sum(-1)
        if case["head_adaptive"]:
            assert bool((orig.sum(1) <= h * cap).all())
        else:
            assert bool((orig <= cap.unsqueeze(-1)).all())


@SETTINGS
@given(policy_cases(with_budget=True))
def test_classify_invariants(case):
    got = _run_both(case)
    _check_invariants(case, got)


# ---------------------------------------------------------------------------------------------
# Explicit preset settings.


def _preset_case(seed, b=2, h=3, n=40, **kw):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, h, n, generator=g) * (2.0 / max(n, 1))
    state = torch.full((b, h, n), ORIGINAL, dtype=torch.int8)
    sink = torch.zeros(b, h, n, dtype=torch.bool)
    sink[:, :, :2] = True
    case = dict(
        scores=scores,
        state=state,
        sink=sink,
        logical_len=torch.full((b,), n + 8, dtype=torch.int64),
        window_count=torch.full((b,), 8, dtype=torch.int64),
        alpha_h=torch.zeros(h),
        alpha_l=torch.zeros(h),
        budget=None,
        window=8,
        slack=0.75,
        head_adaptive=False,
        rho=None,
    )
    case.update(kw)
    return case


def test_preset_evict():
    case = _preset_case(0, budget=24)
    got = _run_both(case)
    _check_invariants(case, got)
    assert not bool((got == QUANTIZED).any())
    kept = (got != EVICTED).sum(-1)
    assert bool((kept == budget_target(24, 8, 0.75)).all())  # 12 incl. the 2 sinks
    # The kept non-sink slots are exactly the top-10 scores of each head.
    for b in range(2):
        for h in range(3):
            top = set(torch.argsort(case["scores"][b, h, 2:], descending=True)[:10].add(2).tolist())
            assert set(torch.nonzero(got[b, h, 2:] != EVICTED).flatten().add(2).tolist()) == top


def test_preset_evict_under_budget_is_a_noop():
    case = _preset_case(1, budget=100)
    assert torch.equal(_run_both(case), case["state"])


def test_preset_quant():
    case = _preset_case(2, alpha_h=torch.full((3,), INF))
    got = _run_both(case)
    _check_invariants(case, got)
    assert bool((got[:, :, 2:] == QUANTIZED).all()) and bool((got[:, :, :2] == ORIGINAL).all())
    # With a budget (ARKV "quant" baseline): quantized survivors, evicted lowest.
    case = _preset_case(3, alpha_h=torch.full((3,), INF), budget=24)
    got = _run_both(case)
    _check_invariants(case, got)
    assert set(got[:, :, 2:].unique().tolist()) == {QUANTIZED, EVICTED}


def test_preset_streaming():
    case = _preset_case(4, alpha_l=torch.full((3,), INF), alpha_h=torch.full((3,), INF))
    got = _run_both(case)
    _check_invariants(case, got)
    assert bool((got[:, :, 2:] == EVICTED).all()) and bool((got[:, :, :2] == ORIGINAL).all())


def test_preset_arkv():
    rho = torch.tensor([0.5, 1.0])
    case = _preset_case(5, budget=24, rho=rho)
    got = _run_both(case)
    _check_invariants(case, got)
    orig = ((got == ORIGINAL) & ~case["sink"]).sum(-1)
    assert orig[0].tolist() == [8] * 3  # round(0.5 * 16)
    assert orig[1].tolist() == [10] * 3  # the 10 kept non-sink slots, under the cap of 16
    # Among kept non-sink slots, every ORIGINAL outranks every QUANTIZED.
    for h in range(3):
        s = case["scores"][0, h]
        assert s[got[0, h] == QUANTIZED].max() <= s[(got[0, h] == ORIGINAL) & ~case["sink"][0, h]].min()


def test_preset_diffkv():
    n = 40
    case = _preset_case(6, alpha_h=torch.ones(3), alpha_l=torch.full((3,), 0.02), window=64)
    case["scores"][:, :, 2] = 0.0  # every category is populated
    got = _run_both(case)
    _check_invariants(case, got)
    length = float(n + 8)
    s = case["scores"]
    free = ~case["sink"]
    categories = [
        (free & (s < 0.02 / length), EVICTED),
        (free & (s >= 1.0 / length), ORIGINAL),
        (free & (s >= 0.02 / length) & (s < 1.0 / length), QUANTIZED),
    ]
    for where, want in categories:
        assert bool(where.any()) and bool((got[where] == want).all())
    assert bool((got[case["sink"]] == ORIGINAL).all())


def test_preset_hfkv_head_adaptive():
    b, h, n = 1, 4, 40
    # Heads with very different score levels: the shared budget goes to the high-scoring heads.
    base = torch.linspace(0.5, 1.5, n) / n
    scores = torch.stack([base * f for f in (8.0, 4.0, 1.0, 0.5)]).unsqueeze(0)
    case = _preset_case(
        7,
        b=b,
        h=h,
        n=n,
        scores=scores,
        alpha_h=torch.ones(h),
        alpha_l=torch.full((h,), 0.02),
        budget=24,
        head_adaptive=True,
        rho=torch.tensor([0.25]),
    )
    got = _run_both(case)
    _check_invariants(case, got)
    kept = (got != EVICTED).sum(-1)[0]
    assert int(kept.sum()) == h * budget_target(24, 8, 0.75)
    assert len(set(kept.tolist())) > 1 and kept[0] > kept[-1]
    orig = ((got == ORIGINAL) & ~case["sink"]).sum(-1)[0]
    assert int(orig.sum()) <= h * 4  # round(0.25 * 16) per head, shared
    # Per-head mode keeps the same count in every head for the same input.
    per_head = _run_both({**case, "head_adaptive": False})
    assert len(set((per_head != EVICTED).sum(-1)[0].tolist())) == 1


def test_tie_break_lower_index_first():
    scores = torch.full((1, 1, 6), 0.5)
    state = torch.zeros(1, 1, 6, dtype=torch.int8)
    case = dict(
        scores=scores,
        state=state,
        sink=torch.zeros(1, 1, 6, dtype=torch.bool),
        logical_len=torch.tensor([6]),
        window_count=torch.tensor([0]),
        alpha_h=torch.zeros(1),
        alpha_l=torch.zeros(1),
        budget=4,
        window=0,
        slack=0.5,
        head_adaptive=False,
        rho=None,
    )
    got = _run_both(case)
    assert got[0, 0].tolist() == [EVICTED] * 4 + [ORIGINAL] * 2
    # Across heads: (score, n, h).
    case.update(
        scores=torch.full((1, 2, 3), 0.5),
        state=torch.zeros(1, 2, 3, dtype=torch.int8),
        sink=torch.zeros(1, 2, 3, dtype=torch.bool),
        alpha_h=torch.zeros(2),
        alpha_l=torch.zeros(2),
        budget=2,
        slack=0.5,
        head_adaptive=True,
    )
    got = _run_both(case)  # 6 kept -> 2*floor(0.5*2) = 2: evict (n0,h0),(n0,h1),(n1,h0),(n1,h1)
    assert got[0].tolist() == [[EVICTED, EVICTED, ORIGINAL], [EVICTED, EVICTED, ORIGINAL]]


def test_negative_zero_ties_with_zero():
    scores = torch.tensor([[[0.0, -0.0, 0.0, -0.0]]])
    case = dict(
        scores=scores,
        state=torch.zeros(1, 1, 4, dtype=torch.int8),
        sink=torch.zeros(1, 1, 4, dtype=torch.bool),
        logical_len=torch.tensor([4]),
        window_count=torch.tensor([0]),
        alpha_h=torch.zeros(1),
        alpha_l=torch.zeros(1),
        budget=2,
        window=0,
        slack=1.0,
        head_adaptive=False,
        rho=None,
    )
    assert _run_both(case)[0, 0].tolist() == [EVICTED, EVICTED, ORIGINAL, ORIGINAL]


def test_no_sort_when_nothing_is_over(monkeypatch):
    case = _preset_case(8, budget=1000, rho=torch.ones(2))
    calls = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: calls.append(1) or real_sort(*a, **k))
    classify(**case)
    assert calls == []
    classify(**{**case, "budget": 20})
    assert calls


@pytest.mark.parametrize("n", [0, 1])
def test_tiny_inputs(n):
    case = _preset_case(9, n=n, budget=0, window=0, rho=torch.zeros(2))
    case["sink"] = torch.zeros_like(case["sink"])
    _run_both(case)


def test_bound_helpers():
    assert budget_target(1024, 32, 0.75) == math.floor(0.75 * 992)
    assert budget_target(10, 32, 0.75) == 0
    assert expected_held_bound(1024, 32, 0.75) == 744 + 32 <= 1024
