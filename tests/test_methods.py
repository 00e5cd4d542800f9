"""Method specs: one parser for bench, sweeps and lm-eval; each spec builds the cache it names."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, QuantizedCache, StaticCache

import hfkv
from hfkv.evaluation.methods import (
    build_config,
    expand_methods,
    kv_and_dense_bytes,
    parse_method,
    parse_overrides,
    split_specs,
)
from hfkv.storage import dynamic_cache_bytes
from tests.models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _generate(model, cache, new=12):
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False)


def test_preset_specs_equal_from_preset():
    assert parse_method("hfkv").config == hfkv.TriStateConfig.from_preset("hfkv")
    m = parse_method("evict@80")
    assert (m.label, m.kind, m.name, m.budget) == ("evict@80", "tristate", "evict", 80)
    assert m.config == hfkv.TriStateConfig.from_preset("evict", budget=80)
    m = parse_method("arkv@512:window=16,alpha_h=0.5,quantized.key=int8")
    assert m.config == hfkv.TriStateConfig.from_preset(
        "arkv", budget=512, window=16, alpha_h=0.5, quantized={"key": "int8"}
    )
    assert m.config.quantized.value == "fp8"  # the preset's other tier field is kept
    assert m.label == "arkv@512:window=16,alpha_h=0.5,quantized.key=int8"


def test_budget_none_and_streaming_total():
    m = parse_method("quant@none")
    assert m.budget is None and m.config.budget is None
    s = parse_method("streaming@80")
    assert s.budget == 80 and s.config.window + s.config.sink_tokens == 80
    assert parse_method("streaming").budget == 1024  # the preset's total size


def test_override_values():
    assert parse_overrides("alpha_h=[1, 0.5],alpha_l=inf,budget=none,gamma=1e-3,name=x") == {
        "alpha_h": [1, 0.5],
        "alpha_l": math.inf,
        "budget": None,
        "gamma": 1e-3,
        "name": "x",
    }
    with pytest.raises(ValueError, match="given twice"):
        parse_overrides("window=8,window=9")
    with pytest.raises(ValueError, match="must be key=value"):
        parse_overrides("window")


def test_yaml_spec(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("preset: arkv\nwindow: 16\n")
    m = parse_method(f"{path}@256:alpha_h=0.25")
    assert m.config == hfkv.TriStateConfig.from_preset("arkv", window=16, budget=256, alpha_h=0.25)
    assert m.name == "arkv" and m.budget == 256
    plain = tmp_path / "plain.yaml"
    hfkv.TriStateConfig.from_preset("evict", budget=100).to_yaml(plain)
    m = parse_method(f"{plain}:quantized.value=int4")
    assert m.config == hfkv.TriStateConfig.from_preset("evict", budget=100, quantized={"value": "int4"})


def test_baselines():
    assert parse_method("dynamic").kind == "dynamic"
    q = parse_method("quanto-int2:residual_length=64,q_group_size=32")
    assert q.options == {"backend": "quanto", "nbits": 2, "residual_length": 64, "q_group_size": 32}
    assert q.is_baseline and q.budget is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "'nope' is not a preset"),
        ("hfkv@x", "budget 'x' must be a positive integer"),
        ("dynamic@80", "baselines take no @budget"),
        ("dynamic:window=3", "takes no options"),
        ("quanto-int3", "quanto-int{2,4}"),
        ("quanto-int4:bits=3", "unknown QuantizedCache option"),
        ("quanto-int4:residual_length=x", "must be an integer"),
        ("hfkv:alpha_h=-1", "alpha_h=-1"),
        ("hfkv:windw=3", "unknown TriStateConfig field"),
        ("hfkv:budget=80@3", "budget"),
        ("evict@80:budget=90", "budget given twice"),
        ("hfkv:foo.key=int4", "dotted keys are only for the tier fields"),
        ("missing.yaml", "not found"),
        ("", "non-empty"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises((ValueError, FileNotFoundError)) as exc:
        parse_method(spec)
    assert message in str(exc.value)


def test_split_specs_attaches_overrides():
    assert split_specs("dynamic,hfkv@80:alpha_h=0.8,window=16,evict") == [
        "dynamic",
        "hfkv@80:alpha_h=0.8,window=16",
        "evict",
    ]
    assert split_specs(["a:x=[1,2],y=3", "b"]) == ["a:x=[1,2],y=3", "b"]
    with pytest.raises(ValueError, match="no method before it"):
        split_specs("dynamic,window=3")


def test_expand_crosses_presets_with_budgets_and_skips_invalid():
    methods, skipped = expand_methods("dynamic,evict,diffkv,diffkv@none,quant@none,evict@80", [48, 80])
    assert [m.label for m in methods] == ["dynamic", "evict@48", "evict@80", "diffkv@80", "diffkv@none", "quant@none"]
    assert [s for s, _ in skipped] == ["diffkv@48"]
    assert "must be > window" in skipped[0][1]
    with pytest.raises(ValueError):  # written explicitly: an error, not a skip
        expand_methods("diffkv@48", [])


def test_caches_built_are_the_named_ones(model):
    assert type(parse_method("dynamic").make_cache(model)) is DynamicCache
    assert isinstance(parse_method("static").make_cache(model, max_cache_len=80), StaticCache)
    with pytest.raises(ValueError, match="max_cache_len"):
        parse_method("static").make_cache(model)
    assert isinstance(parse_method("quanto-int4").make_cache(model), QuantizedCache)
    cache = parse_method("evict@40").make_cache(model)
    assert isinstance(cache, hfkv.TriStateCache) and cache.config.budget == 40


def test_spec_cache_generates_like_the_direct_cache(model):
    """A cache made from a spec behaves exactly like the one built by hand (same config, fresh state)."""
    m = parse_method("evict@40")
    a = _generate(model, m.make_cache(model))
    b = _generate(model, hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=40)))
    assert torch.equal(a, b)
    c = _generate(model, m.make_cache(model))  # the Method's config is not consumed by the first cache
    assert torch.equal(a, c)
    full = _generate(model, parse_method("full").make_cache(model))
    assert torch.equal(full, _generate(model, DynamicCache(config=model.config)))


def test_dense_bytes_match_a_dynamic_cache(model):
    """The dense figure of every cache kind equals what a DynamicCache holds after the same generate."""
    dyn = DynamicCache(config=model.config)
    _generate(model, dyn)
    held = dynamic_cache_bytes(dyn)
    assert kv_and_dense_bytes(model, dyn, batch=1) == (held, held)
    for spec in ("quanto-int4", "evict@40", "static"):
        cache = parse_method(spec).make_cache(model, max_cache_len=72)
        _generate(model, cache)
        kv, dense = kv_and_dense_bytes(model, cache, batch=1)
        assert dense == held, spec
        assert kv > 0
    q = parse_method("quanto-int2").make_cache(model)
    _generate(model, q)
    assert kv_and_dense_bytes(model, q, batch=1)[0] < held  # 2-bit codes hold less than the dense cache


def test_build_config_rejects_unknown_names():
    with pytest.raises(ValueError, match="not a preset"):
        build_config("hfkvv")
