"""Significance scores: observation-window probabilities, GQA reduction, score sums and counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from hfkv.policy import observation_counts, observation_probs, reduce_gqa, token_scores
from hfkv.policy.scores import carry_forward, carry_span

SETTINGS = settings(max_examples=60, deadline=None)


def _naive_probs(query, key, scaling, mask, obs_window):
    """Full attention (repeat_kv, whole T x T_k matrix), then the last w rows."""
    b, hq, t, d = query.shape
    hkv, t_k = key.shape[1], key.shape[2]
    g = hq // hkv
    k = key.double().repeat_interleave(g, dim=1)  # transformers repeat_kv layout
    logits = torch.einsum("bhqd,bhkd->bhqk", query.double(), k) * scaling
    if mask is None:
        qpos = torch.arange(t_k - t, t_k).unsqueeze(-1)
        allowed = torch.arange(t_k) <= qpos
    else:
        allowed = mask[..., :t_k]
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    w = min(obs_window, t)
    return probs[:, :, t - w :, :]


def _left_padding_mask(b, t, t_k, pads, extra_cols=0):
    qpos = torch.arange(t_k - t, t_k).unsqueeze(-1)
    kpos = torch.arange(t_k + extra_cols)
    causal = kpos <= qpos  # [T, T_k + extra]
    keep = kpos.unsqueeze(0) >= torch.tensor(pads).unsqueeze(-1)  # [B, T_k + extra]
    return (causal.unsqueeze(0) & keep.unsqueeze(1)).unsqueeze(1)  # [B, 1, T, T_k + extra]


@SETTINGS
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    g=st.sampled_from([1, 2, 4]),
    t=st.integers(1, 12),
    past=st.integers(0, 6),
    d=st.sampled_from([4, 8]),
    obs_window=st.integers(1, 16),
    mask_kind=st.sampled_from(["none", "padding", "padding_wide", "broadcast"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_observation_probs_matches_full_attention(b, hkv, g, t, past, d, obs_window, mask_kind, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t_k = t + past
    query = (torch.randn(b, hkv * g, t, d, generator=gen) * 2).to(dtype)
    key = (torch.randn(b, hkv, t_k, d, generator=gen) * 2).to(dtype)
    scaling = d**-0.5
    pads = torch.randint(0, t_k + 1, (b,), generator=gen).tolist()  # pad == t_k: all padding
    if mask_kind == "none":
        mask = None
    elif mask_kind == "padding":
        mask = _left_padding_mask(b, t, t_k, pads)
    elif mask_kind == "padding_wide":  # a slice of a wider mask (extra key columns ignored)
        mask = _left_padding_mask(b, t, t_k, pads, extra_cols=3)
        mask[..., t_k:] = True
    else:
        mask = _left_padding_mask(1, t, t_k, pads[:1])
    got = observation_probs(query, key, scaling, mask, obs_window)
    want = _naive_probs(query.float(), key.float(), scaling, mask, obs_window)
    w = min(obs_window, t)
    assert got.dtype == torch.float32
    assert got.shape == (b, hkv * g, w, t_k)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)
    # Rows with at least one allowed key sum to 1; fully masked rows are zero.
    sums = got.sum(-1)
    assert bool((((sums - 1).abs() < 1e-4) | (sums == 0)).all())


def test_fully_masked_rows_are_zero():
    query, key = torch.randn(2, 2, 5, 4), torch.randn(2, 1, 5, 4)
    mask = _left_padding_mask(2, 5, 5, [3, 0])
    probs = observation_probs(query, key, 0.5, mask, 5)
    assert torch.equal(probs[0, :, :3], torch.zeros(2, 3, 5))  # padding queries see nothing
    assert bool((probs[0, :, 3:, :3] == 0).all())  # padding keys get no mass
    assert torch.allclose(probs[1].sum(-1), torch.ones(2, 5))


class _MaxNumel(TorchFunctionMode):
    """Largest tensor produced inside the mode, not counting views of the given inputs."""

    def __init__(self, *inputs):
        super().__init__()
        self.max_numel = 0
        self.input_storages = {t.untyped_storage().data_ptr() for t in inputs if t is not None}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in self.input_storages:
                self.max_numel = max(self.max_numel, o.numel())
        return out


@pytest.mark.parametrize("with_mask", [False, True])
def test_observation_probs_never_builds_full_matrix(with_mask):
    b, hq, hkv, t, d, w = 1, 4, 2, 256, 8, 4
    query, key = torch.randn(b, hq, t, d), torch.randn(b, hkv, t, d)
    mask = _left_padding_mask(b, t, t, [3]) if with_mask else None
    with _MaxNumel(query, key, mask) as mode:
        probs = observation_probs(query, key, d**-0.5, mask, w)
    assert probs.shape == (b, hq, w, t)
    # Biggest intermediate: the w x T_k logits per query head, or an fp32 copy of the inputs.
    assert 0 < mode.max_numel <= max(b * hq * w * t, key.numel(), query.numel())
    assert mode.max_numel < b * hq * t * t // 8


@SETTINGS
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    g=st.integers(1, 4),
    rest=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    how=st.sampled_from(["max", "mean", "l2"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reduce_gqa_matches_loop(b, hkv, g, rest, how, seed):
    x = torch.rand(b, hkv * g, *rest, generator=torch.Generator().manual_seed(seed))
    got = reduce_gqa(x, hkv, how)
    assert got.shape == (b, hkv, *rest)
    for bi in range(b):
        for h in range(hkv):
            members = [x[bi, q] for q in range(hkv * g) if q // g == h]
            stack = torch.stack(members)
            if how == "max":
                want = stack.max(0).values
            elif how == "mean":
                want = sum(members) / g
            else:
                want = (sum(m * m for m in members) / g).sqrt()
            torch.testing.assert_close(got[bi, h], want)


def test_reduce_gqa_rejects_bad_inputs():
    with pytest.raises(ValueError):
        reduce_gqa(torch.zeros(1, 6, 2), 4, "max")
    with pytest.raises(ValueError):
        reduce_gqa(torch.zeros(1, 4, 2), 2, "median")


@given(t_k=st.integers(0, 40), w=st.integers(0, 50))
@settings(max_examples=80, deadline=None)
def test_observation_counts_brute_force(t_k, w):
    got = observation_counts(t_k, w, "cpu")
    ww = min(w, t_k)
    want = [sum(1 for q in range(t_k - ww, t_k) if q >= j) for j in range(t_k)]
    assert got.dtype == torch.int64
    assert got.tolist() == want


def test_count_formula_after_decode():
    """count = N - max(pos, T0 - w) matches simulated bookkeeping (prefill, then decode steps)."""
    t0, w = 10, 4
    counts = observation_counts(t0, w).tolist()
    for step in range(1, 6):
        n = t0 + step
        counts = [c + 1 for c in counts] + [1]  # every stored token observed once more; new one by itself
        assert counts == [n - max(pos, t0 - w) for pos in range(n)]


def _naive_token_scores(probs, hkv, how, gamma, pool_kernel):
    b, hq, w, t_k = probs.shape
    g = hq // hkv
    out = torch.zeros(b, hkv, t_k, dtype=torch.float64)
    for bi in range(b):
        for h in range(hkv):
            for j in range(t_k):
                total = 0.0
                vals = []
                for i in range(w):
                    group = [float(probs[bi, h * g + r, i, j]) for r in range(g)]
                    if how == "max":
                        red = max(group)
                    elif how == "mean":
                        red = sum(group) / g
                    else:
                        red = math.sqrt(sum(v * v for v in group) / g)
                    total += red
                    if t_k - w + i >= j:  # query at position t_k - w + i has seen key j
                        vals.extend(group)
                if gamma > 0:
                    mu = sum(vals) / len(vals)
                    var = sum((v - mu) ** 2 for v in vals) / len(vals)
                    total += gamma * var * (len(vals) // g)
                out[bi, h, j] = total
    if pool_kernel > 1:
        pooled = torch.zeros_like(out)
        half = pool_kernel // 2
        for j in range(t_k):
            lo, hi = max(0, j - half), min(t_k - 1, j - half + pool_kernel - 1)
            pooled[..., j] = out[..., lo : hi + 1].mean(-1)
        out = pooled
    return out


@SETTINGS
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    g=st.sampled_from([1, 2, 3]),
    t=st.integers(1, 9),
    past=st.integers(0, 4),
    obs_window=st.integers(1, 12),
    how=st.sampled_from(["max", "mean", "l2"]),
    gamma=st.sampled_from([0.0, 0.5, 263.81]),
    pool_kernel=st.sampled_from([1, 2, 3, 5]),
    from_attention=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_token_scores_match_loop(b, hkv, g, t, past, obs_window, how, gamma, pool_kernel, from_attention, seed):
    gen = torch.Generator().manual_seed(seed)
    t_k = t + past
    if from_attention:
        query, key = torch.randn(b, hkv * g, t, 4, generator=gen), torch.randn(b, hkv, t_k, 4, generator=gen)
        probs = observation_probs(query, key, 0.7, None, obs_window)
    else:  # arbitrary non-negative values, also on (query, key) pairs that are causally masked
        probs = torch.rand(b, hkv * g, min(obs_window, t), t_k, generator=gen)
    got = token_scores(probs, hkv, how, gamma=gamma, pool_kernel=pool_kernel)
    want = _naive_token_scores(probs.double(), hkv, how, gamma, pool_kernel)
    assert got.dtype == torch.float32 and got.shape == (b, hkv, t_k)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_mean_score_is_mean_over_observing_queries():
    """sum / count is the mean of the reduced probabilities over the queries that saw the key."""
    gen = torch.Generator().manual_seed(3)
    b, hkv, g, t, w = 1, 2, 2, 12, 5
    query, key = torch.randn(b, hkv * g, t, 8, generator=gen), torch.randn(b, hkv, t, 8, generator=gen)
    probs = observation_probs(query, key, 8**-0.5, None, w)
    mean = token_scores(probs, hkv, "mean") / observation_counts(t, w)
    red = reduce_gqa(probs, hkv, "mean")  # [B, Hkv, w, T]
    for j in range(t):
        seen = [i for i in range(w) if t - w + i >= j]
        torch.testing.assert_close(mean[..., j], red[:, :, seen, j].mean(-1))
    # And with the variance term: mean + gamma * var at prefill.
    gamma = 2.0
    s = token_scores(probs, hkv, "mean", gamma=gamma) / observation_counts(t, w)
    grouped = probs.view(b, hkv, g, w, t)
    j = 3
    vals = grouped[:, :, :, :, j].reshape(b, hkv, -1)  # every window query (positions 7..11) sees key 3
    torch.testing.assert_close(s[..., j], vals.mean(-1) + gamma * vals.var(-1, unbiased=False))


@SETTINGS
@given(
    t=st.integers(1, 30),
    w=st.integers(1, 12),
    decay=st.sampled_from([0.0, 0.3, 0.5, 0.8, 0.95]),
    seed=st.integers(0, 2**31 - 1),
)
def test_carry_forward_matches_loop(t, w, decay, seed):
    """Each token's mean is the max over itself and decay**d times the mean d places before it (d <= span)."""
    gen = torch.Generator().manual_seed(seed)
    sums = torch.rand(2, 3, t, generator=gen) ** 4  # a few heavy hitters
    count = observation_counts(t, w)
    got = carry_forward(sums, count, decay)
    span = carry_span(decay)
    mean = (sums / count.clamp(min=1)).double()
    want = mean.clone()
    for j in range(t):
        for d in range(1, min(span, j) + 1):
            want[..., j] = torch.maximum(want[..., j], mean[..., j - d] * decay**d)
    torch.testing.assert_close(got.double() / count.double(), want, atol=1e-7, rtol=1e-5)
    assert torch.all(got >= sums - 1e-7)  # never lowers a score


def test_carry_keeps_a_copied_span_with_its_key():
    """A key attended far above its neighbours lifts the tokens after it above the haystack for ~span tokens."""
    sums = torch.full((1, 1, 40), 1.0)
    sums[..., 10] = 100.0
    out = carry_forward(sums, torch.ones(40), 0.8)[0, 0]
    assert out[9] == 1.0 and out[10] == 100.0
    assert torch.all(out[11:30] > 1.0) and out[11] == pytest.approx(80.0)
    assert carry_span(0.8) == 20 and carry_span(0.0) == 0
    with pytest.raises(ValueError, match="decay"):
        carry_span(1.0)
    with pytest.raises(ValueError, match="carry"):
        token_scores(torch.rand(1, 2, 3, 5), 1, carry=1.5)


@pytest.mark.parametrize("decay", [0.3, 0.8, 0.95])
def test_carry_forward_windows_equal_shifts(monkeypatch, decay):
    """The one-pass windows give the shifts' result bit for bit (same fp32 factors, max is exact), and the
    shifts still serve what the windows would make too large."""
    import hfkv.policy.scores as scores

    gen = torch.Generator().manual_seed(3)
    sums = torch.rand(2, 3, 257, generator=gen) ** 4
    count = observation_counts(257, 32)
    windows = carry_forward(sums, count, decay)
    monkeypatch.setattr(scores, "CARRY_UNFOLD_MAX", 0)
    shifts = carry_forward(sums, count, decay)
    assert torch.equal(windows, shifts)
