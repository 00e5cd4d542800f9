"""TriStateConfig: presets, validation, YAML round trips, model-dependent checks."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hfkv.config import TierFormat, TriStateConfig
from hfkv.presets import PRESETS
from hfkv.quant.formats import FORMAT_NAMES

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
INF = math.inf
NAN = math.nan


# ---------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", PRESETS)
def test_preset_constructs_and_round_trips_yaml(name: str, tmp_path: Path) -> None:
    cfg = TriStateConfig.from_preset(name)
    assert cfg.name == name
    path = cfg.to_yaml(tmp_path / f"{name}.yaml")
    assert TriStateConfig.from_yaml(path) == cfg
    assert TriStateConfig.from_dict(cfg.to_dict()) == cfg
    assert isinstance(cfg.summary(), str) and cfg.summary().startswith(f"{name}:")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_files_match_code(name: str) -> None:
    path = CONFIGS / "presets" / f"{name}.yaml"
    assert path.exists(), "run `python configs/regenerate.py`"
    assert TriStateConfig.from_yaml(path) == TriStateConfig.from_preset(name), (
        f"{path} drifted from from_preset({name!r}); run `python configs/regenerate.py`"
    )


def test_no_stale_preset_files() -> None:
    assert sorted(p.stem for p in (CONFIGS / "presets").glob("*.yaml")) == sorted(PRESETS)


def test_preset_values() -> None:
    full = TriStateConfig.from_preset("full")
    assert (full.compress, full.budget, full.oq_ratios, full.head_adaptive) == (False, None, False, False)
    evict = TriStateConfig.from_preset("evict")
    assert (evict.alpha_h, evict.alpha_l, evict.budget, evict.oq_ratios, evict.window) == (0.0, 0.0, 1024, False, 32)
    # Token budgets stay paper-faithful for evict / arkv / streaming (ARKV's tailor to 75%).
    for name in ("evict", "arkv", "streaming", "quant", "diffkv"):
        p = TriStateConfig.from_preset(name)
        assert (p.budget_unit, p.slack) == ("tokens", 0.75), name
    quant = TriStateConfig.from_preset("quant")
    assert (quant.alpha_h, quant.alpha_l, quant.budget, quant.oq_ratios) == (INF, 0.0, None, False)
    arkv = TriStateConfig.from_preset("arkv")
    assert arkv.tau == (7.774, 5.407, 5.528) and arkv.gamma == 263.81 and arkv.oq_ratios
    assert arkv.quantized == TierFormat("fp8", "fp8") and arkv.score_reduction == "mean"
    assert (arkv.window, arkv.obs_window, arkv.budget, arkv.pool_kernel) == (32, 32, 1024, 5)
    diffkv = TriStateConfig.from_preset("diffkv")
    assert (diffkv.alpha_h, diffkv.alpha_l, diffkv.budget) == (1.0, 0.02, None)
    assert (diffkv.window, diffkv.obs_window) == (64, 64)
    assert diffkv.original == TierFormat("int8", "int4") and diffkv.quantized == TierFormat("int4", "int2")
    assert diffkv.score_reduction == "max"
    hfkv = TriStateConfig.from_preset("hfkv")
    assert dataclasses.replace(hfkv, name="custom") == TriStateConfig()
    assert hfkv.summary() == (
        "hfkv: W=16 budget=1024 fp_tokens alpha_h=inf alpha_l=0.0 orig=model/model mid=int8/int4 quant=int4/int2 "
        "oq=on carry=0.8"
    )
    for name in ("full", "evict", "quant", "streaming", "arkv", "diffkv"):  # the papers' scorers carry nothing
        assert TriStateConfig.from_preset(name).carry == 0.0, name
    with pytest.raises(ValueError, match=r"TriStateConfig.carry=1.0 must be a decay in \[0, 1\)"):
        TriStateConfig(carry=1.0)


def test_streaming_budget_sets_window() -> None:
    default = TriStateConfig.from_preset("streaming")
    assert (default.sink_tokens, default.window, default.budget) == (4, 1020, None)
    assert default.alpha_h == INF and default.alpha_l == INF
    small = TriStateConfig.from_preset("streaming", budget=512)
    assert (small.window, small.sink_tokens, small.budget) == (508, 4, None)
    assert TriStateConfig.from_preset("streaming", budget=512, sink_tokens=8).window == 504
    assert TriStateConfig.from_preset("streaming", budget=512, window=508).window == 508
    assert TriStateConfig.from_preset("streaming", window=100).window == 100
    assert TriStateConfig.from_dict({"preset": "streaming", "budget": 256}).window == 252
    with pytest.raises(ValueError, match="budget=4"):
        TriStateConfig.from_preset("streaming", budget=4)
    with pytest.raises(ValueError, match="window=100"):
        TriStateConfig.from_preset("streaming", budget=512, window=100)


def test_overrides_and_unknown_preset() -> None:
    cfg = TriStateConfig.from_preset("arkv", budget=512, quantized={"group_size": 64})
    assert cfg.budget == 512 and cfg.quantized == TierFormat("fp8", "fp8", 64) and cfg.name == "arkv"
    assert TriStateConfig.from_dict({"preset": "diffkv", "quantized": {"key": "int8"}}).quantized == (
        TierFormat("int8", "int2", 32)
    )
    with pytest.raises(ValueError) as e:
        TriStateConfig.from_preset("h2o")
    assert "h2o" in str(e.value) and all(p in str(e.value) for p in PRESETS)
    with pytest.raises(ValueError, match="budgt"):
        TriStateConfig.from_preset("hfkv", budgt=5)


def test_overrides_revalidate() -> None:
    cfg = TriStateConfig.from_preset("hfkv")
    with pytest.raises(ValueError, match="window=0"):
        dataclasses.replace(cfg, window=0)
    with pytest.raises(ValueError, match="oq_ratios"):
        dataclasses.replace(cfg, budget=None)
    with pytest.raises(ValueError, match="oq_ratios"):
        TriStateConfig.from_preset("hfkv", budget=None)
    with pytest.raises(ValueError, match="window=0"):
        TriStateConfig.from_preset("full", window=0)  # policy fields of `full` are still validated
    assert dataclasses.replace(cfg, budget=None, oq_ratios=False, head_adaptive=False).budget is None


# Each preset's budget in its own unit: the hfkv preset's is a memory budget (full-precision-token
# equivalents), the paper presets' a count of tokens; an error must not call one the other.
BUDGET_UNIT_ERRORS = [
    ("hfkv", dict(budget="1k"), "full-precision-token equivalents per KV head", "number of tokens"),
    ("hfkv", dict(budget=1.5), "full-precision-token equivalents per KV head", "number of tokens"),
    ("hfkv", dict(budget=20), "full-precision-token equivalents", "number of tokens"),
    ("hfkv", dict(budget="1k", budget_unit="bytes"), "number of bytes per KV head", "tokens per KV head"),
    ("hfkv", dict(budget=0, budget_unit="bytes"), "number of bytes per KV head", "tokens"),
    ("evict", dict(budget="1k"), "number of tokens per KV head", "full-precision"),
    ("arkv", dict(budget=2.5), "number of tokens per KV head", "full-precision"),
    ("arkv", dict(budget=20), "32 tokens", "full-precision"),
    ("diffkv", dict(budget="1k"), "number of tokens per KV head", "full-precision"),
    ("quant", dict(budget="1k"), "number of tokens per KV head", "full-precision"),
    ("evict", dict(budget="1k", budget_unit="fp_tokens"), "full-precision-token equivalents", "number of tokens"),
    ("streaming", dict(budget="1k"), "total cache size in tokens", "full-precision"),
]


@pytest.mark.parametrize(
    "preset,overrides,unit,not_unit", BUDGET_UNIT_ERRORS, ids=[f"{b[0]}-{b[1]}" for b in BUDGET_UNIT_ERRORS]
)
def test_budget_errors_name_the_presets_unit(preset: str, overrides: dict, unit: str, not_unit: str) -> None:
    with pytest.raises(ValueError) as e:
        TriStateConfig.from_preset(preset, **overrides)
    msg = str(e.value)
    assert f"budget={overrides['budget']!r}" in msg and unit in msg and not_unit not in msg, msg


# ---------------------------------------------------------------------------------------- paper configs
PAPER_FILES = sorted((CONFIGS / "papers").glob("*/*.yaml"))

DIFFKV_ALPHAS = {  # DiffKV section 7.2, Parameter Calibration
    "llama3-8b": (1.0, 0.02),
    "llama3-70b": (1.0, 0.0),
    "qwen2.5-7b": (0.04, 0.04),
    "qwen2.5-32b": (3.0, 0.0),
    "qwq-32b": (3.0, 0.0),
}


def test_paper_files_present() -> None:
    names = {f"{p.parent.name}/{p.stem}" for p in PAPER_FILES}
    assert {f"diffkv/{m}" for m in DIFFKV_ALPHAS} <= names
    assert {f"arkv/{m}" for m in ("llama-3.2-3b", "llama-3.1-8b", "qwen3-4b", "qwen3-8b")} <= names


@pytest.mark.parametrize("path", PAPER_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_paper_config_loads(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    assert raw["preset"] == path.parent.name
    cfg = TriStateConfig.from_yaml(path)
    assert cfg.name == path.parent.name
    assert {"paper", "model", "source"} <= set(cfg.provenance)
    cfg.validate_for_model(num_layers=32, num_kv_heads=8, head_dim=128)
    if path.parent.name == "diffkv":
        assert (cfg.alpha_h, cfg.alpha_l) == DIFFKV_ALPHAS[path.stem]
    else:
        assert cfg.tau == (7.774, 5.407, 5.528) and cfg.gamma == 263.81 and cfg.window == 32


# ---------------------------------------------------------------------------------------- validation
BAD = [  # (overrides, text that must appear in the message: field, then bad value)
    (dict(window=0), "window", "0"),
    (dict(window="32"), "window", "'32'"),
    (dict(window=True), "window", "True"),
    (dict(sink_tokens=-1), "sink_tokens", "-1"),
    (dict(obs_window=0), "obs_window", "0"),
    (dict(score_reduction="median"), "score_reduction", "median"),
    (dict(score_mode="avg"), "score_mode", "avg"),
    (dict(gamma=-1.0), "gamma", "-1.0"),
    (dict(gamma=NAN), "gamma", "nan"),
    (dict(pool_kernel=4), "pool_kernel", "4"),
    (dict(pool_kernel=0), "pool_kernel", "0"),
    (dict(oq_ratios="yes"), "oq_ratios", "yes"),
    (dict(compress=1), "compress", "1"),
    (dict(tau=(1.0, 2.0)), "tau", "(1.0, 2.0)"),
    (dict(tau=(1.0, 0.0, 2.0)), "tau[1]", "0.0"),
    (dict(tau=(1.0, NAN, 2.0)), "tau[1]", "nan"),
    (dict(alpha_h=-0.5), "alpha_h", "-0.5"),
    (dict(alpha_h=NAN), "alpha_h", "nan"),
    (dict(alpha_h="1"), "alpha_h", "'1'"),
    (dict(alpha_h=0.1, alpha_l=0.5), "alpha_l", "0.5"),
    (dict(alpha_h=[1.0, 2.0], alpha_l=[0.1, 3.0]), "alpha_l[1]", "3.0"),
    (dict(alpha_h=[[1.0, 1.0], [1.0, 1.0]], alpha_l=[0.5, 1.5]), "alpha_l[1]", "1.5"),
    (dict(alpha_h=[[1.0, 2.0], [3.0, 4.0]], alpha_l=[[0.0, 0.0], [0.0, 4.5]]), "alpha_l[1][1]", "4.5"),
    (dict(alpha_h=[[1.0, 1.0], [1.0]]), "alpha_h", "[[1.0, 1.0], [1.0]]"),
    (dict(alpha_h=[1.0, [1.0]]), "alpha_h", "[1.0, [1.0]]"),
    (dict(alpha_h=[]), "alpha_h", "[]"),
    (dict(alpha_h=[1.0, -2.0]), "alpha_h[1]", "-2.0"),
    (dict(alpha_h=[[1.0, [2.0]]]), "alpha_h[0]", "[1.0, [2.0]]"),
    (dict(budget=24), "budget", "24"),
    (dict(budget=30, sink_tokens=8), "budget", "30"),
    (dict(budget=1.5), "budget", "1.5"),
    (dict(slack=0), "slack", "0"),
    (dict(slack=1.5), "slack", "1.5"),
    (dict(budget=1024, sink_tokens=100, slack=0.05), "slack", "0.05"),
    (dict(budget=None, head_adaptive=False), "oq_ratios", "True"),
    (dict(budget=None, oq_ratios=False, head_adaptive=True), "head_adaptive", "True"),
    (dict(interval=0), "interval", "0"),
    (dict(stagger=1), "stagger", "1"),
    (dict(run_ahead="yes"), "run_ahead", "yes"),
    (dict(rotate="yes"), "rotate", "yes"),
    (dict(original={"key": "int3"}), "original.key", "int3"),
    (dict(quantized={"value": "nf4"}), "quantized.value", "nf4"),
    (dict(quantized={"group_size": 48}), "quantized.group_size", "48"),
    (dict(quantized={"group_size": 0}), "quantized.group_size", "0"),
    (dict(quantized={"bits": 4}), "quantized", "bits"),
    (dict(quantized="int4"), "quantized", "int4"),
    (dict(page_bytes=32), "page_bytes", "32"),
    (dict(page_bytes=66), "page_bytes", "66"),
    (dict(backend="cuda"), "backend", "cuda"),
    (dict(name=""), "name", "''"),
    (dict(provenance=[1]), "provenance", "[1]"),
    (dict(provenance={"trial": (1, 2)}), "provenance.trial", "(1, 2)"),
    (dict(provenance={"loss": NAN}), "provenance.loss", "nan"),
    (dict(budget_unit="kb"), "budget_unit", "'kb'"),
    (dict(budget=48, window=32, interval=16), "budget", "48"),
    (dict(budget=0, budget_unit="bytes"), "budget", "0"),
    (dict(fidelity=(0.5, 0.9), mid=None), "fidelity", "(0.5, 0.9)"),
    (dict(fidelity=(1.0,)), "fidelity", "(1.0,)"),
    (dict(fidelity=(1.5, 0.5), mid=None), "fidelity", "(1.5, 0.5)"),
    (dict(fidelity=(1.0, 0.5)), "fidelity", "(1.0, 0.5)"),  # three numbers with a mid tier
    (dict(fidelity=(1.0, 0.4, 0.5)), "fidelity", "(1.0, 0.4, 0.5)"),  # the mid tier below the quantized one
    (dict(mid={"key": "int3"}), "mid", "int3"),
]


@pytest.mark.parametrize("overrides,field,value", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_validation_names_field_and_value(overrides: dict, field: str, value: str) -> None:
    with pytest.raises(ValueError) as e:
        TriStateConfig(**overrides)
    msg = str(e.value)
    assert field in msg and value in msg, msg


def test_tier_format_validation() -> None:
    with pytest.raises(ValueError, match="TierFormat.key='int3'") as e:
        TierFormat("int3")
    assert all(f in str(e.value) for f in FORMAT_NAMES)
    with pytest.raises(ValueError, match="group_size=24"):
        TierFormat("int4", "int2", 24)
    assert str(TierFormat("int8", "int4")) == "int8/int4"


def test_normalisation() -> None:
    cfg = TriStateConfig(alpha_h=1, alpha_l=0, gamma=2, slack=1, tau=[1, 2, 3])
    assert cfg == TriStateConfig(alpha_h=1.0, alpha_l=0.0, gamma=2.0, slack=1.0, tau=(1.0, 2.0, 3.0))
    assert isinstance(cfg.alpha_h, float) and isinstance(cfg.tau, tuple)
    assert TriStateConfig(alpha_h=(1, 2), alpha_l=0.0).alpha_h == [1.0, 2.0]
    assert TriStateConfig(alpha_h=INF, alpha_l=INF).alpha_l == INF


# ---------------------------------------------------------------------------------------- yaml files
def test_unknown_keys_rejected(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("preset: hfkv\nwindw: 16\n")
    with pytest.raises(ValueError) as e:
        TriStateConfig.from_yaml(path)
    assert "windw" in str(e.value) and "window" in str(e.value) and str(path) in str(e.value)
    with pytest.raises(ValueError, match="bits"):
        TriStateConfig.from_dict({"quantized": {"bits": 4}})


@pytest.mark.parametrize("text", ["", "- 1\n- 2\n", "window: [\n", "!!python/object/apply:os.system ['true']\n"])
def test_bad_yaml_rejected(text: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad.yaml"):
        TriStateConfig.from_yaml(path)


def test_yaml_round_trip_of_rich_config(tmp_path: Path) -> None:
    provenance = {"study": "s1", "trial": 7, "metrics": {"kl": 0.0123, "mem": [1, 2]}}
    cfg = TriStateConfig(
        name="calibrated", alpha_h=[[1.0, INF], [2.5, 0.0]], alpha_l=[0.01, 0.0], sink_tokens=2, provenance=provenance
    )
    path = cfg.to_yaml(tmp_path / "sub" / "c.yaml", header="calibrated\nby a test")
    text = path.read_text()
    assert text.startswith("# calibrated\n# by a test\n") and ".inf" in text
    assert TriStateConfig.from_yaml(path) == cfg


def test_to_yaml_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    TriStateConfig.from_preset("diffkv").to_yaml(path)
    TriStateConfig.from_preset("arkv").to_yaml(path)  # replacing an existing file works
    assert TriStateConfig.from_yaml(path).name == "arkv" and os.listdir(tmp_path) == ["c.yaml"]
    before = path.read_text()

    def boom(*a: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        TriStateConfig.from_preset("hfkv").to_yaml(path)
    assert path.read_text() == before and os.listdir(tmp_path) == ["c.yaml"]


# ---------------------------------------------------------------------------------------- model-dependent
def test_resolve_alpha_broadcasting() -> None:
    h, lo = TriStateConfig(alpha_h=2.0, alpha_l=0.5).resolve_alpha(3, 4)
    assert h.shape == lo.shape == (3, 4) and h.dtype == lo.dtype == torch.float32
    assert torch.all(h == 2.0) and torch.all(lo == 0.5)
    h, lo = TriStateConfig(alpha_h=[1.0, 2.0, INF], alpha_l=0.0).resolve_alpha(3, 2)
    assert torch.equal(h, torch.tensor([[1.0, 1.0], [2.0, 2.0], [INF, INF]]))
    table = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    h, lo = TriStateConfig(alpha_h=table, alpha_l=[0.1, 0.2, 0.3]).resolve_alpha(3, 2)
    assert torch.equal(h, torch.tensor(table)) and torch.allclose(lo[:, 1], torch.tensor([0.1, 0.2, 0.3]))


@pytest.mark.parametrize(
    "alpha,text",
    [([1.0, 2.0], "2 per-layer values"), ([[1.0] * 4] * 3, "3 x 4 table"), ([[1.0] * 2] * 4, "4 x 2 table")],
)
def test_resolve_alpha_shape_errors(alpha: list, text: str) -> None:
    cfg = TriStateConfig(alpha_h=alpha, alpha_l=0.0)
    with pytest.raises(ValueError) as e:
        cfg.resolve_alpha(4, 4)
    assert "alpha_h" in str(e.value) and text in str(e.value) and "4 x 4" in str(e.value)


def test_resolve_alpha_deferred_order_check() -> None:
    cfg = TriStateConfig(alpha_h=1.0, alpha_l=0.5)
    cfg.alpha_l = [[0.0, 0.0], [0.0, 2.0]]  # edited in place, bypassing __post_init__
    with pytest.raises(ValueError, match=r"alpha_l=2.0 at layer 1, head 1"):
        cfg.resolve_alpha(2, 2)
    with pytest.raises(ValueError, match="num_layers"):
        TriStateConfig().resolve_alpha(0, 2)


def test_validate_for_model_group_size() -> None:
    cfg = TriStateConfig(quantized={"group_size": 64})
    cfg.validate_for_model(2, 2, 128)
    with pytest.raises(ValueError) as e:
        cfg.validate_for_model(2, 2, 96)
    assert "quantized.group_size=64" in str(e.value) and "head_dim=96" in str(e.value)
    with pytest.raises(ValueError, match="original.group_size=32"):
        TriStateConfig.from_preset("diffkv").validate_for_model(2, 2, 48)
    TriStateConfig.from_preset("arkv").validate_for_model(2, 2, 48)  # fp8 and model formats have no groups
    TriStateConfig.from_preset("full").validate_for_model(2, 2, 48)  # never quantises
    with pytest.raises(ValueError, match="alpha_h"):
        TriStateConfig(alpha_h=[1.0, 1.0, 1.0], alpha_l=0.0).validate_for_model(2, 2, 64)


def test_unused_tiers_are_not_validated_and_groups_never_exceed_head_dim() -> None:
    # evict and streaming never quantize: their quantized tier must not stop them on any head_dim.
    for name in ("evict", "streaming", "full"):
        cfg = TriStateConfig.from_preset(name)
        assert not cfg.uses_quantized_tier()
        cfg.validate_for_model(2, 2, 16)
        cfg.validate_for_model(2, 2, 48)
        assert 48 % cfg.group_for("quantized", 48) == 0
    # A group larger than the head is the whole head (one group per token and head).
    quant = TriStateConfig.from_preset("quant", quantized={"group_size": 128})
    assert quant.uses_quantized_tier() and quant.group_for("quantized", 64) == 64
    quant.validate_for_model(2, 2, 64)
    assert TriStateConfig.from_preset("evict", alpha_h=[0.5, 0.0]).uses_quantized_tier()
    assert TriStateConfig.from_preset("hfkv").uses_quantized_tier()  # a memory budget may always quantize


# ---------------------------------------------------------------------------------------- property test
_pos = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
_alpha_h = st.one_of(
    st.one_of(_pos, st.just(INF)),
    st.lists(st.one_of(_pos, st.just(INF)), min_size=1, max_size=4),
    st.integers(1, 3).flatmap(lambda h: st.lists(st.lists(_pos, min_size=h, max_size=h), min_size=1, max_size=3)),
)


@st.composite
def _alphas(draw: st.DrawFn) -> tuple:
    h = draw(_alpha_h)
    if isinstance(h, float):
        return h, min(h, draw(_pos))
    if not isinstance(h[0], list):
        return h, [min(x, draw(_pos)) for x in h]
    return h, [[min(x, draw(_pos)) for x in row] for row in h]


_yaml_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False), st.text(max_size=8)
)
_provenance = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        _yaml_scalar,
        lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=5), c, max_size=3)),
        max_leaves=6,
    ),
    max_size=4,
)
_tier = st.builds(
    TierFormat,
    st.sampled_from(FORMAT_NAMES),
    st.sampled_from(FORMAT_NAMES),
    st.sampled_from([1, 2, 8, 16, 32, 64, 128, 256]),
)


@st.composite
def valid_configs(draw: st.DrawFn) -> TriStateConfig:
    window, sinks, interval = draw(st.integers(1, 64)), draw(st.integers(0, 8)), draw(st.integers(1, 16))
    unit = draw(st.sampled_from(["tokens", "fp_tokens", "bytes"]))
    # Valid for every unit (fp_tokens: the ring of window + interval tokens and the sinks, with slack >= 0.5).
    budget = draw(st.one_of(st.none(), st.integers(window + interval + 2 * sinks + 2, 4096)))
    alpha_h, alpha_l = draw(_alphas())
    mid = draw(st.one_of(st.none(), _tier))
    fid = [st.floats(0.5, 1.0), *([st.just(0.5)] if mid is not None else []), st.floats(0.0, 0.5)]
    return TriStateConfig(
        name=draw(st.text(min_size=1, max_size=12)),
        compress=draw(st.booleans()),
        window=window,
        sink_tokens=sinks,
        obs_window=draw(st.integers(1, 128)),
        score_reduction=draw(st.sampled_from(["max", "mean", "l2"])),
        score_mode=draw(st.sampled_from(["mean", "sum"])),
        gamma=draw(st.floats(0, 1e4)),
        pool_kernel=draw(st.sampled_from([1, 3, 5, 7])),
        oq_ratios=budget is not None and draw(st.booleans()),
        tau=tuple(draw(st.lists(st.floats(0.01, 100), min_size=3, max_size=3))),
        alpha_h=alpha_h,
        alpha_l=alpha_l,
        budget=budget,
        budget_unit=unit,
        slack=draw(st.floats(0.5, 1.0)),
        head_adaptive=budget is not None and draw(st.booleans()),
        interval=interval,
        stagger=draw(st.booleans()),
        run_ahead=draw(st.booleans()),
        original=draw(_tier),
        quantized=draw(_tier),
        mid=mid,
        page_bytes=4 * draw(st.integers(16, 4096)),
        backend=draw(st.sampled_from(["auto", "torch", "triton"])),
        fidelity=draw(st.one_of(st.none(), st.tuples(*fid))),
        provenance=draw(_provenance),
    )


@settings(max_examples=100, deadline=None)
@given(valid_configs())
def test_property_dict_round_trip(cfg: TriStateConfig) -> None:
    assert TriStateConfig.from_dict(cfg.to_dict()) == cfg
    assert TriStateConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}) == cfg


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid_configs())
def test_property_yaml_round_trip(tmp_path: Path, cfg: TriStateConfig) -> None:
    assert TriStateConfig.from_yaml(cfg.to_yaml(tmp_path / "p.yaml")) == cfg


@pytest.mark.parametrize("path", sorted((CONFIGS / "calibrated").glob("*.yaml")), ids=lambda p: p.stem)
def test_committed_calibrated_configs_load_with_provenance(path) -> None:
    cfg = TriStateConfig.from_yaml(path)
    assert cfg.name == path.stem
    assert cfg.provenance["tool"] == "hfkv calibrate" and cfg.provenance["study"]["name"] == path.stem
    assert cfg.provenance["params"]["budget"] == cfg.budget


def test_stored_result_keys_survive_fields_added_after_them():
    """Hold-out evaluations (and a calibration study's base) are keyed by a config's fields: a field added later
    is left out of the key at the value that behaves as before it existed, so the committed files' keys are the
    keys today's code makes for the same configs, and setting the field makes another key."""
    import json
    from pathlib import Path

    studies = Path(__file__).resolve().parents[1] / "calibration" / "studies"
    rows = [
        json.loads(line)
        for path in sorted(studies.glob("*/holdout_evaluations.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert rows

    def key(cfg: TriStateConfig) -> str:  # as hfkv.calibration.compare makes it
        return json.dumps({**cfg.key_dict(), "name": "", "provenance": {}}, sort_keys=True, default=str)

    for row in rows:
        cfg = TriStateConfig.from_dict({**json.loads(row["config"]), "name": "stored"})
        assert key(cfg) == row["config"]
        assert key(dataclasses.replace(cfg, stagger=True)) != row["config"]
        assert key(dataclasses.replace(cfg, run_ahead=False)) != row["config"]


def test_committed_sweep_rows_stay_done_after_a_field_is_added():
    """The resumable sweeps skip a row whose method's recorded config equals today's (ResultFile's match fields):
    a field added later must not make every committed RULER row (weeks of CPU) due again. Every committed RULER
    row's config is the one today's code records for its method, and setting the new field records another."""
    import json
    from pathlib import Path

    from hfkv.evaluation.methods import parse_method

    path = Path(__file__).resolve().parents[1] / "eval" / "results" / "ruler_smollm2.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    stored = {r["method"]: r["config"] for r in rows if r.get("config")}
    assert len(stored) > 5
    for method, config in stored.items():
        assert parse_method(method).describe()["config"] == config, method
        assert parse_method(f"{method}{',' if ':' in method else ':'}stagger=True").describe()["config"] != config


def test_rows_stored_before_a_config_field_existed_stay_done_where_the_method_still_runs_as_they_did():
    """Rows written before ``carry`` existed hold no such field; their methods ran without carrying scores, which is
    ``carry=0.0``. Read as today's code writes a stored key (``TriStateConfig.stored_key``, the sweeps' ResultFile
    ``normalize``), every committed fidelity, testbed and RULER row is done under today's methods, where compared raw
    the pre-carry rows of the token presets fell due; a method that now carries scores (hfkv, 0.8) does not match
    a row that ran without."""
    import importlib.util

    from hfkv.evaluation.methods import parse_method, stored_row_as_today
    from hfkv.evaluation.results import ResultFile

    root = Path(__file__).resolve().parents[1]
    old = {k: v for k, v in parse_method("evict@128").describe()["config"].items() if k != "carry"}
    assert TriStateConfig.stored_key(old) == parse_method("evict@128").describe()["config"]
    hfkv_old = {k: v for k, v in parse_method("hfkv@128").describe()["config"].items() if k != "carry"}
    assert TriStateConfig.stored_key(hfkv_old) != parse_method("hfkv@128").describe()["config"]
    assert TriStateConfig.stored_key({**old, "stagger": False}) == TriStateConfig.stored_key(old)

    raw_due = 0
    for name, sweep in [("fidelity_sweep.jsonl", "sweep_fidelity"), ("testbed_sweep.jsonl", "sweep_testbed"),
                        ("ruler_smollm2.jsonl", "sweep_ruler")]:  # fmt: skip
        spec = importlib.util.spec_from_file_location(sweep, root / "eval" / f"{sweep}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        path = root / "eval" / "results" / name
        raw = ResultFile(path, mod.KEY, mod.MATCH)
        today = ResultFile(path, mod.KEY, mod.MATCH, normalize=stored_row_as_today)
        assert today.rows
        for row in today.rows:
            described = parse_method(row["method"]).describe()
            now = {**row, "config": described.get("config"), "options": described.get("options")}
            assert today.has(now), (name, row["method"])
            raw_due += not raw.has(now)
    assert raw_due > 0  # the committed pre-carry rows, due without the normalization
