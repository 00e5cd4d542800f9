"""A tier's compaction by the C++ kernel and by the Triton kernel against its torch twin (``PagedTiers.remove`` on
the torch backend): the same pool bytes, page tables, counts and free pages after removals that leave holes,
empty heads, whole freed pages, keep flags past the counts, and nothing to move at all; and a policy run's removals
of every tier in two launches against one removal after another."""

from __future__ import annotations

import copy

import pytest
import torch

from hfkv.kernels.backend import backend_ops
from hfkv.storage import PagedTiers
from tests.test_kernel_decode_attention import _layout, _storage


def _state(t: PagedTiers) -> tuple:
    return (t.pool.data.clone(), [x.clone() for x in t.tables], t.counts.clone(),
            t.pool.free_stack[: t.pool.n_free].clone())  # fmt: skip


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dim,dtype,page_bytes,counts,p_keep", [
    (64, torch.float32, None, (40, 70), 0.7),
    (32, torch.bfloat16, 528, (0, 33), 0.3),
    (128, torch.float16, 4096, (17, 1), 0.9),
    (64, torch.float32, None, (40, 70), 0.0),  # everything removed: every page freed
    (64, torch.float32, None, (40, 70), 1.0),  # nothing removed: nothing moves
])  # fmt: skip
def test_compaction_kernels_equal_the_torch_path(backend, dim, dtype, page_bytes, counts, p_keep):
    layouts = (_layout("model", "model", dim, dtype), _layout("int4", "int2", dim, dtype))
    ref: PagedTiers = _storage(layouts, 3, 2, dim, 160, counts, page_bytes, seed=dim)
    assert ref.ops.name == "torch"
    got = copy.deepcopy(ref)
    got.ops = backend_ops(backend)
    g = torch.Generator().manual_seed(dim)
    for round_ in range(3):  # removals on top of removals: holes filled before, tags already cleared
        for tier in range(len(layouts)):
            m = ref.max_count(tier) + 3
            keep = torch.rand(3, 2, m, generator=g) < p_keep
            keep[..., -3:] = True  # flags past a head's count must not matter
            if round_ == 1:
                keep[0, 1] = False  # one head emptied
            ref.remove(tier, keep)
            got.remove(tier, keep)
            for a, b in zip(_state(got), _state(ref), strict=True):
                if isinstance(a, list):
                    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
                else:
                    assert torch.equal(a, b)


@pytest.mark.parametrize("tiers", [[0, 1], [1], [0, 1, 2], [0, 2]])
def test_triton_removals_of_a_run_in_two_launches_equal_one_removal_after_another(tiers):
    """``PagedTiers.remove_states`` on Triton (every tier's compaction in one launch, their page releases in one
    program, the freed pages pushed tier after tier) leaves the torch path's storage: one removal after another,
    each keeping the slots whose new state (a run's states, every tier's side by side) is the tier's own."""
    dim = 64
    layouts = (_layout("model", "model", dim, torch.float32), _layout("int8", "int4", dim, torch.float32),
               _layout("int4", "int2", dim, torch.float32))  # fmt: skip
    ref: PagedTiers = _storage(layouts, 3, 2, dim, 200, (40, 30, 70), 2048, seed=len(tiers))
    got = copy.deepcopy(ref)
    got.ops = backend_ops("triton")
    g = torch.Generator().manual_seed(len(tiers))
    for _ in range(2):
        sizes = [ref.max_slots(t) for t in range(3)]
        states = torch.randint(0, 4, (3, 2, sum(sizes) + 5), generator=g).to(torch.int8)  # + 5: the window's exits
        pages = []
        for t in tiers:  # what the plan would know: the pages freed and the table's width after
            col = sum(sizes[:t])
            kept = ((states[..., col : col + sizes[t]] == t) & ref.read_meta(t, sizes[t])[2]).sum(-1)
            old, new = (-(-x // ref.tpp[t]) for x in (ref.counts[..., t], kept))
            pages.append((int((old - new).sum()), int(new.max())))
        ref.remove_states(states, sizes, tiers, pages)
        got.remove_states(states, sizes, tiers, pages)
        assert any(p[0] for p in pages)  # pages were freed
        for a, b in zip(_state(got), _state(ref), strict=True):
            if isinstance(a, list):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            else:
                assert torch.equal(a, b)
        assert got.versions == ref.versions
