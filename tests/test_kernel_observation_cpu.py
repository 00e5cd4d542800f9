"""The CPU observation-window scores against their torch twin (the probabilities themselves): every GQA reduction,
group sizes 1, 3 and 4, windows shorter than the prompt and the prompt shorter than the window, fewer queries than
keys, fp32 and bf16 models, a query view that is not contiguous, one thread and several."""

from __future__ import annotations

import pytest
import torch

from hfkv.kernels.cpu.observation import observation_scores_cpu
from hfkv.kernels.observation import observation_scores_reference
from tests.test_kernel_observation import _inputs


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("reduction", ["max", "mean", "l2"])
@pytest.mark.parametrize(
    "b,hq,h,t,d,window,tq",
    [(2, 4, 4, 40, 16, 32, None), (1, 6, 2, 70, 32, 8, None), (2, 8, 2, 20, 16, 32, None),
     (1, 3, 1, 1500, 64, 5, None), (2, 9, 3, 300, 64, 32, 200)],
)  # fmt: skip
def test_cpu_observation_scores_equal_the_probabilities_sums(reduction, b, hq, h, t, d, window, tq, threads):
    query, key = _inputs(b, hq, h, t, d, torch.float32, t + hq, tq)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sums, mass = observation_scores_cpu(query, key, d**-0.5, window, reduction)
    finally:
        torch.set_num_threads(saved)
    want_sums, want_mass = observation_scores_reference(query, key, d**-0.5, window, reduction)
    assert sums.shape == (b, h, t) and mass.shape == (b, t)
    torch.testing.assert_close(sums, want_sums, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=2e-5, atol=1e-6)
    w = min(window, tq or t)
    # each window query's probabilities sum to 1 over the heads: the mass totals w * Hq
    torch.testing.assert_close(mass.sum(-1), torch.full((b,), float(w * hq)), rtol=1e-5, atol=1e-4)


def test_cpu_bf16_and_a_strided_query():
    q_full, key = _inputs(2, 9, 3, 300, 64, torch.bfloat16, 7)
    query = q_full.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hq, T, D] view of a [B, T, Hq, D] tensor
    assert not query.is_contiguous()
    sums, mass = observation_scores_cpu(query, key, 64**-0.5, 32, "max")
    want_sums, want_mass = observation_scores_reference(query, key, 64**-0.5, 32, "max")
    torch.testing.assert_close(sums, want_sums, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-6)


def test_cpu_nothing_observed_and_bad_input():
    query, key = _inputs(1, 4, 2, 10, 8, torch.float32, 1)
    sums, mass = observation_scores_cpu(query, key, 1.0, 0, "max")
    assert sums.shape == (1, 2, 10) and not sums.any() and mass.shape == (1, 10) and not mass.any()
    with pytest.raises(ValueError, match="unknown GQA reduction 'sum'"):
        observation_scores_cpu(query, key, 1.0, 4, "sum")
    with pytest.raises(ValueError, match=r"query \(1, 4, 10, 8\) and key \(1, 3, 10, 8\) do not match"):
        observation_scores_cpu(query, torch.zeros(1, 3, 10, 8), 1.0, 4, "max")
