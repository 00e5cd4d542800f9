"""The Triton allocation against its torch twin :func:`hfkv.policy.budget.allocate`: the same states on random
rows (ties, caps, floors, sinks, priors, a mid tier, both head modes), over a run of policy steps as a decoding
cache makes them, and at decode-sized rows (a row's scan over several blocks)."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from hfkv.kernels.allocate import allocate_triton
from hfkv.policy.budget import allocate
from tests.policy_reference import reference_allocate
from tests.test_kernel_allocate_cpu import _step_case, run_of_policy_steps
from tests.test_policy_budget import cases


@settings(max_examples=150, deadline=None)
@given(cases())
def test_triton_allocation_equals_the_torch_twin(case):
    got = allocate_triton(**case)
    assert got.dtype == torch.int8
    assert torch.equal(got, allocate(**case))
    assert got.tolist() == reference_allocate(**case)


def test_triton_allocation_over_a_run_of_policy_steps():
    run_of_policy_steps(allocate_triton, n=300, steps=6)


def test_triton_allocation_of_decode_sized_rows():
    for seed, (head_adaptive, cap) in enumerate(((False, True), (True, False))):
        case = _step_case(seed, 3000, head_adaptive, cap)
        case["state"] = torch.randint(0, 4, case["scores"].shape, generator=torch.Generator().manual_seed(seed))
        case["state"] = case["state"].to(torch.int8)
        want = allocate(**case)
        assert not torch.equal(want, case["state"])  # the scan decided something
        assert torch.equal(allocate_triton(**case), want)


def test_triton_allocation_with_a_prior_that_is_not_a_power_of_two():
    """The prior term at lengths and a prior where rounding matters (the kernel rounds ``prior / N`` as torch does,
    reciprocal then product); decisions equal the twin's."""
    for seed in range(4):
        case = _step_case(seed, 500, seed % 2 == 1, seed >= 2)
        case["prior"] = 0.3
        case["logical_len"] = torch.tensor([997, 3001])
        assert torch.equal(allocate_triton(**case), allocate(**case))
