"""The C++ and Triton slot-metadata reads against their torch twin (``PagedTiers.read_meta`` on the torch
backend), over tiers with ragged heads, holes filled by compaction, an empty head, an empty tier and reads past
the counts."""

from __future__ import annotations

import pytest
import torch

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
    assert tiers.backend == "torch"
    for tier, lay in enumerate(layouts):
        top = tiers.max_count(tier)
        for m in {top, top + 7, max(0, top - 3), 0}:
            want = tiers.read_meta(tier, m)
            got = read_meta(tiers.pool.data, tiers.tables[tier], tiers.counts[..., tier], tiers.tpp[tier], lay, m)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b)
        tiers.backend = backend  # and through the storage's own dispatch
        try:
            got = tiers.read_meta(tier)
        finally:
            tiers.backend = "torch"
        assert all(torch.equal(a, b) for a, b in zip(got, tiers.read_meta(tier), strict=True))
