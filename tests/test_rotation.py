"""``TriStateConfig.rotate``: every compressed layer stores Hadamard-rotated keys and values and attends with a rotated
query, its output rotated back. Attention is unchanged (an all-exact cache decodes as DynamicCache does), what the
tiers hold is rotated, and every backend decodes the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hfkv
from hfkv.quant.rotation import hadamard, rotate
from tests.models import left_padded_batch, tiny_model


def test_hadamard_is_orthonormal_its_own_inverse_and_refuses_other_sizes():
    for d in (1, 2, 32, 128):
        h = hadamard(d)
        assert torch.allclose(h @ h, torch.eye(d), atol=1e-6) and torch.equal(h, h.T)
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    assert rotate(rotate(x, hadamard(64)), hadamard(64)).dtype == torch.float64
    torch.testing.assert_close(rotate(rotate(x, hadamard(64)), hadamard(64)), x, atol=1e-5, rtol=0)
    for bad in (0, 3, 48, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            hadamard(bad)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_rotated_cache_keeping_every_token_exact_decodes_like_dynamic_cache(backend):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(26, 17))
    dyn = DynamicCache(config=model.config)
    ref = model.generate(ids, attention_mask=mask, past_key_values=dyn, max_new_tokens=10, do_sample=False)
    cache = hfkv.TriStateCache(model, "evict", budget=4096, rotate=True, backend=backend, dense_phase=False)
    got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, ref)
    # What the ring holds is the rotated key of each token (the newest one here), not the model's key.
    layer = cache.layers[0]
    ring = layer.window
    newest = (ring.start + ring.count - 1) % ring.capacity
    want = rotate(dyn.layers[0].keys[:, :, -1], hadamard(32))
    torch.testing.assert_close(ring.k[:, :, newest], want)
    assert not torch.allclose(ring.k[:, :, newest], dyn.layers[0].keys[:, :, -1], atol=1e-3)


@pytest.mark.slow
def test_rotated_compressed_cache_decodes_alike_on_every_backend():
    """hfkv with rotation on the Triton backend (the interpreter) and the CPU kernel: the torch backend's tokens
    and storage, for a left-padded batch whose budget quantizes and evicts."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(22, 15))
    runs = {}
    for backend in ("torch", "cpu", "triton"):
        cache = hfkv.TriStateCache(model, "hfkv", budget=16, window=4, rotate=True, backend=backend)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False)
        st = cache.stats()
        runs[backend] = out, st.kv_bytes, [(ls.window, ls.original, ls.quantized, ls.evicted) for ls in st.layers]
    for backend in ("cpu", "triton"):
        assert torch.equal(runs[backend][0], runs["torch"][0]), backend
        assert runs[backend][1:] == runs["torch"][1:], backend
    plain = hfkv.TriStateCache(model, "hfkv", budget=16, window=4, backend="torch")
    model.generate(ids, attention_mask=mask, past_key_values=plain, max_new_tokens=6, do_sample=False)
    assert sum(ls.totals()["quantized"] for ls in plain.stats().layers) > 0  # the budget quantizes
    assert plain.stats().kv_bytes == runs["torch"][1]  # the same bytes, rotated or not


def test_rotate_is_checked_against_the_preset_and_the_head_size():
    with pytest.raises(ValueError, match="rotate=True must be false where compress is false"):
        hfkv.TriStateConfig.from_preset("full", rotate=True)
    model = tiny_model("llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2)  # head_dim 24
    with pytest.raises(ValueError, match="head_dim=24"):
        hfkv.TriStateCache(model, "quant", rotate=True)
    assert "rotated" in hfkv.TriStateConfig.from_preset("quant", rotate=True).summary()
