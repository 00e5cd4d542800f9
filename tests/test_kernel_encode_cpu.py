"""The C++ encode+write against its torch twin, byte for byte over the whole pool, on the rows of
tests/test_kernel_encode.py (ties, constant and tiny groups, negative scales, signed zeros, every format)."""

from __future__ import annotations

import zlib

import pytest
import torch

from hfkv.kernels.cpu.encode import encode_write_cpu
from hfkv.kernels.encode import encode_write_reference
from tests.test_kernel_encode import CASES, F16, _check_decoded, _covered, _inputs, _layout, _pool_and_dest, _records


@pytest.mark.parametrize("key,value,model_dtype,in_dtype,dim,group", CASES)
def test_cpu_encode_write_matches_twin_and_decodes(key, value, model_dtype, in_dtype, dim, group):
    g = torch.Generator().manual_seed(zlib.crc32(f"cpu{key}{value}{model_dtype}{in_dtype}{dim}{group}".encode()))
    layout = _layout(key, value, dim, group, model_dtype)
    for n in (1, 12, 300):  # one token, every row kind, and enough to run on several threads
        k = _inputs(layout.key, n, in_dtype, g, 0)
        v = _inputs(layout.value, n, in_dtype, g, 3)
        pos = torch.randint(0, 1 << 20, (n,), generator=g)
        score = torch.rand(n, generator=g) * 10
        pool, dest = _pool_and_dest(layout, n, g, tpp=5, pages=n // 5 + 2)
        got, want = pool.clone(), pool.clone()
        encode_write_cpu(got, dest, layout, k, v, pos, score)
        encode_write_reference(want, dest, layout, k, v, pos, score)
        assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ from the twin (n={n})"
        outside = ~_covered(pool, layout.record_index(dest, pool.shape[1]))
        assert torch.equal(got[outside], pool[outside])
        rec = _records(got, dest, layout)
        kd, vd = layout.decode_kv(rec, torch.float32)
        _check_decoded(layout.key, kd, k)
        _check_decoded(layout.value, vd, v)


def test_cpu_encode_write_names_bad_inputs():
    layout = _layout("int4", "int2", 64, 32, F16)
    pool = torch.zeros(2, layout.nbytes * 4, dtype=torch.uint8)
    dest, k = torch.arange(3) * layout.stride, torch.randn(3, 64)
    ok = dict(pool=pool, dest=dest, layout=layout, k=k, v=k, pos=torch.arange(3), score=torch.rand(3))
    for change, match in (
        ({"k": torch.randn(3, 32)}, r"k must be \[3, 64\]"),
        ({"v": k.double()}, r"v must be \[3, 64\] in one of"),
        ({"dest": dest.int()}, r"dest must be int64"),
        ({"pos": torch.rand(3)}, r"pos \(integer\)"),
        ({"pool": pool.view(torch.int32)}, r"pool must be a contiguous uint8"),
        ({"dest": dest + pool.numel()}, r"dest must be slot starts"),
        ({"dest": dest + 3 * layout.stride}, r"dest must be slot starts"),  # past the page's records
    ):
        with pytest.raises(ValueError, match=match):
            encode_write_cpu(**{**ok, **change})
