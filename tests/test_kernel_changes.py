"""The Triton and C++ counts of what a policy run changes per tier against their torch twin: one to three tiers, empty
tiers, invalid slots, the window's exits after the tiers (never counted), and every state."""

from __future__ import annotations

import pytest
import torch

from hfkv.kernels.changes import tier_changes, tier_changes_reference
from hfkv.kernels.cpu.meta import tier_changes_cpu

KERNELS = {"triton": tier_changes, "cpu": tier_changes_cpu}


@pytest.mark.parametrize("sizes,exits", [([5], 0), ([0, 700], 3), ([40, 0, 1300], 8), ([0, 0, 0], 5), ([3, 2, 1], 0)])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_tier_changes_equal_the_torch_twin(kernel, sizes, exits):
    g = torch.Generator().manual_seed(sum(sizes) + exits)
    n = sum(sizes) + exits
    for trial in range(3):
        new = torch.randint(0, 4, (2, 3, n), generator=g).to(torch.int8)
        if trial == 1:  # nothing moves: every slot stays in its tier
            new = torch.cat([torch.full((2, 3, s), t, dtype=torch.int8) for t, s in enumerate(sizes)]
                            + [torch.zeros(2, 3, exits, dtype=torch.int8)], -1)  # fmt: skip
        valid = torch.rand(2, 3, n, generator=g) < 0.8
        want = tier_changes_reference(new, valid, sizes)
        assert KERNELS[kernel](new, valid, sizes) == want
        if trial == 1:
            assert all(c == (0, 0) for c in want)


def test_the_window_exits_are_not_counted():
    new = torch.tensor([[[0, 3, 3, 3]]], dtype=torch.int8)  # one tier slot (stays), three exits (evicted)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    assert tier_changes(new, valid, [1]) == tier_changes_reference(new, valid, [1]) == [(0, 0)]
    assert tier_changes_cpu(new, valid, [1]) == [(0, 0)]
