"""The Triton observation-window scores against their torch twin (the probabilities themselves): every GQA
reduction, group sizes 1, 3 and 4, windows shorter than the prompt and the prompt shorter than the window,
several key splits, fp32 and bf16 models, and a query view that is not contiguous."""

from __future__ import annotations

import pytest
import torch

import hfkv.kernels.observation as obs
from hfkv.kernels.observation import SPLIT_T, observation_scores, observation_scores_reference


def _inputs(b, hq, h, t, d, dtype, seed, tq=None):
    g = torch.Generator().manual_seed(seed)
    query = (torch.randn(b, hq, tq or t, d, generator=g) * 2).to(dtype)
    key = (torch.randn(b, h, t, d, generator=g) * 2).to(dtype)
    return query, key


@pytest.mark.parametrize("reduction", ["max", "mean", "l2"])
@pytest.mark.parametrize(
    "b,hq,h,t,d,window",
    [(2, 4, 4, 40, 16, 32), (1, 6, 2, 70, 32, 8), (2, 8, 2, 20, 16, 32), (1, 3, 1, SPLIT_T + 90, 16, 5)],
)
def test_triton_observation_scores_equal_the_probabilities_sums(reduction, b, hq, h, t, d, window):
    query, key = _inputs(b, hq, h, t, d, torch.float32, t + hq)
    sums, mass = observation_scores(query, key, d**-0.5, window, reduction)
    want_sums, want_mass = observation_scores_reference(query, key, d**-0.5, window, reduction)
    assert sums.shape == (b, h, t) and mass.shape == (b, t)
    torch.testing.assert_close(sums, want_sums, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=2e-5, atol=1e-6)
    w = min(window, t)
    # each window query's probabilities sum to 1 over the heads: the mass totals w * Hq
    torch.testing.assert_close(mass.sum(-1), torch.full((b,), float(w * hq)), rtol=1e-5, atol=1e-4)


def test_triton_bf16_keys_and_queries_give_the_fp32_products_scores():
    """bf16 operands: the products are exact in fp32, so the scores are the twin's on the same bf16 values."""
    query, key = _inputs(2, 8, 2, 300, 32, torch.bfloat16, 7)
    sums, mass = observation_scores(query, key, 32**-0.5, 32, "max")
    want_sums, want_mass = observation_scores_reference(query, key, 32**-0.5, 32, "max")
    torch.testing.assert_close(sums, want_sums, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-6)


def test_triton_a_strided_query_and_fewer_queries_than_keys():
    q_full, key = _inputs(1, 4, 2, 100, 16, torch.float32, 3, tq=60)
    query = q_full.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hq, T, D] view of a [B, T, Hq, D] tensor
    assert not query.is_contiguous()
    sums, mass = observation_scores(query, key, 0.25, 32, "mean")
    want_sums, want_mass = observation_scores_reference(query, key, 0.25, 32, "mean")
    torch.testing.assert_close(sums, want_sums, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dim", [8, 24, 80])
def test_triton_head_dims_off_a_power_of_two_are_padded_with_zeros(dim):
    """Below 16 (tl.dot's least) or not a power of two (a model with head_dim 80 or 96 takes this path too)."""
    query, key = _inputs(1, 4, 2, 70, dim, torch.float32, dim)
    sums, mass = observation_scores(query, key, dim**-0.5, 32, "max")
    want_sums, want_mass = observation_scores_reference(query, key, dim**-0.5, 32, "max")
    torch.testing.assert_close(sums, want_sums, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=2e-5, atol=1e-6)


def test_triton_bad_shapes_are_named():
    query, key = _inputs(1, 4, 2, 40, 16, torch.float32, 1)
    with pytest.raises(ValueError, match="do not match"):
        observation_scores(query, key[..., :8], 0.2, 8, "max")
    with pytest.raises(ValueError, match="do not match"):
        observation_scores(torch.cat([query, query], 1)[:, :5], key, 0.2, 8, "max")  # 5 query heads, 2 KV heads
    query, key = _inputs(1, 4, 2, 40, 16, torch.float32, 1)
    with pytest.raises(ValueError, match="unknown GQA reduction 'sum'"):
        observation_scores(query, key, 0.2, 8, "sum")


def _oq_rows():
    g = torch.Generator().manual_seed(11)
    t = 2500  # three blocks of the kernel's 1024
    sharp = torch.rand(4, t, generator=g) ** 8
    sharp[1, 1700] = 500.0  # one key carries almost all the mass: the log1p of the rest
    sharp[2, :] = 0.0
    sharp[2, [3, 900, 2400]] = 1.0  # equal maxima: the first is the top
    mask = torch.rand(4, t, generator=g) < 0.9
    mask[3, :] = False
    mask[3, :1] = True  # one considered key: degenerate, 0
    return sharp, mask


@pytest.mark.parametrize("case", ["random", "degenerate"])
def test_triton_oq_score_equals_the_torch_statistics(case):
    from hfkv.kernels.observation import oq_score_triton
    from hfkv.policy.oq import ARKV_TAU, oq_score_from_mass

    if case == "random":
        total, mask = _oq_rows()
    else:  # no considered key, all-zero mass, uniform (V == 0), uniform to fp32 rounding, one-hot
        total = torch.tensor([[0.3, 0.7, 0, 0, 0, 0, 0], [0.0] * 7, [0.2] * 5 + [0, 0], [1 / 7] * 7,
                              [0, 1.0, 0, 0, 0, 0, 0]])  # fmt: skip
        mask = torch.tensor([[False] * 7, [True] * 7, [True] * 5 + [False] * 2, [True] * 7, [True] * 7])
    got = oq_score_triton(total, mask, ARKV_TAU)
    want = oq_score_from_mass(total, mask, ARKV_TAU)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=0)
    assert (got == 0).tolist() == (want == 0).tolist()
    if case == "random":
        assert bool((want[:3] > 0).all()) and want[3] == 0


def test_triton_long_prompts_grow_the_splits_not_their_count(monkeypatch):
    """Past MAX_SPLITS splits of SPLIT_T keys the splits grow (in whole blocks): same scores."""
    monkeypatch.setattr(obs, "SPLIT_T", 64)
    monkeypatch.setattr(obs, "MAX_SPLITS", 3)
    query, key = _inputs(1, 4, 2, 450, 16, torch.float32, 5)  # 450 keys: splits of 192, three of them
    sums, mass = observation_scores(query, key, 0.25, 32, "max")
    want_sums, want_mass = observation_scores_reference(query, key, 0.25, 32, "max")
    torch.testing.assert_close(sums, want_sums, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=2e-5, atol=1e-6)
