"""The Triton and C++ gather-and-decode of given slots against their torch twin (``PagedTiers.gather_decoded``
on the torch backend: the records gathered through the page table, ``RecordLayout.decode_kv``, positions,
scores): equal bit for bit for every tier format and model dtype, over ragged storage with holes filled by
compaction, and through ``PagedTiers.gather_decoded``'s dispatch."""

from __future__ import annotations

import pytest
import torch

from hfkv.kernels.backend import backend_ops
from hfkv.kernels.cpu.gather import gather_decode_cpu
from hfkv.kernels.gather import gather_decode
from hfkv.storage import PagedTiers
from tests.test_kernel_decode_attention import _layout, _storage


@pytest.mark.parametrize("key,value,dim,dtype", [
    ("model", "model", 64, torch.bfloat16),
    ("int8", "int4", 128, torch.bfloat16),
    ("int4", "int2", 64, torch.float16),
    ("fp8", "fp8", 64, torch.float32),
    ("int2", "int8", 96, torch.float32),
])  # fmt: skip
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_gather_decode_equals_the_torch_twin(backend, key, value, dim, dtype):
    fn = gather_decode if backend == "triton" else gather_decode_cpu
    layouts = (_layout("model", "model", dim, dtype), _layout(key, value, dim, dtype))
    tiers: PagedTiers = _storage(layouts, 2, 3, dim, 200, (30, 90), 2048, seed=dim)
    for tier, lay in enumerate(layouts):
        live = torch.arange(tiers.max_slots(tier)) < tiers.counts[..., tier, None]
        b, h, s = (live & (torch.rand(live.shape, generator=torch.Generator().manual_seed(tier)) < 0.6)).nonzero(
            as_tuple=True
        )
        assert s.numel() > 0
        assert tiers.ops.name == "torch"
        want = tiers.gather_decoded(tier, b, h, s)
        got = fn(tiers.pool.data, tiers.tables[tier], tiers.tpp[tier], lay, b, h, s)
        for x, y in zip(got, want, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)
        assert torch.equal(got[2], lay.positions(tiers.gather(tier, b, h, s)).long())
        tiers.ops = backend_ops(backend)  # and through the storage's dispatch
        try:
            through = tiers.gather_decoded(tier, b, h, s)
        finally:
            tiers.ops = backend_ops("torch")
        assert all(torch.equal(x, y) for x, y in zip(through, tiers.gather_decoded(tier, b, h, s), strict=True))
    empty = torch.zeros(0, dtype=torch.long)
    none = fn(tiers.pool.data, tiers.tables[0], tiers.tpp[0], layouts[0], empty, empty, empty)
    assert none[0].shape == (0, dim) and none[2].shape == (0,)
