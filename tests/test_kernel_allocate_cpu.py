"""The C++ allocation (selection, no sort) against its torch twin :func:`hfkv.policy.budget.allocate`: the same
states on random rows (ties, caps, floors, sinks, priors, a mid tier, both head modes), over a run of policy
steps as a decoding cache makes them, and at decode-sized rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from hfkv.kernels.cpu.allocate import allocate_cpu
from hfkv.policy.budget import allocate, held_bytes_of
from hfkv.states import EVICTED, ORIGINAL
from tests.policy_reference import reference_allocate
from tests.test_policy_budget import cases


@settings(max_examples=400, deadline=None)
@given(cases())
def test_cpu_allocation_equals_the_torch_twin(case):
    got = allocate_cpu(**case)
    assert got.dtype == torch.int8
    assert torch.equal(got, allocate(**case))
    assert got.tolist() == reference_allocate(**case)


def _step_case(seed: int, n: int, head_adaptive: bool, cap: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, h = 2, 3
    rows = (b,) if head_adaptive else (b, h)
    return dict(
        scores=torch.rand(b, h, n, generator=g) ** 4,
        state=torch.zeros(b, h, n, dtype=torch.int8),
        sink=(torch.arange(n) < 2).expand(b, h, n).clone(),
        logical_len=torch.full((b,), n),
        alpha_h=torch.tensor(float("inf")),
        alpha_l=torch.full((h,), 0.02),
        room=torch.full(rows, 520 * n // 6 * (h if head_adaptive else 1)),
        cost=(520, 200, 72),
        fidelity=(1.0, 0.93, 0.64),
        head_adaptive=head_adaptive,
        exact_cap=torch.full(rows, n // 10) if cap else None,
        prior=1.0,
    )


def run_of_policy_steps(allocate_fn, n: int = 400, steps: int = 12) -> None:
    """Each step: tokens leaving the window arrive exact, every score grows, the policy runs on the last
    step's states (as a cache does), and ``allocate_fn`` decides as the twin does, within the byte room."""
    for head_adaptive, cap in ((False, False), (True, True), (False, True)):
        case = _step_case(0, n, head_adaptive, cap)
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            got = allocate_fn(**case)
            assert torch.equal(got, allocate(**case)), (head_adaptive, cap, step)
            held = held_bytes_of(got, case["cost"])
            held = held.sum(1) if head_adaptive else held
            assert (held <= case["room"]).all()
            old = case["state"]
            assert ((got >= old) | (old == EVICTED)).all() and not (got[old == EVICTED] != EVICTED).any()
            b, h, _ = got.shape
            fresh = torch.full((b, h, 8), ORIGINAL, dtype=torch.int8)
            case["state"] = torch.cat([got, fresh], -1)
            case["sink"] = torch.cat([case["sink"], torch.zeros(b, h, 8, dtype=torch.bool)], -1)
            case["scores"] = torch.cat([case["scores"], torch.rand(b, h, 8, generator=g)], -1)
            case["scores"] = case["scores"] + 0.01 * torch.rand(case["scores"].shape, generator=g)
            case["logical_len"] = case["logical_len"] + 8


def test_a_run_of_policy_steps_stays_equal_within_the_room_and_never_promotes():
    run_of_policy_steps(allocate_cpu)


def test_decode_sized_rows_are_equal():
    for seed, (head_adaptive, cap) in enumerate(((False, True), (True, False))):
        case = _step_case(seed, 6000, head_adaptive, cap)
        case["state"] = torch.randint(0, 4, case["scores"].shape, generator=torch.Generator().manual_seed(seed))
        case["state"] = case["state"].to(torch.int8)
        assert torch.equal(allocate_cpu(**case), allocate(**case))


def test_large_rows_with_ties_and_every_kind_of_cut_are_equal():
    """Rows of tens of thousands of items go through sampled bracketing rounds before the single pivots: equal to
    the twin where scores tie in large blocks (the tie-break is the item's index), where the cut falls at the very
    start or past the end, and at rooms in between."""
    for seed, (head_adaptive, cap, levels) in enumerate(((True, False, 3), (False, True, 0), (True, True, 2))):
        case = _step_case(seed, 5000, head_adaptive, cap)
        g = torch.Generator().manual_seed(seed)
        if levels:  # a few distinct scores: ties everywhere
            case["scores"] = torch.randint(1, levels + 1, case["scores"].shape, generator=g).float() / 10
        case["state"] = torch.randint(0, 4, case["scores"].shape, generator=g).to(torch.int8)
        full = int(case["room"].flatten()[0])
        for room in (0, 71, full // 50, full // 3, full, 10 * full):
            case["room"] = torch.full_like(case["room"], room)
            assert torch.equal(allocate_cpu(**case), allocate(**case)), (seed, room)


def test_rows_past_32_bit_item_indices_are_refused_by_name():
    """The C++ items index a row's (token, item) pairs in 32 bits: a row with 2**31 of them is refused before
    anything is allocated (stride-0 views here, no memory)."""
    import pytest

    case = _step_case(0, 8, True, False)
    n = 2**31 // 9 + 1  # x 3 heads x 3 items
    for name in ("scores", "state", "sink"):
        case[name] = case[name][..., :1].expand(2, 3, n)
    with pytest.raises(ValueError, match=r"allocate_cpu: 238609295 tokens x 3 heads x 3 items a row exceed 2\*\*31"):
        allocate_cpu(**case)
