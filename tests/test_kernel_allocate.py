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
    # straight to the ranking, whether or not everything fits (what the check would have short-cut): the same states
    assert torch.equal(allocate_triton(**case, fast_path=False), got)


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


def test_triton_sinks_by_position_and_scalar_lengths_and_room_decide_as_the_mask_and_tensors():
    """A policy run passes its sinks as positions and a sink end per row (``Sinks``: a held slot below the end) and one
    length and room for every row (ints): the Triton kernels compare and read them as launch arguments, the C++ and
    torch paths make the mask and tensors; every one decides as the twin given the mask and the tensors."""
    from hfkv.kernels.cpu.allocate import allocate_cpu
    from hfkv.policy.unified import Sinks
    from hfkv.states import EVICTED

    differs = 0
    for seed in range(6):
        head_adaptive, cap = seed % 2 == 1, seed >= 3
        case = _step_case(seed, 700, head_adaptive, cap)
        g = torch.Generator().manual_seed(seed)
        b, h, n = case["scores"].shape
        case["state"] = torch.randint(0, 4, (b, h, n), generator=g).to(torch.int8)  # evicted slots among them
        pos = torch.randint(0, 900, (b, h, n), generator=g)
        end = torch.tensor([40 + 97 * seed, 5])
        length, room = 650 + seed, int(case["room"].reshape(-1)[0])
        mask = (case["state"] != EVICTED) & (pos < end.view(-1, 1, 1))
        tensors = {**case, "logical_len": torch.full((b,), length), "room": torch.full(case["room"].shape, room)}
        want = allocate(**{**tensors, "sink": mask})
        fast = {**case, "sink": Sinks(pos, end), "logical_len": length, "room": room}
        for fn in (allocate_triton, allocate_cpu, allocate):
            assert torch.equal(fn(**fast), want), (fn.__name__, seed)
        differs += not torch.equal(want, allocate(**{**tensors, "sink": torch.zeros_like(mask)}))
    assert differs  # the sinks changed decisions


def test_triton_ranking_without_the_fits_check_keeps_everything_when_everything_fits():
    """``fast_path=False`` skips the read of "does everything fit?": where it all fits, the ranking itself must keep
    every token as it is (what the check short-cuts to), caps and both head modes included."""
    for seed, (head_adaptive, cap) in enumerate(((False, False), (True, False), (False, True))):
        case = _step_case(seed, 400, head_adaptive, cap)
        g = torch.Generator().manual_seed(seed)
        case["state"] = torch.randint(0, 4, case["scores"].shape, generator=g).to(torch.int8)
        case["room"] = case["room"] * 100
        case["alpha_l"] = torch.zeros_like(case["alpha_l"])  # no floor: nothing is evicted whatever its score
        if cap:
            case["exact_cap"] = case["exact_cap"] * 100
        assert torch.equal(allocate(**case), case["state"])  # it all fits: nothing moves
        assert torch.equal(allocate_triton(**case, fast_path=False), case["state"])


def test_thresholds_per_head_are_passed_as_they_are_when_already_a_contiguous_fp32_row():
    """A layer's own thresholds (fp32, one per head) reach the kernel as they are, every policy run; anything else
    is made into that row with the values :func:`hfkv.policy.unified._per_head` gives."""
    from hfkv.policy.unified import _per_head, head_row

    cpu = torch.device("cpu")
    row = torch.tensor([0.5, 1.5, 2.5])
    assert head_row(row, 3, cpu) is row
    for alpha in (torch.tensor(0.75), torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64), row.view(1, 3, 1),
                  torch.tensor([[0.5, 9.0], [1.5, 9.0], [2.5, 9.0]])[:, 0]):  # fmt: skip
        got = head_row(alpha, 3, cpu)
        assert got is not alpha and got.dtype == torch.float32 and got.shape == (3,) and got.is_contiguous()
        assert torch.equal(got, _per_head(alpha, 3, cpu).reshape(3))


def test_host_grid_division_is_the_ceiling():
    import math

    from hfkv.kernels.grid import cdiv

    assert all(cdiv(a, b) == math.ceil(a / b) for a in range(0, 300) for b in (1, 2, 3, 7, 64, 128))
