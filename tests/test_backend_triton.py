"""The kernel backends inside ``generate`` (Triton, and the CPU kernel): same tokens and same statistics
as the torch backend.

On a CPU the Triton kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
which is slow, so the models are tiny and the generations short; the budgets are small enough that
every preset evicts or quantizes within them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hfkv import TriStateCache
from hfkv.attention.interface import set_pending
from hfkv.kernels.backend import resolve_backend
from hfkv.kernels.host_scalars import NoHostScalars
from tests.models import left_padded_batch, tiny_model

PRESETS = {
    "full": {},
    "quant": {},
    "arkv": {"budget": 20, "window": 4},
    "diffkv": {"window": 4, "obs_window": 8},
    "hfkv": {"budget": 16, "window": 4},
}


def _stats_key(cache: TriStateCache):
    st = cache.stats()
    return st.kv_bytes, [(ls.window, ls.original, ls.quantized, ls.evicted) for ls in st.layers]


def _generate(model, ids, mask, preset, backend, new_tokens):
    cache = TriStateCache(model, preset, backend=backend, **PRESETS[preset])
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
    return out, cache


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kernel_generate_equals_torch(family, preset, backend):
    model = tiny_model(family, num_hidden_layers=1 if family == "qwen3" else 2)
    if family == "llama":  # a left-padded batch of 2
        ids, mask = left_padded_batch(lengths=(28, 19))
    else:
        ids = torch.randint(3, 128, (1, 26), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
    ref, ref_cache = _generate(model, ids, mask, preset, "torch", 10)
    got, got_cache = _generate(model, ids, mask, preset, backend, 10)
    assert torch.equal(got, ref)
    assert _stats_key(got_cache) == _stats_key(ref_cache)
    if preset != "full":
        st = got_cache.stats()
        assert st.backend == backend and ref_cache.stats().backend == "torch"
        assert f"backend={backend}" in repr(got_cache)
        # The budgets bite: something left the window for a tier or was dropped.
        totals = [ls.totals() for ls in st.layers]
        assert sum(t["quantized"] + t["evicted"] for t in totals) > 0


@pytest.mark.slow
def test_second_generate_call_goes_through_the_chunk_path():
    """A second turn on a non-empty cache: multi-token queries, window exits attended densely, causal by slot."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(22, 15))
    results = {}
    for backend in ("torch", "triton", "cpu"):
        cache = TriStateCache(model, "hfkv", backend=backend, budget=16, window=4)
        first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False)
        turn = torch.cat([first, torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))], 1)
        mask2 = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        out = model.generate(turn, attention_mask=mask2, past_key_values=cache, max_new_tokens=4, do_sample=False)
        results[backend] = (out, _stats_key(cache))
    for backend in ("triton", "cpu"):
        assert torch.equal(results[backend][0], results["torch"][0])
        assert results[backend][1] == results["torch"][1]


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompt_scores_come_from_the_observation_kernel(family, backend, monkeypatch):
    """An unpadded prompt's scores and OQ statistics on a kernel backend come from its observation kernel (no
    probabilities held: Triton's, or the CPU's one pass over the logits) and equal the torch backend's; a padded
    prompt keeps the probabilities' path."""
    if backend == "triton":
        import hfkv.kernels.observation as obs

        name = "observation_scores"
    else:
        import hfkv.kernels.cpu.observation as obs

        name = "observation_scores_cpu"
    calls = []
    real = getattr(obs, name)
    monkeypatch.setattr(obs, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model(family, num_hidden_layers=2)
    ids = torch.randint(3, 128, (1, 45), generator=torch.Generator().manual_seed(2))
    caches = {}
    for b in ("torch", backend):
        caches[b] = TriStateCache(model, "hfkv", backend=b, budget=16, window=4)
        with torch.no_grad():
            model(ids, past_key_values=caches[b], use_cache=True)
    assert len(calls) == 2  # one per layer, the kernel backend only
    for layer in range(2):
        ref, got = caches["torch"].layers[layer], caches[backend].layers[layer]
        torch.testing.assert_close(got.oq, ref.oq, rtol=1e-5, atol=0)
        torch.testing.assert_close(
            caches[backend].token_scores(layer),
            caches["torch"].token_scores(layer),
            rtol=1e-5,
            atol=1e-7,
            equal_nan=True,
        )  # NaN: evicted
        assert torch.equal(caches[backend].token_states(layer), caches["torch"].token_states(layer))
    calls.clear()
    ids, mask = left_padded_batch(lengths=(28, 19))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=TriStateCache(model, "hfkv", backend=backend), use_cache=True)
    assert calls == []


@pytest.mark.slow
def test_long_chunks_go_through_the_kernels_in_query_tiles(monkeypatch):
    """A chunk whose logits would pass ``CHUNK_LOGITS_BYTES`` is attended in query tiles by the Triton kernels
    (tiled in Python), and a chunk past ``TILE_ROWS`` rows by the CPU kernel (tiled in C++): the same tokens and
    statistics as the torch backend (a chunked prefill, then a second turn)."""
    import hfkv.kernels.cpu.paged_decode as cpu_kernel
    from hfkv.kernels.backend import PagedDecode

    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(30, 21))
    tiles = []  # queries of each unplanned (tile) call
    attention = PagedDecode.attention

    def watched(self, query, *args):
        tiles.append(query.shape[2])
        return attention(self, query, *args)

    def half(self, query, parts):
        return max(1, query.shape[2] // 2) if self.triton else None

    cpu_tiles = []
    cpu_attention = cpu_kernel.paged_attention_cpu

    def watched_cpu(query, *args, **kwargs):
        cpu_tiles.append(query.shape[2] * query.shape[1] // model.config.num_key_value_heads)
        return cpu_attention(query, *args, **kwargs)

    results = {}
    for backend in ("torch", "triton", "cpu"):
        if backend == "triton":  # two tiles a chunk
            monkeypatch.setattr(PagedDecode, "tile", half)
            monkeypatch.setattr(PagedDecode, "attention", watched)
        if backend == "cpu":  # tiles of 3 queries (the query rows of one KV head: 3 x the GQA group)
            monkeypatch.setattr(cpu_kernel, "TILE_ROWS", 3 * model.config.num_attention_heads // 2)
            monkeypatch.setattr(cpu_kernel, "paged_attention_cpu", watched_cpu)
        cache = TriStateCache(model, "hfkv", backend=backend, budget=16, window=4)
        with torch.no_grad():  # a chunked prefill: the second chunk lands on a non-empty cache
            model(ids[:, :14], attention_mask=mask[:, :14], past_key_values=cache)
            model(ids[:, 14:26], attention_mask=mask[:, :26], past_key_values=cache)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
        results[backend] = (out, _stats_key(cache))
    # the second chunk's 12 queries in tiles of 6, generate's 4-token chunk in tiles of 2; decode steps untiled
    assert len(tiles) >= 4 and max(tiles) <= 6
    assert max(cpu_tiles) > cpu_kernel.TILE_ROWS  # some chunk went through in several tiles
    for backend in ("triton", "cpu"):
        assert torch.equal(results[backend][0], results["torch"][0])
        assert results[backend][1] == results["torch"][1]


def test_chunk_tiles_keep_the_logits_under_the_cap(monkeypatch):
    import hfkv.kernels.backend as backend_module
    from hfkv.kernels.parts import DenseSlots

    parts = [DenseSlots(torch.zeros(2, 2, n, 16), torch.zeros(2, 2, n, 16), torch.arange(n)) for n in (60, 40)]
    query = torch.zeros(2, 8, 10, 16)  # 4 bytes x 2 rows x 8 query heads x 100 slots = 6,400 bytes a query
    triton, cpu = (backend_module.PagedDecode(backend_module, triton=t) for t in (True, False))
    monkeypatch.setattr(backend_module, "CHUNK_LOGITS_BYTES", 6400 * 3 + 6399)
    assert triton.tile(query, parts) == 3
    monkeypatch.setattr(backend_module, "CHUNK_LOGITS_BYTES", 100)
    assert triton.tile(query, parts) == 1  # at least one query a call
    assert cpu.tile(query, parts) is None  # the CPU kernel tiles in C++ (TILE_ROWS)


def test_backend_selection(monkeypatch):
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("cpu", "cpu") == "cpu"
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match=r"TriStateConfig.backend='cpu'.*'cuda'"):
        resolve_backend("cpu", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"TriStateConfig.backend='triton'.*'cpu'.*TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    model = tiny_model("llama")
    cache = TriStateCache(model, "quant", backend="triton")
    with pytest.raises(ValueError, match="TriStateConfig.backend='triton'"):
        model(torch.ones(1, 4, dtype=torch.long), past_key_values=cache)


def test_auto_on_cpu_reports_the_cpu_kernel():
    model = tiny_model("llama")
    cache = TriStateCache(model, "quant")
    assert cache.backend == "auto"  # unresolved until a layer sees a tensor
    model(torch.ones(1, 4, dtype=torch.long), past_key_values=cache)
    assert cache.backend == "cpu" and cache.stats().backend == "cpu"
    assert "backend=cpu" in repr(cache)


def test_no_compiler_falls_back_to_torch_or_is_named(monkeypatch, tmp_path):
    """Without a C++ compiler ``auto`` takes the torch path on a CPU, and an explicit ``cpu`` says why not."""
    from hfkv.kernels.cpu import build

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HFKV_CACHE_DIR", str(tmp_path))
    build.library.cache_clear()
    build.available.cache_clear()
    try:
        assert resolve_backend("auto", "cpu") == "torch"
        with pytest.raises(build.CpuKernelUnavailable, match="no-such-compiler"):
            resolve_backend("cpu", "cpu")
    finally:
        build.library.cache_clear()
        build.available.cache_clear()


def test_interpreter_switched_on_too_late_is_named(monkeypatch):
    import hfkv.kernels.decode_attention as kernels

    class Compiled:  # what triton.jit returns without the interpreter
        pass

    monkeypatch.setattr(kernels, "_partial_kernel", Compiled())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="imported before it was"):
        resolve_backend("triton", "cpu")


class _TorchOps(TorchDispatchMode):
    """Names of the aten ops run inside the block, views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:  # views launch nothing
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_triton_decode_step_makes_no_host_sync(monkeypatch):
    """Between policy runs, a layer's decode step (window write, kernel launches) never reads a device value.

    Kernel launches are recorded instead of run (the interpreter itself copies tensors to the host),
    and every tensor method that would make the host wait for the device raises.
    """
    from triton.runtime.interpreter import InterpretedFunction

    model = tiny_model("llama")
    cache = TriStateCache(model, "hfkv", backend="triton", budget=16, window=4)
    model(torch.randint(3, 128, (1, 30)), past_key_values=cache)
    layer = cache.layers[0]
    layer.steps_since_policy = -(10**6)  # keep the policy (which sizes its moves on the host) out of these steps
    layer.budget.tier_peak = 0
    launches = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, grid, warmup, **k: launches.append(self))

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync on the decode path")

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    g = torch.Generator().manual_seed(0)
    plans = []
    for step in range(4):
        k, v, q = (torch.randn(1, h, 1, 32, generator=g) for h in (2, 2, 4))
        # The first step after a storage change builds the launch plan, which copies the parts' sizes to
        # the device once (asynchronously, from pinned memory); the steps that reuse it are guarded.
        guard = (NoHostScalars(), _TorchOps()) if step else (contextlib.nullcontext(), _TorchOps())
        with guard[0], guard[1] as ops:  # e.g. `pos[slot] = int`: a CPU scalar copied to the device
            layer.update(k, v)
            set_pending(None)  # what the hfkv attention function does before calling attend()
            out = layer.attend(None, q, k, v, None, 32**-0.5)
        assert out.shape == (1, 1, 4, 32)
        if step:  # the window write happens in the partial launch: the step's only torch ops are allocations
            assert {n for n in ops.names if not n.startswith("aten.empty")} == set()
        plans.append(layer.reads.plan)
    assert plans[0] is plans[1] is plans[2] is plans[3]  # built once, reused while the storage's tensors stay
    names = {fn.fn.__name__ if hasattr(fn, "fn") else str(fn) for fn in launches}
    assert {"_partial_kernel", "_combine_kernel", "_score_kernel"} <= names
