"""A budget that covers the sequence: the layer holds it dense and is DynamicCache, bit for bit (hfkv.layer.dense).

The references: DynamicCache (tokens, logits, bytes) and the same cache with ``dense_phase=False``, whose window and
tiers hold every token exact while the budget covers them (the scores the policy will rank by must be theirs).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hfkv import TriStateCache
from hfkv.states import EVICTED, ORIGINAL, WINDOW
from hfkv.storage import held_bytes
from tests.models import left_padded_batch, tiny_model

GEN = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _generate(model, cache, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, past_key_values=cache, **{**GEN, **kw})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset", ["hfkv", "evict", "arkv"])
def test_a_covering_budget_gives_dynamic_caches_logits_bit_for_bit(dtype, preset):
    model = tiny_model("llama", dtype=dtype)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    ref = _generate(model, DynamicCache(), ids, mask)
    cache = TriStateCache(model, preset)
    got = _generate(model, cache, ids, mask)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits, strict=True):
        assert torch.equal(a, b)
    assert all(layer.dense.active for layer in cache.compressed_layers())


def test_without_the_dense_phase_bf16_parts_from_dynamic_cache():
    """What the dense phase is for: the tiers' joint softmax sums in another order than SDPA, which in bf16 moves
    the logits (and here the tokens) off DynamicCache's although every token is exact."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    ref = _generate(model, DynamicCache(), ids, mask)
    got = _generate(model, TriStateCache(model, dense_phase=False), ids, mask)
    assert not all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dense_bytes_are_dynamic_caches_plus_one_score_per_token(dtype):
    model = tiny_model("llama", dtype=dtype)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    dyn, cache = DynamicCache(), TriStateCache(model)
    _generate(model, dyn, ids, mask)
    _generate(model, cache, ids, mask)
    bsz, heads, length = ids.shape[0], model.config.num_key_value_heads, cache.get_seq_length()
    for i, layer in enumerate(cache.compressed_layers()):
        dyn_bytes = held_bytes([dyn.layers[i].keys, dyn.layers[i].values])
        # the buffer of interval steps' queries, which holds those whose scores are not yet added
        pending = layer.dense.queries
        assert pending.shape == (bsz, model.config.num_attention_heads, cache.config.interval, 32)
        assert layer.dense.pending < cache.config.interval
        assert held_bytes(layer.held_tensors()) == dyn_bytes + 4 * bsz * heads * length + pending.nbytes
        stats = layer.layer_stats()
        real = mask.sum(-1).tolist()
        assert [row[0] for row in stats.original] == [r + GEN["max_new_tokens"] - 1 for r in real]
        assert [row[0] for row in stats.evicted] == [ids.shape[1] - r for r in real]  # left padding
        assert stats.quantized == stats.mid == [[0] * heads] * bsz and stats.window == [[0] * heads] * bsz
        states = layer.token_states()
        assert set(states.unique().tolist()) <= {ORIGINAL, EVICTED}
        assert (states == ORIGINAL).sum(-1)[:, 0].tolist() == [row[0] for row in stats.original]


def test_dense_scores_are_those_the_tiers_would_have_received():
    """The policy ranks by the score sums once the sequence outgrows the budget: the dense phase must have added
    what the window and tiers add (prompt observation window, then every query), position for position."""
    model = tiny_model("llama", dtype=torch.float32)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    dense, tiered = TriStateCache(model), TriStateCache(model, dense_phase=False)
    _generate(model, dense, ids, mask)
    _generate(model, tiered, ids, mask)
    for a, b in zip(dense.compressed_layers(), tiered.compressed_layers(), strict=True):
        assert a.dense.active and not b.dense.active
        torch.testing.assert_close(a.token_scores(), b.token_scores(), rtol=1e-5, atol=1e-7, equal_nan=True)


def test_leaving_the_dense_phase_places_every_token_exact_with_its_score():
    model = tiny_model("llama", dtype=torch.float32)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    cache = TriStateCache(model)
    _generate(model, cache, ids, mask, max_new_tokens=6)
    layer = cache.compressed_layers()[0]
    k, v, scores = layer.dense.k, layer.dense.v, layer.token_scores()
    layer.dense.leave()
    assert not layer.dense.active and layer.dense.held_tensors() == []
    torch.testing.assert_close(layer.token_scores(), scores, rtol=0, atol=0, equal_nan=True)
    states = layer.token_states()
    real = ~scores.isnan()
    assert ((states == ORIGINAL) | (states == WINDOW))[real].all() and (states == EVICTED)[~real].all()
    # a query at the last position attends over the tiers as over the dense keys (exact records: fp32 rounding)
    bsz, heads, length, dim = k.shape
    query = torch.randn(bsz, 2 * heads, 1, dim)
    out = layer.reads.attend(query, None, 0.125, None)
    keep = _key_mask(mask, length)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=keep, scale=0.125
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def _key_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, 1, length]``: the prompt's real keys and every generated one."""
    gen = torch.ones(mask.shape[0], length - mask.shape[1], dtype=torch.bool)
    return torch.cat([mask.bool(), gen], -1)[:, None, None]


def test_a_sequence_that_outgrows_the_budget_leaves_the_dense_phase_once_and_compresses():
    model = tiny_model("llama", dtype=torch.float32)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    cache = TriStateCache(model, budget=60)
    layers = cache.compressed_layers()
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert all(layer.dense.active and layer.window is None for layer in layers)  # 40 tokens fit 60
    _generate(model, cache, ids, mask, max_new_tokens=30, return_dict_in_generate=False, output_logits=False)
    for layer in layers:
        assert not layer.dense.active and layer.dense.held_tensors() == []
        stats = layer.layer_stats()
        for b in range(ids.shape[0]):
            for h in range(len(stats.window[b])):
                held = stats.window[b][h] + stats.original[b][h] + stats.mid[b][h] + stats.quantized[b][h]
                assert held + stats.evicted[b][h] == layer.length
        assert sum(sum(row) for row in stats.original) < ids.shape[0] * 2 * layer.length  # it compressed


def test_a_prompt_over_the_budget_is_stored_from_the_start():
    model = tiny_model("llama", dtype=torch.float32)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    cache = TriStateCache(model, budget=32)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert all(not layer.dense.active and layer.window is not None for layer in cache.compressed_layers())


@pytest.mark.parametrize(
    "preset, kw",
    [("hfkv", dict(alpha_l=0.5, window=8)), ("hfkv", dict(budget=None, oq_ratios=False, window=8)),
     ("quant", dict(budget=200, window=8)), ("streaming", dict(budget=24))],
    ids=["eviction-floor", "no-budget", "quant-quantizes-below-alpha_h", "streaming-evicts"],
)  # fmt: skip
def test_a_policy_that_compresses_whatever_the_room_is_never_dense(preset, kw):
    model = tiny_model("llama", dtype=torch.float32)
    ids, mask = left_padded_batch(lengths=(40, 34))
    cache = TriStateCache(model, preset, **kw)
    model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert not any(layer.dense.active for layer in cache.compressed_layers())
    if preset == "quant":  # what the dense phase would have wrongly kept exact
        assert sum(layer.layer_stats().totals()["quantized"] for layer in cache.compressed_layers()) > 0


def test_beam_search_and_a_chunked_prompt_in_the_dense_phase_are_dynamic_caches():
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids, mask = left_padded_batch(lengths=(30, 21))
    kw = dict(max_new_tokens=12, do_sample=False, num_beams=3)
    ref = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(), **kw)
    got = model.generate(ids, attention_mask=mask, past_key_values=TriStateCache(model), **kw)
    assert torch.equal(got, ref)
    # a prompt in two chunks (the second attends to the first through the cache)
    one = ids[:1, -30:]
    dyn, cache = DynamicCache(), TriStateCache(model)
    for c in (dyn, cache):
        model(input_ids=one[:, :18], past_key_values=c)
    a = model(input_ids=one[:, 18:], past_key_values=dyn).logits
    b = model(input_ids=one[:, 18:], past_key_values=cache).logits
    assert torch.equal(a, b)


def test_reset_drops_what_the_layer_held_and_the_next_prompt_decides_again():
    model = tiny_model("llama", dtype=torch.float32)
    ids, mask = left_padded_batch(lengths=(40, 33, 25))
    cache = TriStateCache(model, budget=32)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    layer = cache.compressed_layers()[0]
    assert layer.window is not None
    cache.reset()
    assert layer.held_tensors() == [] and layer.layer_stats().original == [[0, 0]] * 3
    model(input_ids=ids[:, -20:], past_key_values=cache)  # 20 tokens fit 32: held dense this time
    assert layer.dense.active and layer.window is None


def test_a_dense_layer_shows_dynamic_caches_keys_and_values():
    """Code written for DynamicCache reads ``cache.layers[i].keys`` (shapes, dtypes): a dense layer's are
    DynamicLayer's tensors; once stored in the window and tiers, a copy of DynamicLayer's shape and dtype built on
    each read (its values: tests/test_native_cache.py), never held: writing to it changes nothing."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(20, 13))
    dyn, cache = DynamicCache(), TriStateCache(model, "hfkv", budget=4096)
    _generate(model, dyn, ids, mask)
    _generate(model, cache, ids, mask)
    for mine, ref in zip(cache.layers, dyn.layers, strict=True):
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    stored = TriStateCache(model, "hfkv", budget=14, window=4)
    _generate(model, stored, ids, mask)
    for mine, ref in zip(stored.layers, dyn.layers, strict=True):
        assert not mine.dense.active
        assert mine.keys.shape == ref.keys.shape and mine.values.dtype == ref.values.dtype
    before = stored.layers[0].keys.clone()
    stored.layers[0].keys.zero_()
    assert torch.equal(stored.layers[0].keys, before)
    with pytest.raises(AttributeError, match="read-only"):
        stored.layers[0].keys = ids
