"""The attention dispatch (hfkv.attention.interface): a compressing layer's call goes to the layer, every other call
to the model's own implementation with the arguments the model passed, so a model behaves exactly as before for any
other cache; and the masks each implementation builds read the same (hfkv.layer.masks)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hfkv
from hfkv.layer.handoff import set_pending
from hfkv.layer.masks import logical_mask, mask_rows
from tests.models import left_padded_batch, tiny_model


@pytest.fixture
def without_hfkv():
    """transformers' own lookup for the duration of the block it yields (then hfkv's again)."""
    import contextlib

    @contextlib.contextmanager
    def block():
        installed = ALL_ATTENTION_FUNCTIONS.__dict__.pop("get_interface", None)
        try:
            assert not hfkv.is_enabled()
            yield
        finally:
            if installed is not None:
                ALL_ATTENTION_FUNCTIONS.get_interface = installed

    return block


def _greedy(model, cache, ids, mask=None, new=4):
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                         do_sample=False, min_new_tokens=new)  # fmt: skip
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_other_cache_runs_the_models_own_attention_bit_for_bit(without_hfkv, impl, dtype):
    model = tiny_model("qwen3", dtype=dtype)
    model.set_attn_implementation(impl)
    ids, mask = left_padded_batch(lengths=(20, 13))
    with without_hfkv():
        ref = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache()).logits
        ref_tokens = _greedy(model, DynamicCache(config=model.config), ids, mask)
    hfkv.TriStateCache(model, "hfkv")  # installs the dispatch; the model keeps its implementation
    assert hfkv.is_enabled() and model.config._attn_implementation == impl
    got = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache()).logits
    assert torch.equal(got, ref)
    assert torch.equal(_greedy(model, DynamicCache(config=model.config), ids, mask), ref_tokens)
    full = hfkv.TriStateCache(model, "full")
    assert torch.equal(_greedy(model, full, ids, mask), ref_tokens)


def test_output_attentions_through_the_config_after_a_cache(without_hfkv):
    """transformers accepts ``config.output_attentions = True`` only under eager: a cache no longer switches the
    model away from it, and a layer held dense returns the model's own weights."""
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    with without_hfkv():
        ref = model(input_ids=ids, past_key_values=DynamicCache(), output_attentions=True).attentions
    hfkv.TriStateCache(model, "hfkv")
    model.config.output_attentions = True  # raised ValueError while a cache switched the model to "hfkv"
    for cache in (DynamicCache(), hfkv.TriStateCache(model, "full"), hfkv.TriStateCache(model, "hfkv", budget=4096)):
        got = model(input_ids=ids, past_key_values=cache).attentions
        assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    model.config.output_attentions = False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_eager_model_held_dense_is_dynamic_cache_bit_for_bit(dtype):
    model = tiny_model("llama", dtype=dtype)
    model.set_attn_implementation("eager")
    ids, mask = left_padded_batch(lengths=(20, 13))
    ref = _greedy(model, DynamicCache(config=model.config), ids, mask, new=6)
    cache = hfkv.TriStateCache(model, "hfkv", budget=4096)
    assert torch.equal(_greedy(model, cache, ids, mask, new=6), ref)
    assert all(layer.attends_densely() for layer in cache.compressed_layers())


@pytest.mark.parametrize("preset", ["evict", "hfkv"])
def test_compressed_tokens_do_not_depend_on_the_attention_implementation(preset):
    """A compressed layer attends over its window and tiers itself, reading whichever mask the model's
    implementation built: eager's additive mask and SDPA's boolean one (or none) give the same tokens."""
    ids, mask = left_padded_batch(lengths=(30, 21))
    tokens = {}
    for impl in ("sdpa", "eager"):
        model = tiny_model("llama")
        model.set_attn_implementation(impl)
        cache = hfkv.TriStateCache(model, preset, budget=24 if preset == "hfkv" else 12, window=4, dense_phase=False)
        tokens[impl] = _greedy(model, cache, ids, mask, new=6)
        assert all((cache.token_states(i) > 0).any() for i in range(2))  # it quantized or evicted
    assert torch.equal(tokens["sdpa"], tokens["eager"])


@pytest.mark.parametrize("q, past", [(1, 9), (5, 0), (4, 7)])
def test_every_mask_form_reads_the_same(q, past):
    kv = past + q
    pad = torch.ones(3, kv, dtype=torch.long)
    pad[1, :2] = 0
    pad[2, :5] = 0
    kwargs = dict(batch_size=3, q_length=q, kv_length=kv, q_offset=past, kv_offset=0, attention_mask=pad.bool())
    boolean = sdpa_mask(allow_is_causal_skip=False, **kwargs)
    additive = eager_mask(dtype=torch.float32, **kwargs)
    assert boolean.dtype == torch.bool and additive.dtype == torch.float32
    for form in (boolean, additive, pad):
        assert torch.equal(logical_mask(form, q), boolean)
    assert logical_mask(None, q) is None
    with pytest.raises(TypeError, match="BlockMask is not supported"):
        logical_mask(object(), q)
    # A chunk attended a token at a time (hfkv.layer.rollback): each form cut to one query's row and the keys up to
    # it reads as that row of the whole chunk's mask.
    for form in (boolean, additive, pad):
        for t in range(q):
            row = mask_rows(form, t, t + 1, past + t + 1)
            assert torch.equal(logical_mask(row, 1), boolean[:, :, t : t + 1, : past + t + 1])
    assert mask_rows(None, 0, 1, past + 1) is None


def test_asking_for_mask_sizes_outside_a_forward_leaves_nothing_behind():
    """get_mask_sizes() once left a mask request that the next forward of any model picked up (an eager model's
    prefill then fell back to SDPA and returned no attentions)."""
    model = tiny_model("llama")
    cache = hfkv.TriStateCache(model, "evict", budget=8, window=4, dense_phase=False)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, past_key_values=cache)
    cache.get_mask_sizes(1, 0)
    eager = tiny_model("llama", seed=1)
    eager.set_attn_implementation("eager")
    ref = eager(input_ids=ids, past_key_values=DynamicCache(), output_attentions=True)
    again = eager(input_ids=ids, past_key_values=DynamicCache(), output_attentions=True)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(again.attentions, ref.attentions, strict=True))


def test_a_cache_from_the_models_config_alone():
    model = tiny_model("qwen2")
    ids, mask = left_padded_batch(lengths=(26, 19))
    by_model = hfkv.TriStateCache(model, "hfkv", budget=16, window=4)
    ref = _greedy(model, by_model, ids, mask, new=5)
    by_config = hfkv.TriStateCache(model.config, "hfkv", budget=16, window=4)
    assert by_config.model_shape.dtype is None  # learned from the first call
    assert torch.equal(_greedy(model, by_config, ids, mask, new=5), ref)
    assert by_config.stats().kv_bytes == by_model.stats().kv_bytes
    assert by_config.model_shape.dtype == torch.float32
    other = tiny_model("qwen2", dtype=torch.bfloat16)
    stale = hfkv.TriStateCache(model.config, "hfkv", budget=16, window=4)
    other(input_ids=ids[:, :4], past_key_values=stale)  # bf16 from the first call on
    fp32 = hfkv.TriStateCache(model.config, "hfkv", budget=16, window=4)
    model(input_ids=ids[:, :4], past_key_values=fp32)
    fp32.layers[1].is_initialized = False  # as if layer 1 were first called now, by the bf16 model
    with pytest.raises(ValueError, match="bfloat16"):
        other(input_ids=ids[:, :4], past_key_values=fp32)


def test_the_full_preset_without_a_model_is_dynamic_cache():
    model = tiny_model("mistral")
    ids, mask = left_padded_batch(lengths=(18, 11))
    ref = _greedy(model, DynamicCache(), ids, mask)
    cache = hfkv.TriStateCache(None, "full")
    assert torch.equal(_greedy(model, cache, ids, mask), ref)
    assert len(cache.layers) == model.config.num_hidden_layers


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("preset", ["hfkv", "evict", "quant", "diffkv"])
def test_a_compressing_cache_without_a_config_makes_its_layers_as_they_are_updated(preset, backend):
    """``TriStateCache(None, preset)``, as ``DynamicCache()``: layers made on their first update, shapes and
    thresholds from their first keys, the OQ ratios once a layer is updated again (every layer exists then). It
    generates the tokens, holds the states and bytes, and finds the ratios of the cache made from the model."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(26, 19))
    options = dict(budget=16, window=4) if preset in ("hfkv", "evict") else dict(window=4)
    by_model = hfkv.TriStateCache(model, preset, backend=backend, **options)
    ref = _greedy(model, by_model, ids, mask, new=12)
    layerless = hfkv.TriStateCache(None, preset, backend=backend, **options)
    assert layerless.layers == [] and not layerless.layers_known
    assert torch.equal(_greedy(model, layerless, ids, mask, new=12), ref)
    assert len(layerless.layers) == model.config.num_hidden_layers and layerless.layers_known
    for i in range(len(layerless.layers)):
        assert torch.equal(layerless.token_states(i), by_model.token_states(i))
        assert torch.equal(layerless.layers[i].keys, by_model.layers[i].keys)
    assert layerless.stats().kv_bytes == by_model.stats().kv_bytes
    want = by_model.oq_ratios()
    got = layerless.oq_ratios()
    assert (got is None) == (want is None) and (want is None or all(torch.equal(got[i], want[i]) for i in want))
    fork = layerless.fork()  # made again from what it holds, its layers by the same factory
    assert len(fork.layers) == len(layerless.layers) and torch.equal(fork.token_states(1), by_model.token_states(1))


def test_update_alone_on_a_layerless_cache_as_transformers_tests_call_it():
    """transformers' synthetic cache tests call ``update`` with no attention call between: a layer held dense
    takes the keys as DynamicCache does; one storing tokens compressed (which scores them in the attention call)
    refuses the second update; thresholds given per layer need the layer count."""
    one = torch.tensor([1.0, 2.0])[None, None, :, None].expand(1, 1, 2, 8).contiguous()
    cache = hfkv.TriStateCache(None, "evict")
    cache.update(one, one, 0)
    cache.update(one[:, :, :1] * 3, one[:, :, :1] * 3, 0)
    cache.update(one * 10, one * 10, 1)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]
    assert cache.layers[1].keys[0, 0, :, 0].tolist() == [10.0, 20.0]
    rows = torch.arange(1.0, 4.0)[:, None, None, None] * one  # 3 rows
    picked = hfkv.TriStateCache(None, "evict")
    picked.update(rows, rows, 0)
    picked.batch_select_indices((0, 2))  # a tuple, before any attention call
    assert torch.equal(picked.layers[0].keys, rows[[0, 2]])
    stored = hfkv.TriStateCache(None, "quant")  # no dense phase: stored from the first token
    stored.update(one, one, 0)
    with pytest.raises(RuntimeError, match="read keys and values after the attention call"):
        _ = stored.layers[0].keys  # the chunk is placed by the attention call: not held yet
    with pytest.raises(RuntimeError, match="not followed by an attention call"):
        stored.update(one, one, 0)
    set_pending(None)
    with pytest.raises(ValueError, match="alpha_h is given per layer"):
        hfkv.TriStateCache(None, "hfkv", alpha_h=[1.0, 2.0])


def test_two_threads_keep_their_hand_offs_apart():
    """The hand-off between a layer's update() and its attention call is per thread: two generations at once give
    what each gives alone."""
    model = tiny_model("llama")
    prompts = [torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(s)) for s in (6, 7)]
    alone = [_greedy(model, hfkv.TriStateCache(model, "evict", budget=10, window=4), p, new=8) for p in prompts]
    got: list = [None, None]

    def run(i: int) -> None:
        for _ in range(3):
            got[i] = _greedy(model, hfkv.TriStateCache(model, "evict", budget=10, window=4), prompts[i], new=8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, a) for g, a in zip(got, alone, strict=True))
