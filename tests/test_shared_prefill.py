"""One prefill shared by many caches (hfkv.evaluation.shared_prefill) decodes exactly what ``generate`` does
with each cache, and leaves hfkv caches in the same state (tiers, bytes, scores)."""

from __future__ import annotations

import pytest
import torch

from hfkv.evaluation.methods import parse_method
from hfkv.evaluation.shared_prefill import fill_from_prefill, greedy, run_prefill
from tests.models import tiny_model

SPECS = [
    "dynamic",
    "quanto-int4",
    "full",
    "evict@24:window=4",
    "quant",
    "streaming@20",
    "arkv@24:window=8,obs_window=8",
    "diffkv:window=4,obs_window=8",
    "hfkv@40:window=4",
    "hfkv@40:window=4,mid=none,alpha_l=0.0",
    "hfkv@40:window=4,rotate=True",  # ingest_prefill rotates the prompt as update() and attend() do
]


def _state(cache):
    if not hasattr(cache, "stats"):
        return None
    st = cache.stats()
    return st.kv_bytes, [(ls.window, ls.original, ls.mid, ls.quantized, ls.evicted) for ls in st.layers]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shared_prefill_decodes_like_generate(family):
    if family == "llama":
        pytest.importorskip("optimum.quanto")
    model = tiny_model(family)
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(5))
    prefill = run_prefill(model, ids)
    for spec in SPECS if family == "llama" else ["dynamic", "hfkv@40:window=4", "diffkv:window=4,obs_window=8"]:
        method = parse_method(spec)
        ref_cache = method.make_cache(model)
        ref = model.generate(ids, past_key_values=ref_cache, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        cache = fill_from_prefill(method.make_cache(model), prefill)
        assert _state(cache) is None or cache.get_seq_length() == ids.shape[1]
        got = greedy(model, cache, prefill, max_new_tokens=12)
        assert got == ref.tolist(), spec
        assert _state(cache) == _state(ref_cache), spec
        if hasattr(cache, "token_scores") and cache.config.compress:
            for layer in range(2):
                assert torch.equal(cache.token_states(layer), ref_cache.token_states(layer))
                torch.testing.assert_close(
                    cache.token_scores(layer), ref_cache.token_scores(layer), equal_nan=True, rtol=1e-5, atol=1e-7
                )


def test_greedy_stops_at_eos_and_on_request():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    prefill = run_prefill(model, ids)
    full = greedy(model, fill_from_prefill(parse_method("dynamic").make_cache(model), prefill), prefill, 10)
    assert len(full) == 10
    cut = greedy(
        model, fill_from_prefill(parse_method("dynamic").make_cache(model), prefill), prefill, 10, eos_ids=[full[3]]
    )
    assert cut == full[: full.index(full[3]) + 1]  # generate keeps the EOS token
    early = greedy(
        model,
        fill_from_prefill(parse_method("dynamic").make_cache(model), prefill),
        prefill,
        10,
        stop=lambda t: len(t) == 4,
    )
    assert early == full[:4]


def test_prefill_in_fp32_fills_a_bf16_cache():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(7))
    prefill = run_prefill(model, ids)
    bf16 = tiny_model(dtype=torch.bfloat16)
    cache = fill_from_prefill(parse_method("hfkv@30:window=4").make_cache(bf16), prefill, dtype=torch.bfloat16)
    assert cache.layers[0].window.k.dtype == torch.bfloat16
    assert len(greedy(bf16, cache, prefill, 5)) == 5


def test_ingest_prefill_refuses_a_filled_layer_and_too_few_queries():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(8))
    prefill = run_prefill(model, ids)
    cache = fill_from_prefill(parse_method("hfkv@30:window=4").make_cache(model), prefill)
    with pytest.raises(ValueError, match="already holds 50 tokens"):
        cache.layers[0].ingest_prefill(prefill.keys[0], prefill.values[0], prefill.queries[0], 0.125)
    fresh = parse_method("hfkv@30:window=4").make_cache(model)
    with pytest.raises(ValueError, match="observation window"):
        fresh.layers[0].ingest_prefill(prefill.keys[0], prefill.values[0], prefill.queries[0][:, :, -4:], 0.125)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_prompt_with_a_non_finite_value_bound_for_a_quantized_tier_is_refused(backend):
    """One host read checks every quantized tier a prompt fills; a NaN anywhere in them is named."""
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(8))
    prefill = run_prefill(model, ids)
    values = prefill.values[0].clone()
    values[:, :, :40, 3] = float("nan")  # every token a tier takes (values: the scores stay finite)
    cache = parse_method(f"hfkv@30:window=4,backend={backend}").make_cache(model)
    with pytest.raises(ValueError, match="non-finite"):
        cache.layers[0].ingest_prefill(prefill.keys[0], values, prefill.queries[0], 0.125)
    clean = parse_method(f"hfkv@30:window=4,backend={backend}").make_cache(model)
    clean.layers[0].ingest_prefill(prefill.keys[0], prefill.values[0], prefill.queries[0], 0.125)  # no error
