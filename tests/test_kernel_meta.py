"""The C++ and Triton slot-metadata reads against their torch twin (``PagedTiers.read_meta`` on the torch
backend), over tiers with ragged heads, holes filled by compaction, an empty head, an empty tier and reads past
the counts."""

from __future__ import annotations

import pytest
import torch

from hfkv.kernels.backend import backend_ops
from hfkv.kernels.cpu.meta import read_meta_cpu
from hfkv.kernels.meta import read_meta_triton
from hfkv.storage import PagedTiers
from tests.test_kernel_decode_attention import _layout, _storage


@pytest.mark.parametrize("backend,read_meta", [("cpu", read_meta_cpu), ("triton", read_meta_triton)])
@pytest.mark.parametrize("dim,dtype,page_bytes,counts", [
    (64, torch.float32, None, (40, 70)),
    (32, torch.bfloat16, 528, (0, 33)),
    (128, torch.float16, 4096, (17, 1)),
])  # fmt: skip
def test_read_meta_kernels_equal_the_torch_path(backend, read_meta, dim, dtype, page_bytes, counts):
    layouts = (_layout("model", "model", dim, dtype), _layout("int4", "int2", dim, dtype))
    tiers: PagedTiers = _storage(layouts, 3, 2, dim, 160, counts, page_bytes, seed=dim)
    assert tiers.ops.name == "torch"
    for tier, lay in enumerate(layouts):
        top = tiers.max_count(tier)
        for m in {top, top + 7, max(0, top - 3), 0}:
            want = tiers.read_meta(tier, m)
            got = read_meta(tiers.pool.data, tiers.tables[tier], tiers.counts[..., tier], tiers.tpp[tier], lay, m)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b)
        tiers.ops = backend_ops(backend)  # and through the storage's own dispatch
        try:
            got = tiers.read_meta(tier)
        finally:
            tiers.ops = backend_ops("torch")
        assert all(torch.equal(a, b) for a, b in zip(got, tiers.read_meta(tier), strict=True))


@pytest.mark.parametrize("dim,dtype,page_bytes,counts", [
    (64, torch.float32, None, (40, 70)),
    (32, torch.bfloat16, 528, (0, 33)),
    (64, torch.float32, 2048, (30, 20, 50)),  # three tiers (a mid one): every part of the Triton launch
])  # fmt: skip
@pytest.mark.parametrize("m_exit", [0, 5])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_policy_candidates_from_kernels_equal_the_torch_composition(backend, dim, dtype, page_bytes, counts, m_exit):
    """A policy run's candidates (every tier's slots, then the window's exits; padding evicted) read in one C++ pass
    or one Triton launch equal the torch backend's reads, concatenations and select: positions, scores, validity,
    state and widths."""
    layouts = (_layout("model", "model", dim, dtype), _layout("int4", "int2", dim, dtype))
    if len(counts) == 3:
        layouts = (layouts[0], _layout("int8", "int4", dim, dtype), layouts[1])
    tiers: PagedTiers = _storage(layouts, 3, 2, dim, 160, counts, page_bytes, seed=dim + m_exit)
    g = torch.Generator().manual_seed(m_exit)
    exit_pos = torch.arange(m_exit, dtype=torch.int64) + 150
    exit_score = torch.rand(3, 2, m_exit, generator=g)
    pad_end = torch.tensor([0, 152, 400])  # row 1: two exits are padding; row 2: every exit
    want = tiers.candidates(exit_pos, exit_score, pad_end)
    means = tiers.candidates(exit_pos, exit_score, pad_end, (170, 40))  # sums over the queries since 40 of 170
    tiers.ops = backend_ops(backend)
    try:
        got = tiers.candidates(exit_pos, exit_score, pad_end)
        got_means = tiers.candidates(exit_pos, exit_score, pad_end, (170, 40))
    finally:
        tiers.ops = backend_ops("torch")
    assert torch.equal(got_means[1], means[1]) and not torch.equal(means[1], want[1])
    assert torch.equal(means[1], want[1] / (170 - want[0].clamp(min=40)).clamp_min(1))
    assert got[4] == want[4] and sum(want[4]) + m_exit == want[0].shape[-1]
    for a, b in zip(got[:4], want[:4], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    state, valid = want[3], want[2]
    if m_exit:
        assert (state[1, :, -m_exit:] == torch.tensor([3, 3, 0, 0, 0], dtype=torch.int8)).all()  # EVICTED, ORIGINAL
        assert not valid[2, :, -m_exit:].any() and valid[0, :, -m_exit:].all()
    col = 0
    for tier, width in enumerate(want[4]):  # a live slot's state is its tier
        assert (state[..., col : col + width][valid[..., col : col + width]] == tier).all()
        col += width
    assert (state[~valid] == 3).all()


def test_policy_candidates_name_a_mismatched_exit_score():
    from hfkv.kernels.cpu.meta import read_candidates_cpu

    layouts = (_layout("int4", "int2", 32, torch.float32),)
    tiers: PagedTiers = _storage(layouts, 1, 2, 32, 40, (10,), None, seed=1)
    with pytest.raises(ValueError, match=r"exit_score \(1, 2, 3\), expected \(1, 2, 4\)"):
        read_candidates_cpu(tiers.pool.data, tiers.tables, tiers.counts, tiers.tpp, layouts, [tiers.max_slots(0)],
                            torch.arange(4), torch.zeros(1, 2, 3), torch.zeros(1, dtype=torch.long))  # fmt: skip
