"""compiled_kernels() counts the instances in Triton's per-device kernel caches of hfkv's kernels, and only those."""

from __future__ import annotations

import sys
import types

import pytest

triton = pytest.importorskip("triton")


def test_compiled_instances_are_counted_per_kernel_and_device(monkeypatch):
    from triton.runtime.jit import JITFunction

    from hfkv.kernels.compiles import compiled_kernels

    def body(x):  # a stand-in kernel: only its caches are read
        pass

    mine, other = JITFunction(body), JITFunction(body)
    base = compiled_kernels()
    monkeypatch.setitem(sys.modules, "hfkv.kernels._fake", types.SimpleNamespace(k=mine))
    monkeypatch.setitem(sys.modules, "elsewhere._fake", types.SimpleNamespace(k=other))
    # Triton's layout: device_caches[device] = (kernel_cache, kernel_key_cache, target, backend, binder)
    mine.device_caches[0] = ({"a": 1, "b": 2}, {}, None, None, None)
    mine.device_caches[1] = ({"c": 3}, {}, None, None, None)
    other.device_caches[0] = ({"d": 4}, {}, None, None, None)  # not hfkv's: not counted
    assert compiled_kernels() == base + 3
