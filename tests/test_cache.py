"""TriStateCache inside model.generate, checked against DynamicCache and the policy's own rules."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hfkv
from hfkv.layer.policy_runner import PolicyRunner
from hfkv.states import MID, ORIGINAL, QUANTIZED
from hfkv.storage import held_bytes
from tests.models import FAMILIES, left_padded_batch, tiny_model


def _generate(model, cache, ids, mask=None, new=12, **kw):
    return model.generate(
        input_ids=ids,
        attention_mask=mask if mask is not None else torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        past_key_values=cache,
        pad_token_id=0,
        **kw,
    )


def _dense(model):
    return DynamicCache(config=model.config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_preset_is_token_identical_to_dynamic_cache(family):
    model = tiny_model(family)
    ids, mask = left_padded_batch()
    ref = _generate(model, _dense(model), ids, mask)
    out = _generate(model, hfkv.TriStateCache(model, "full"), ids, mask)
    assert torch.equal(out, ref)
    # logits of a plain forward on the same cache type agree too
    a = model(input_ids=ids, attention_mask=mask, past_key_values=hfkv.TriStateCache(model, "full")).logits
    b = model(input_ids=ids, attention_mask=mask, past_key_values=_dense(model)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_evict_with_budget_above_length_equals_full(family):
    model = tiny_model(family)
    ids, mask = left_padded_batch()
    ref = _generate(model, _dense(model), ids, mask)
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=4096, window=8))
    assert torch.equal(_generate(model, cache, ids, mask), ref)
    assert cache.get_seq_length() == ref.shape[1] - 1  # the last token is never fed back


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("preset", ["hfkv", "arkv"])
def test_a_budget_that_covers_the_sequence_is_the_full_cache(preset, backend, monkeypatch):
    """While everything held fits the budget, every token stays exact and the output is DynamicCache's: ARKV's OQ
    ratios cap the exact share only once the sequence outgrows the budget (ARKV's tailor "will be triggered when
    the KV cache reaches the limit"). A random model's layers score alike (ratios near 1), so the ratios are halved
    here: a cap of half the room would bind if it applied."""
    from hfkv.policy.oq import oq_ratios

    monkeypatch.setattr("hfkv.cache.oq_ratios", lambda q: 0.5 * oq_ratios(q))
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(30, 24, 17))
    new = 12
    ref = _generate(model, _dense(model), ids, mask, new=new)
    length = ids.shape[1] + new
    # hfkv: the budget in full-precision tokens also pays the window's reserve (window + interval) and each exact
    # record's tag and score (a few percent); arkv counts tokens, window included.
    budget = length + (8 + 8 + 4 if preset == "hfkv" else 2)
    cache = hfkv.TriStateCache(model, preset, budget=budget, window=8, backend=backend)
    out = _generate(model, cache, ids, mask, new=new)
    assert max(r.max().item() for r in cache.oq_ratios().values()) <= 0.5
    totals = [layer.totals() for layer in cache.stats().layers]
    assert all(t["mid"] == t["quantized"] == 0 for t in totals), totals
    assert torch.equal(out, ref)


@pytest.mark.parametrize("preset", ["full", "evict"])
def test_beam_search_matches(preset):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(20, 14))
    ref = _generate(model, _dense(model), ids, mask, num_beams=2)
    cfg = hfkv.TriStateConfig.from_preset(preset, **({"budget": 4096, "window": 8} if preset == "evict" else {}))
    out = _generate(model, hfkv.TriStateCache(model, cfg), ids, mask, num_beams=2)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("preset", ["full", "evict"])
def test_two_generate_calls_on_one_cache(preset):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(3))
    extra = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    dense = _dense(model)
    r1 = _generate(model, dense, ids, new=6)
    r2 = _generate(model, dense, torch.cat([r1, extra], 1), new=6)
    cfg = hfkv.TriStateConfig.from_preset(preset, **({"budget": 4096, "window": 8} if preset == "evict" else {}))
    cache = hfkv.TriStateCache(model, cfg)
    o1 = _generate(model, cache, ids, new=6)
    o2 = _generate(model, cache, torch.cat([o1, extra], 1), new=6)
    assert torch.equal(o1, r1) and torch.equal(o2, r2)
    assert cache.get_seq_length() == r2.shape[1] - 1


def _held(layer) -> torch.Tensor:
    return layer.tiers.counts.sum(-1) + layer.window.count


def test_small_budget_manual_loop_equals_generate_and_bound_holds_every_step():
    model = tiny_model("llama")
    budget, window = 24, 8
    cfg = hfkv.TriStateConfig.from_preset("evict", budget=budget, window=window)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    gen = _generate(model, hfkv.TriStateCache(model, cfg), ids, new=20)

    cache = hfkv.TriStateCache(model, cfg)
    out = model(input_ids=ids, past_key_values=cache)
    tokens = [out.logits[:, -1].argmax(-1)]
    for step in range(19):
        layer = cache.layers[0]
        assert cache.get_seq_length() == ids.shape[1] + step  # logical, not physical
        pos = torch.tensor([[ids.shape[1] + step]])
        out = model(input_ids=tokens[-1][:, None], position_ids=pos, past_key_values=cache)
        tokens.append(out.logits[:, -1].argmax(-1))
        for lay in cache.layers:
            assert int(_held(lay).max()) <= budget
    assert torch.equal(torch.stack(tokens, 1), gen[:, ids.shape[1] :])
    assert int(_held(layer).max()) < ids.shape[1] + 19  # it really evicted


def test_head_adaptive_token_budget_bound_holds_every_step():
    """Token budget, head-adaptive, interval 16: a row's heads share H * budget, checked after every step."""
    model = tiny_model("llama")
    budget, window = 24, 8
    cfg = hfkv.TriStateConfig.from_preset("hfkv", budget=budget, window=window, obs_window=8, budget_unit="tokens")
    cache = hfkv.TriStateCache(model, cfg)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    out = model(input_ids=ids, past_key_values=cache)
    tok = out.logits[:, -1:].argmax(-1)
    for step in range(40):
        out = model(input_ids=tok, position_ids=torch.tensor([[40 + step]]), past_key_values=cache)
        tok = out.logits[:, -1:].argmax(-1)
        for layer in cache.layers:
            held = _held(layer)
            assert int(held.sum(-1).max()) <= budget * held.shape[1], step
    assert int(_held(cache.layers[0]).sum()) < 2 * 80  # it really evicted


def _held_bytes(layer) -> torch.Tensor:
    """``[B, H]`` bytes the policy accounts for: tier records at their size + window tokens (K, V, score)."""
    c = layer.tiers.counts
    recs = [lay.nbytes for lay in layer.layouts]
    win = layer.window
    win_cost = 2 * win.k.shape[-1] * win.k.element_size() + 4
    return sum(c[..., t] * r for t, r in enumerate(recs)) + win.count * win_cost


@pytest.mark.parametrize("head_adaptive", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_budget_bound_holds_every_step(head_adaptive, dtype):
    """fp_tokens budget: bytes held per head (per row when head-adaptive) never exceed budget x the bytes of
    a model-dtype token, after prefill and after every decode step; the cache really quantizes and evicts,
    and the pool (measured) never holds more than the records it accounts for plus page slack."""
    model = tiny_model("llama", dtype=dtype)
    budget, window = 48, 8
    cfg = hfkv.TriStateConfig.from_preset(
        "hfkv", budget=budget, window=window, obs_window=8, interval=4, head_adaptive=head_adaptive
    )
    cache = hfkv.TriStateCache(model, cfg)
    ids, mask = left_padded_batch(lengths=(70, 52))
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    tok = out.logits[:, -1:].argmax(-1)
    cap = budget * 2 * 32 * torch.empty((), dtype=dtype).element_size()
    heads = 2
    for step in range(30):
        for layer in cache.layers:
            held = _held_bytes(layer)
            if head_adaptive:
                assert int(held.sum(-1).max()) <= heads * cap, step
            else:
                assert int(held.max()) <= cap, step
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        out = model(input_ids=tok, attention_mask=mask, past_key_values=cache)
        tok = out.logits[:, -1:].argmax(-1)
    counts = cache.layers[0].tiers.counts
    assert int(counts[..., QUANTIZED].sum() + counts[..., MID].sum()) > 0
    st = cache.stats()
    assert any(sum(map(sum, ls.evicted)) > 0 for ls in st.layers)
    # The pool's capacity is within one page per (row, head, tier) of the bytes accounted for.
    for layer in cache.layers:
        pool = layer.tiers.pool
        slack = 2 * heads * 2 * pool.page_bytes + pool.page_bytes
        assert pool.num_pages * pool.page_bytes <= int(_held_bytes(layer).sum()) + slack


@pytest.mark.parametrize("preset", ["evict", "streaming", "quant"])
def test_presets_run_on_head_dim_16(preset):
    """evict once failed here on the quantized tier it never uses ("group_size=32 must divide head_dim")."""
    model = tiny_model("llama", hidden_size=64)  # 4 heads of 16
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(9))
    kw = {"quant": {"window": 8}, "streaming": {"budget": 16}}.get(preset, {"budget": 24, "window": 8})
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(preset, **kw))
    _generate(model, cache, ids, new=6)
    for ls in cache.stats().layers:
        held = [
            [sum(x) for x in zip(*hs, strict=True)] for hs in zip(ls.window, ls.original, ls.quantized, strict=True)
        ]
        assert all(
            h + e == ls.logical_length
            for row, ev in zip(held, ls.evicted, strict=True)
            for h, e in zip(row, ev, strict=True)
        )
        assert sum(map(sum, ls.evicted)) > 0 or sum(map(sum, ls.quantized)) > 0  # it compressed something


def test_compressed_presets_run_and_respect_their_shape():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(60, 45, 33))
    seen = {}
    for preset, kw in [
        ("evict", {"budget": 32, "window": 8}),
        ("quant", {"window": 8}),
        ("streaming", {"budget": 24}),
        ("arkv", {"budget": 32, "window": 8, "obs_window": 8}),
        ("diffkv", {"window": 8, "obs_window": 8}),
        ("hfkv", {"budget": 32, "window": 8, "obs_window": 8}),
    ]:
        cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(preset, **kw))
        out = _generate(model, cache, ids, mask, new=10)
        assert out.shape == (3, ids.shape[1] + 10)
        st = cache.stats()
        assert st.kv_bytes == sum(held_bytes(layer.held_tensors()) for layer in cache.layers)
        seen[preset] = (cache, st)
    # quant keeps nothing original (no sinks configured), evict nothing quantized
    for layer in seen["quant"][0].layers:
        assert int(layer.tiers.counts[..., ORIGINAL].sum()) == 0
        assert int(layer.tiers.counts[..., QUANTIZED].sum()) > 0
    for layer in seen["evict"][0].layers:
        assert int(layer.tiers.counts[..., QUANTIZED].sum()) == 0
    # streaming keeps only sinks (original) + the window
    for layer in seen["streaming"][0].layers:
        assert int(layer.tiers.counts[..., ORIGINAL].max()) <= 4
        assert int(layer.tiers.counts[..., QUANTIZED].sum()) == 0


def test_policy_runs_once_per_interval_and_window_stays_bounded(monkeypatch):
    """Batched decisions: one policy run (and one batched window exit) per `interval` decode steps."""
    model = tiny_model("llama")
    interval, window, steps = 4, 8, 24
    cfg = hfkv.TriStateConfig.from_preset(
        "hfkv", budget=200, window=window, obs_window=8, interval=interval, dense_phase=False
    )
    cache = hfkv.TriStateCache(model, cfg)
    runs = []
    real = PolicyRunner.run

    def counted(runner):
        runs.append(runner.layer.layer_idx)
        real(runner)

    monkeypatch.setattr(PolicyRunner, "run", counted)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, past_key_values=cache)
    tok = out.logits[:, -1:].argmax(-1)
    for i in range(steps):
        out = model(input_ids=tok, position_ids=torch.tensor([[40 + i]]), past_key_values=cache)
        tok = out.logits[:, -1:].argmax(-1)
        assert all(window <= layer.window.count < window + interval for layer in cache.layers)
    assert runs.count(0) == steps // interval


def _per_head_kept(cache) -> list[list[int]]:
    return [layer.tiers.counts.sum(-1)[0].tolist() for layer in cache.layers]


def test_per_head_adaptivity_is_real_and_memory_follows():
    # a larger init makes attention peaked, as in trained models, so heads differ in what they need
    model = tiny_model("llama", num_key_value_heads=4, initializer_range=0.2)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(7))
    kw = {"window": 8, "obs_window": 16, "page_bytes": 528}  # small pages: bytes track tokens
    diff = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("diffkv", alpha_l=0.5, **kw))
    _generate(model, diff, ids, new=8)
    counts = _per_head_kept(diff)
    assert any(len(set(c)) > 1 for c in counts), counts

    ada = hfkv.TriStateCache(
        model, hfkv.TriStateConfig.from_preset("hfkv", budget=40, head_adaptive=True, alpha_h=0, alpha_l=0, **kw)
    )
    _generate(model, ada, ids, new=8)
    counts = _per_head_kept(ada)
    assert any(len(set(c)) > 1 for c in counts), counts

    # Evicting more means holding fewer bytes, measured from the tensors.
    keep_all = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("diffkv", alpha_l=0.0, **kw))
    _generate(model, keep_all, ids, new=8)
    assert diff.stats().kv_bytes < keep_all.stats().kv_bytes
    assert diff.stats().dense_bytes == keep_all.stats().dense_bytes


def test_stats_dense_bytes_match_dynamic_cache():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(8))
    dense = _dense(model)
    _generate(model, dense, ids, new=5)
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("hfkv", budget=32, window=8))
    _generate(model, cache, ids, new=5)
    want = sum(held_bytes([layer.keys, layer.values]) for layer in dense.layers)
    assert cache.stats().dense_bytes == want
    df = cache.stats().to_dataframe()
    assert len(df) == 2 * 2 * 2 * 5  # layers x rows x heads x states
    assert df.groupby(["layer", "row", "kv_head"])["tokens"].sum().eq(cache.get_seq_length()).all()
    assert "TriStateCache(" in repr(cache)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["evict", "hfkv"])
def test_storage_costs_what_it_holds_with_nothing_to_evict(preset):
    """Issue 10: with a budget above the length, a bf16 head_dim-64 cache holds little more than DynamicCache; and
    (issue 60) so does the default preset, its OQ cap and mid tier idle while the budget covers the sequence.

    The overhead is the 8 bytes of tag and score per token (3.1% at head_dim 64), the ring's empty slots between
    policy runs, one zero page per layer and each head's last page's tail: no page more than the records need.
    ``evict``'s pages hold 9 exact records, the default's 15 (a page holds whole records of all three tiers), so
    the default's tail can be larger: here, 41 tokens past a page boundary, the worst case, 1.062x; at SmolLM2's
    947 tokens 1.048x (docs/generate.md, "Budgets: tokens or bytes").
    """
    model = tiny_model(
        "llama", dtype=torch.bfloat16, hidden_size=256, num_attention_heads=4, max_position_embeddings=2048
    )
    ids = torch.randint(3, 128, (1, 1024), generator=torch.Generator().manual_seed(3))
    dense = _dense(model)
    _generate(model, dense, ids, new=17)
    # the tiers' cost: a budget this large holds the sequence dense (tests/test_dense_phase.py) unless told not to
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(preset, budget=4096, dense_phase=False))
    _generate(model, cache, ids, new=17)
    st = cache.stats()
    assert all(sum(layer.totals()[t] for t in ("evicted", "quantized", "mid")) == 0 for layer in st.layers)
    for layer in cache.layers:  # pages: the zero page and each head's records, rounded up to whole pages
        per_page = layer.tiers.pool.page_bytes // layer.layouts[ORIGINAL].nbytes
        exact = layer.tiers.counts[..., ORIGINAL]
        assert layer.tiers.pool.num_pages == 1 + int(((exact + per_page - 1) // per_page).sum())
    payload = sum(held_bytes([layer.keys, layer.values]) for layer in dense.layers)
    assert payload < st.kv_bytes <= (1.05 if preset == "evict" else 1.07) * payload


def test_misuse_errors_are_clear():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12))
    cache = hfkv.TriStateCache(model, "hfkv", budget=16, window=4)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 24)), past_key_values=cache)  # past the budget: stored compressed
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    assert not cache.is_croppable
    with pytest.raises(TypeError, match="model's config first"):
        hfkv.TriStateCache(model, model.config)
    with pytest.raises(ValueError, match="needs the model's layer count"):
        hfkv.TriStateCache(None, "hfkv", alpha_l=[0.0, 0.1])
    with pytest.raises(TypeError, match=r"its config \(PreTrainedConfig\) or None"):
        hfkv.TriStateCache(ids, "hfkv")
    with pytest.raises(ValueError, match="alpha_h"):
        hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("hfkv", alpha_h=[1.0, 1.0, 1.0]))
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(NotImplementedError, match="linear_attention"):
        hfkv.TriStateCache(model, "hfkv")


def test_enable_is_idempotent_and_cacheless_forward_delegates():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12))
    ref = model(input_ids=ids, use_cache=False).logits
    hfkv.enable(model)
    hfkv.enable(model)
    assert hfkv.is_enabled(model)
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, ref, rtol=0, atol=0)


def test_gemma_sliding_layers_stay_uncompressed():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = tiny_model("gemma2", num_hidden_layers=4)  # alternating sliding / full layers
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(9))
    ref = _generate(model, DynamicCache(config=model.config), ids, new=8)
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=4096, window=8))
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert kinds == {"TriStateLayer", "DynamicSlidingWindowLayer"}
    assert torch.equal(_generate(model, cache, ids, new=8), ref)
    squeezed = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=24, window=8))
    _generate(model, squeezed, ids, new=8)
    for layer in squeezed.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            assert layer.keys.shape[2] > 0  # untouched by hfkv
        else:
            assert int(_held(layer).max()) <= 24


def test_a_model_whose_layers_are_all_sliding_is_warned_about():
    """Sliding layers stay uncompressed, so on a model with no other kind a compressed preset compresses nothing:
    said once, when the cache is built, rather than found in the memory figures."""
    import warnings

    model = tiny_model("mistral", sliding_window=16)
    with pytest.warns(UserWarning, match="every layer of .* uses sliding-window attention.*compresses nothing"):
        hfkv.TriStateCache(model, "hfkv", budget=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hfkv.TriStateCache(model, "full")  # nothing to compress is what it asks for
        hfkv.TriStateCache(tiny_model("gemma2", num_hidden_layers=4), "hfkv", budget=64)  # its full layers compress


@pytest.mark.parametrize("op", ["select", "select-tuple", "repeat"])
def test_batch_surgery_matches_dynamic_cache(op):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(lengths=(20, 14, 9))
    dense = _dense(model)
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=4096, window=4))
    for c in (dense, cache):
        model(input_ids=ids, attention_mask=mask, past_key_values=c)
        if op == "select":
            c.batch_select_indices(torch.tensor([2, 0]))
        elif op == "select-tuple":  # as transformers' own cache tests pass them
            c.batch_select_indices((2, 0))
        else:
            c.batch_repeat_interleave(2)
    keep = [0, 0, 1, 1, 2, 2] if op == "repeat" else [2, 0]
    nxt = torch.randint(3, 128, (len(keep), 1), generator=torch.Generator().manual_seed(2))
    am = torch.cat([mask[keep], torch.ones(len(keep), 1, dtype=mask.dtype)], 1)
    pos = am.long().cumsum(-1)[:, -1:] - 1
    a = model(input_ids=nxt, attention_mask=am, position_ids=pos, past_key_values=dense).logits
    b = model(input_ids=nxt, attention_mask=am, position_ids=pos, past_key_values=cache).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_keeps_causality_by_slot_position():
    """A prompt fed in chunks (multi-token forwards on a non-empty cache) gives the same logits."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(11))
    ref = model(input_ids=ids, past_key_values=_dense(model)).logits
    cache = hfkv.TriStateCache(
        model, hfkv.TriStateConfig.from_preset("evict", budget=4096, window=8, dense_phase=False)
    )
    outs = [model(input_ids=ids[:, s : s + 15], past_key_values=cache).logits for s in range(0, 45, 15)]
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 45
    # 45 tokens, 8 in the window, the rest in the original tier, nothing lost
    layer = cache.layers[0]
    assert layer.window.count == 8 and int(layer.tiers.counts[..., ORIGINAL].min()) == 37


def test_full_preset_on_an_eager_model_stays_bit_identical():
    """The delegate of an eager model is the model's own eager function, with the eager mask."""
    model = tiny_model("llama", attn_implementation="eager")
    ids, mask = left_padded_batch(lengths=(20, 13))
    ref_logits = model(input_ids=ids, attention_mask=mask).logits
    ref = _generate(model, _dense(model), ids, mask)
    out = _generate(model, hfkv.TriStateCache(model, "full"), ids, mask)
    assert torch.equal(out, ref)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, ref_logits, rtol=0, atol=0)
    # and a compressing preset runs on it too
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=4096, window=4))
    assert torch.equal(_generate(model, cache, ids, mask), ref)


def test_a_forward_that_raised_half_way_does_not_poison_the_next():
    model = tiny_model("llama")
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=4096, window=4))
    ids = torch.randint(3, 128, (1, 10))
    model(input_ids=ids, past_key_values=cache)
    hfkv.attention.interface.set_pending(cache.layers[0])  # as if an exception struck between update and attention
    model(input_ids=ids[:, :1], position_ids=torch.tensor([[10]]), past_key_values=cache)
    assert cache.get_seq_length() == 11


def test_an_unpadded_prompt_prefills_on_sdpas_causal_path(monkeypatch):
    """An empty layer's plain causal prompt builds no T x T mask (SDPA's causal path, as for DynamicCache), nor does
    an unpadded decode step (plain causal: read by position); a left-padded prompt gets the boolean mask."""
    from hfkv.cache import TriStateLayer

    masks = []
    attend = TriStateLayer.attend

    def spy(self, module, query, key, value, mask, scaling, **kwargs):
        if self.layer_idx == 0:
            masks.append(None if mask is None else (mask.dtype, tuple(mask.shape)))
        return attend(self, module, query, key, value, mask, scaling, **kwargs)

    monkeypatch.setattr(TriStateLayer, "attend", spy)
    model = tiny_model("llama")
    cfg = hfkv.TriStateConfig.from_preset("hfkv", budget=32)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    _generate(model, hfkv.TriStateCache(model, cfg), ids, new=3)
    assert masks == [None] * 3
    masks.clear()
    ids, mask = left_padded_batch(lengths=(20, 13))
    _generate(model, hfkv.TriStateCache(model, cfg), ids, mask, new=2)
    assert masks[0] == (torch.bool, (2, 1, 20, 20))


@pytest.mark.slow
def test_torch_compile_of_the_model_runs_with_a_tristate_cache():
    """torch.compile (dynamo; graph breaks allowed) over a model decoding into a TriStateCache gives the
    eager tokens, so a caller who compiles the model keeps the cache (issue 21)."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", num_hidden_layers=1)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    cfg = hfkv.TriStateConfig.from_preset("hfkv", budget=32)
    ref = _generate(model, hfkv.TriStateCache(model, cfg), ids, new=5)
    counters.clear()
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        out = _generate(model, hfkv.TriStateCache(model, cfg), ids, new=5)
    finally:
        del model.forward
        torch._dynamo.reset()
    assert counters["frames"]["ok"] > 0  # dynamo did trace frames
    assert torch.equal(out, ref)


def test_tier_members_sort_equals_nonzero():
    """The GPU's one-read split of a state map by tier gives each tier's (b, h, i) exactly as nonzero does."""
    from hfkv.storage.moves import _members_by_nonzero, _members_by_sort

    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 1), (2, 3, 17), (3, 2, 64)]:
        new = torch.randint(0, 4, shape, generator=gen, dtype=torch.int8)  # 3 = evicted: in no tier
        new[0, 0, 0] = 1
        want = [(t, tuple(x.tolist() for x in m)) for t, m in _members_by_nonzero(new, 3)]
        got = [(t, tuple(x.tolist() for x in m)) for t, m in _members_by_sort(new, 3)]
        assert got == want and want


def test_exact_cap_is_kept_while_the_ratios_hold_and_recomputed_when_they_change():
    """A policy run's cap on exact tokens (ARKV's OQ ratio times the room) is computed once per set of ratios, not
    every run: the same tensor while the cache's ratios hold, and the formula's values for new ones (new prefill
    statistics invalidate them)."""
    model = tiny_model("llama")
    cache = hfkv.TriStateCache(model, "hfkv", budget=20, window=4)
    ids, mask = left_padded_batch(lengths=(12, 9))
    model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    layer = cache.layers[0]
    heads = layer.tiers.counts.shape[1]

    budget = layer.budget

    def formula(rho):
        room = budget.room * (heads if layer.cfg.head_adaptive else 1)
        cap = torch.floor(rho.float() * (room / budget.cost[ORIGINAL])).long()
        return cap if layer.cfg.head_adaptive else cap.view(-1, 1).expand(-1, heads)

    assert cache.rho(0) is cache.rho(0)  # the layer's row is kept while the ratios hold
    cap = budget.exact_cap(cache.rho(0), heads)
    assert torch.equal(cap, formula(cache.rho(0))) and cap.is_contiguous()  # the allocation takes it without a copy
    assert budget.exact_cap(cache.rho(0), heads) is cap  # the same ratios: no new tensor
    for i, other in enumerate(cache.compressed_layers()):  # new statistics: other ratios
        other.oq = torch.tensor([0.2 + 0.1 * i, 0.9 - 0.05 * i])
    cache.invalidate_rho()
    new = budget.exact_cap(cache.rho(0), heads)
    assert torch.equal(new, formula(cache.rho(0))) and not torch.equal(new, cap)


@pytest.mark.parametrize("stagger", [False, True])
def test_staggered_policy_runs_spread_the_layers_over_the_interval(stagger):
    """``stagger``: each layer still runs its batched policy every ``interval`` decode steps, but at the steps whose
    length is its index modulo the interval, so no step runs more than ``ceil(layers / interval)`` of them; without
    it every layer runs in the same steps."""
    model = tiny_model("llama", num_hidden_layers=4)
    interval = 4
    cache = hfkv.TriStateCache(model, "hfkv", budget=24, window=4, interval=interval, stagger=stagger)
    ids, mask = left_padded_batch(lengths=(20, 17))
    prompt = ids.shape[1]
    runs: dict[int, list[int]] = {}
    for layer in cache.layers:
        run = layer.policy.run

        def logged(*args, layer=layer, run=run, **kwargs):
            if layer.length > prompt:  # decode steps' runs (the prompt's own run comes first)
                runs.setdefault(layer.layer_idx, []).append(layer.length)
            return run(*args, **kwargs)

        layer.policy.run = logged  # this layer's runner only
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=17, do_sample=False)
    assert out.shape[1] == prompt + 17 and sorted(runs) == [0, 1, 2, 3]
    phases = [layer.policy.phase for layer in cache.layers]
    assert phases == ([0, 1, 2, 3] if stagger else [0] * 4)  # ranks mod interval
    for idx, lengths in runs.items():
        assert len(lengths) >= 3 and all(b - a == interval for a, b in zip(lengths, lengths[1:], strict=False))
        if stagger:
            assert all((n - idx) % interval == 0 for n in lengths)
    per_step: dict[int, int] = {}
    for lengths in runs.values():
        for n in lengths:
            per_step[n] = per_step.get(n, 0) + 1
    assert max(per_step.values()) == (1 if stagger else 4)


@pytest.mark.parametrize(
    ("other", "names"),
    [
        (dict(num_hidden_layers=3), "(3 layers, 2 KV heads, head dim 32, float32)"),
        (dict(num_key_value_heads=4), "(2 layers, 4 KV heads, head dim 32, float32)"),
        (dict(hidden_size=256), "(2 layers, 2 KV heads, head dim 64, float32)"),
        (dict(dtype=torch.bfloat16), "(2 layers, 2 KV heads, head dim 32, bfloat16)"),
    ],
)
def test_a_cache_used_with_another_model_names_both(other, names):
    """Issue 60: a cache handed to a model of another shape fails with one error naming the model it was built for
    and what the calling one has, before the mismatched layer stores anything (it used to be an IndexError, an alpha
    size error, a torch size mismatch, or, for another dtype, nothing)."""
    model = tiny_model("llama")
    cache = hfkv.TriStateCache(model, "hfkv", budget=64, window=4)
    dtype = other.pop("dtype", torch.float32)
    stranger = tiny_model("llama", dtype=dtype, **other)
    hfkv.enable(stranger)
    ids = torch.randint(3, 128, (1, 12))
    with pytest.raises(ValueError, match="built for") as info:
        stranger(input_ids=ids, past_key_values=cache)
    built, used = str(info.value).split(" and is used with ")
    assert built.endswith("(2 layers, 2 KV heads, head dim 32, float32)") and names in used
    assert cache.get_seq_length() == 0  # refused before its first layer stored anything
    # the model it was built for still works with it
    assert torch.equal(_generate(model, cache, ids, new=3), _generate(model, _dense(model), ids, new=3))


def test_a_cache_serves_any_model_of_its_shape():
    """Nothing is switched on the model a cache is built with (hfkv.attention.interface): another model of the same
    shape uses it as it would use its own."""
    model = tiny_model("llama")
    stranger = tiny_model("llama", seed=1)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    own = stranger(input_ids=ids, past_key_values=hfkv.TriStateCache(stranger, "hfkv", budget=16, window=4)).logits
    lent = stranger(input_ids=ids, past_key_values=hfkv.TriStateCache(model, "hfkv", budget=16, window=4)).logits
    assert torch.equal(lent, own)
