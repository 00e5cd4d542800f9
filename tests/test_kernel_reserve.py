"""The Triton and C++ slot reservations against their torch twin (``PagedTiers._reserve`` on the torch backend):
the same byte offsets, page tables, counts, free pages and pool bytes (new pages zeroed, reused ones included)
for appends into partly filled pages, heads that need several pages or none, and an empty tier."""

from __future__ import annotations

import copy

import pytest
import torch

from hfkv.kernels.backend import backend_ops
from hfkv.storage import PagedTiers
from tests.test_kernel_decode_attention import _layout, _storage


def _appends(bsz: int, heads: int, per_head: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, h)`` of ``per_head[b * heads + h]`` records per head, grouped in head order."""
    bh = torch.repeat_interleave(torch.arange(bsz * heads), torch.tensor(per_head))
    return bh // heads, bh % heads


def _same_storage(a: PagedTiers, b: PagedTiers) -> None:
    assert torch.equal(a.counts, b.counts)
    assert all(torch.equal(x, y) for x, y in zip(a.tables, b.tables, strict=True))
    assert a.pool.n_free == b.pool.n_free
    assert torch.equal(a.pool.free_stack[: a.pool.n_free], b.pool.free_stack[: b.pool.n_free])
    assert torch.equal(a.pool.data, b.pool.data)


@pytest.mark.parametrize("page_bytes,counts,rounds", [
    (None, (40, 70), [[3, 0, 1, 9, 0, 2], [0, 0, 0, 0, 0, 1], [30, 1, 0, 0, 12, 5]]),
    (528, (0, 33), [[1, 1, 1, 1, 1, 1], [7, 0, 7, 0, 7, 0]]),
    (4096, (17, 1), [[0, 0, 0, 0, 0, 0], [90, 3, 2, 1, 0, 40]]),
])  # fmt: skip
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_reserve_equals_the_torch_path(backend, page_bytes, counts, rounds):
    dim, bsz, heads = 64, 2, 3
    layouts = (_layout("model", "model", dim, torch.float32), _layout("int4", "int2", dim, torch.float32))
    base: PagedTiers = _storage(layouts, bsz, heads, dim, 160, counts, page_bytes, seed=len(rounds))
    # Dirty the free pages: a reused page must come back zeroed.
    base.pool.data[base.pool.free_stack[: base.pool.n_free].long()] = 0xAB
    torch_side, triton_side = copy.deepcopy(base), copy.deepcopy(base)
    triton_side.ops = backend_ops(backend)
    planned = copy.deepcopy(triton_side)  # told the pages and each head's count and appends (a planned run's)
    for per_head in rounds:
        for tier in range(len(layouts)):
            b, h = _appends(bsz, heads, per_head)
            old = planned.counts[..., tier].reshape(-1).clone()
            k = torch.tensor(per_head, dtype=torch.int32)
            tpp = planned.tpp[tier]
            after = (old + k + tpp - 1) // tpp
            pages = (int((after - (old + tpp - 1) // tpp).sum()), int(after.max()))
            want = torch_side._reserve_offsets(tier, b, h)
            got = triton_side._reserve_offsets(tier, b, h)
            assert got.dtype == torch.int64 and torch.equal(got, want)
            _same_storage(torch_side, triton_side)
            assert torch.equal(planned._reserve_offsets(tier, b, h, pages, (old, k)), want)
            _same_storage(torch_side, planned)
    assert torch_side.versions == triton_side.versions
