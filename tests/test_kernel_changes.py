"""The Triton and C++ counts of what a policy run changes per tier against their torch twin: one to three tiers, empty
tiers, invalid slots, the window's exits after the tiers (never counted), and every state; the move plan made from
the same launch (hfkv.kernels.moves) against its twin."""

from __future__ import annotations

import pytest
import torch

from hfkv.kernels.changes import tier_changes, tier_changes_reference
from hfkv.kernels.cpu.meta import tier_changes_cpu
from hfkv.kernels.moves import plan_moves, plan_moves_reference
from hfkv.states import EVICTED

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


@pytest.mark.parametrize("sizes,exits", [([5], 0), ([0, 70], 3), ([40, 0, 130], 8), ([0, 0, 0], 5), ([300, 200], 8)])
def test_triton_move_plan_equals_the_torch_twin(sizes, exits):
    """hfkv.kernels.moves.plan_moves: the counts, and each mover's head, source and slot, destination after
    destination, heads and candidates in order, as nonzero and a stable sort give them; heads past the kernel's
    block of preceding heads (5 x 31 heads) included."""
    g = torch.Generator().manual_seed(sum(sizes) + exits)
    n = sum(sizes) + exits
    for bsz, heads in [(2, 3), (5, 31)]:
        new = torch.randint(0, 4, (bsz, heads, n), generator=g)
        new = torch.where(new >= len(sizes), EVICTED, new).to(torch.int8)  # only tiers that exist
        # each head holds at least its valid slots of each tier (slots are live below the count)
        counts = torch.stack([torch.randint(s, s + 40, (bsz, heads), generator=g) for s in sizes], -1)
        valid = torch.rand(bsz, heads, n, generator=g) < 0.8
        tpp = [3, 5, 8][: len(sizes)]
        got, want = plan_moves(new, valid, sizes, counts, tpp), plan_moves_reference(new, valid, sizes, counts, tpp)
        assert got[:4] == want[:4] and got[2] is not None and got[3] is None
        assert got[0] == tier_changes_reference(new, valid, sizes)
        assert plan_moves(new, valid, sizes)[:4] == (*want[:2], None, None)  # no counts: no pages
        for a, b in zip(got[4:8], want[4:8], strict=True):
            assert torch.equal(a, b)
        assert sum(got[1]) == got[4].numel()
        # each head's count after the removal and tokens entering, per tier (what the appends start from)
        assert all(torch.equal(a.long(), b.long()) for a, b in zip(got[8], want[8], strict=True))
        # the tier peak after the run: per head, or summed over a batch row's heads; costs past 2**31 in all
        for cost, group in [([1] * len(sizes), 1), ([520, 136, 72][: len(sizes)], heads), ([9 << 28] * len(sizes), 1)]:
            peak = plan_moves(new, valid, sizes, counts, tpp, (cost, group))[3]
            assert peak == plan_moves_reference(new, valid, sizes, counts, tpp, (cost, group))[3] > 0
        assert got[4].numel() > 0 or (len(sizes) == 1 and not exits)  # one tier and no exits: nothing can move


def test_triton_exit_gather_writes_only_the_exit_rows():
    """gather_exits writes only the plan's exit rows (as fp32; strided keys), nothing of the other rows."""
    from hfkv.kernels.moves import EXIT, gather_exits

    g = torch.Generator().manual_seed(3)
    ek, ev = (torch.randn(2, 3, 4, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    ek, ev = ek[..., ::2], ev[..., 8:]  # last dims of stride 2 and 1
    epos, escore = torch.arange(100, 104), torch.rand(2, 3, 4, generator=g)
    b, h, src, idx = (torch.tensor(x) for x in ([0, 1, 1, 0], [2, 0, 1, 1], [EXIT, 0, EXIT, EXIT], [3, 0, 0, 1]))
    out = (torch.full((4, 8), -7.0), torch.full((4, 8), -7.0), torch.full((4,), -7), torch.full((4,), -7.0))
    gather_exits(ek, ev, epos, escore, b, h, src, idx, out)
    for j in range(4):
        if src[j] == EXIT:
            assert torch.equal(out[0][j], ek[b[j], h[j], idx[j]].float())
            assert torch.equal(out[1][j], ev[b[j], h[j], idx[j]].float())
            assert out[2][j] == epos[idx[j]] and out[3][j] == escore[b[j], h[j], idx[j]]
        else:  # another source's row: untouched
            assert (out[0][j] == -7).all() and out[2][j] == -7
