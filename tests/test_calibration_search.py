"""Search space, threshold tables, selection, storage and stale-trial recovery (no model needed)."""

from __future__ import annotations

import math
import time

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from hfkv.calibration import storage as st
from hfkv.calibration.granularity import alpha_tables, centred
from hfkv.calibration.report import pareto_front, select_trial
from hfkv.calibration.search import SearchSpace, SpecMismatch, check_spec, directions, least_valid_budget
from hfkv.config import TriStateConfig

STATS = {"median_log_score": [[-1.0, 0.0, 1.0], [0.5, -0.5, 0.0]], "tokens": 10}  # 2 layers x 3 heads, mean 0


def test_global_tables_clip_alpha_l_to_alpha_h():
    assert alpha_tables("global", 2.0, 0.05) == (2.0, 0.05)
    assert alpha_tables("global", 0.01, 0.05) == (0.01, 0.01)  # alpha_l <= alpha_h by construction


def test_head_tables_follow_the_statistics():
    h, lo = alpha_tables("head", 2.0, 0.04, STATS, beta_h=0.0, beta_l=0.0, delta=0.0)
    assert h == [[2.0] * 3] * 2 and lo == [[0.04] * 3] * 2  # beta = delta = 0 is the global policy
    h, lo = alpha_tables("head", 2.0, 0.04, STATS, beta_h=1.0, beta_l=0.5, delta=0.0)
    for row_h, row_l, row_z in zip(h, lo, STATS["median_log_score"], strict=True):
        for a, b, z in zip(row_h, row_l, row_z, strict=True):
            assert a == pytest.approx(2.0 * math.exp(z), rel=1e-5)
            assert b == pytest.approx(min(0.04 * math.exp(0.5 * z), a), rel=1e-5)
    h, _ = alpha_tables("head", 1.0, 0.0, STATS, delta=1.0)  # depth tilt: first layer e^-1, last e^+1
    assert h[0][0] == pytest.approx(math.exp(-1), rel=1e-5) and h[1][0] == pytest.approx(math.e, rel=1e-5)
    h, lo = alpha_tables("head", 0.05, 0.1, STATS, beta_h=2.0, beta_l=-1.0)
    assert all(b <= a for ra, rb in zip(h, lo, strict=True) for a, b in zip(ra, rb, strict=True))
    cfg = TriStateConfig.from_preset("hfkv", alpha_h=h, alpha_l=lo)  # a valid config
    assert cfg.resolve_alpha(2, 3)[0].shape == (2, 3)


def test_layer_tables_use_the_head_mean():
    z = centred(STATS, "layer")
    assert z == pytest.approx([0.0, 0.0])
    h, lo = alpha_tables("layer", 1.5, 0.02, STATS, beta_h=1.0, beta_l=1.0)
    assert h == [1.5, 1.5] and lo == [0.02, 0.02]


def test_search_space_parameters_and_ranges():
    assert list(SearchSpace("global").params) == ["alpha_h", "alpha_h_off", "alpha_l"]
    assert list(SearchSpace("head").params) == ["alpha_h", "alpha_h_off", "alpha_l", "beta_h", "beta_l", "delta"]
    s = SearchSpace("global", ["tau", "budget"], ["alpha_h=0:3"])
    assert list(s.params) == ["alpha_h", "alpha_h_off", "alpha_l", "tau1", "tau2", "tau3", "budget"]
    assert (s.params["alpha_h"].low, s.params["alpha_h"].high) == (0.0, 3.0)
    assert s.params["alpha_l"].high == 0.1
    for bad, msg in (
        (dict(ranges=["alpha_h=3"]), "NAME=LO:HI"),
        (dict(ranges=["nope=0:1"]), "unknown parameter 'nope'"),
        (dict(ranges=["alpha_h_off=0:1"]), "unknown parameter 'alpha_h_off'"),  # a choice, not a range
        (dict(ranges=["gamma=0:1"]), "does not vary"),
        (dict(ranges=["alpha_h=2:1"]), "LO <= HI"),
        (dict(extra=["temperature"]), "--search: unknown group"),
    ):
        with pytest.raises(ValueError, match=msg):
            SearchSpace("global", **{"extra": (), "ranges": (), **bad})


def test_fidelity_search_sets_the_tier_fidelities_of_a_memory_budget():
    base = TriStateConfig.from_preset("hfkv", budget=256)
    space = SearchSpace("global", ["fidelity"], base=base)
    assert list(space.params) == ["alpha_h", "alpha_h_off", "alpha_l", "fidelity_mid", "fidelity_quantized"]
    point = {"alpha_h": 1.0, "alpha_l": 0.01, "fidelity_mid": 0.9, "fidelity_quantized": 0.4}
    assert space.config(point, base, None, "t").fidelity == (1.0, 0.9, 0.4)
    clipped = space.config(point | {"fidelity_quantized": 0.95}, base, None, "t")
    assert clipped.fidelity == (1.0, 0.9, 0.9)  # quantized never above mid: every point is feasible
    # Without a mid tier only the quantized tier's fidelity is searched (a mid value would change nothing).
    two = TriStateConfig.from_preset("hfkv", budget=256, mid=None)
    space2 = SearchSpace("global", ["fidelity"], base=two)
    assert list(space2.params) == ["alpha_h", "alpha_h_off", "alpha_l", "fidelity_quantized"]
    assert space2.config({"alpha_h": 1.0, "alpha_l": 0.0, "fidelity_quantized": 0.3}, two, None, "t").fidelity == (
        1.0,
        0.3,
    )
    # No budget yet, but a searched one (in fp_tokens) makes the fidelities matter.
    unbounded = TriStateConfig.from_preset("hfkv", budget=None, oq_ratios=False, head_adaptive=False)
    assert "fidelity_mid" in SearchSpace("global", ["fidelity", "budget"], base=unbounded).params
    for bad_base, extra, msg in (
        (TriStateConfig.from_preset("evict", budget=64), ["fidelity"], "budget_unit='tokens'"),
        (unbounded, ["fidelity"], "budget=None"),
        (None, ["fidelity"], "needs the base config"),
    ):
        with pytest.raises(ValueError, match=msg):
            SearchSpace("global", extra, base=bad_base)
    with pytest.raises(ValueError, match="fidelities lie in"):
        SearchSpace("global", ["fidelity"], ["fidelity_mid=0.2:1.5"], base=base)


def test_alpha_h_off_is_a_point_of_the_space():
    base = TriStateConfig.from_preset("diffkv")
    space = SearchSpace("global")
    on = space.config({"alpha_h": 2.0, "alpha_h_off": False, "alpha_l": 0.05}, base, None, "t")
    off = space.config({"alpha_h": 2.0, "alpha_h_off": True, "alpha_l": 0.05}, base, None, "t")
    assert (on.alpha_h, on.alpha_l) == (2.0, 0.05)
    assert math.isinf(off.alpha_h) and off.alpha_l == 0.05  # alpha_l is not clipped to an infinite alpha_h
    head = SearchSpace("head").config(
        {"alpha_h": 2.0, "alpha_h_off": True, "alpha_l": 0.05, "beta_h": 1.0, "beta_l": 0.0, "delta": 0.5}, base,
        STATS, "t")  # fmt: skip
    assert all(math.isinf(a) for row in head.alpha_h for a in row)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    sampled = [space.sample(study.ask())["alpha_h_off"] for _ in range(40)]
    assert set(sampled) == {False, True}  # the sampler reaches both, not only the float range


def test_base_point_is_the_base_and_budgets_span_the_range():
    base = TriStateConfig.from_preset("hfkv", alpha_h=1.0, alpha_l=0.02)  # explicit: the preset's values may change
    assert SearchSpace("global").base_point(base) == {"alpha_h": 1.0, "alpha_h_off": False, "alpha_l": 0.02}
    hfkv = TriStateConfig.from_preset("hfkv")
    assert math.isinf(hfkv.alpha_h)  # the preset this exists for
    space = SearchSpace("global")
    point = space.base_point(hfkv)
    assert point["alpha_h_off"] is True and point["alpha_l"] == hfkv.alpha_l
    rebuilt = space.config(point, hfkv, None, "hfkv")
    assert (rebuilt.alpha_h, rebuilt.alpha_l) == (hfkv.alpha_h, hfkv.alpha_l)
    assert SearchSpace("head").base_point(base) == {"alpha_h": 1.0, "alpha_h_off": False, "alpha_l": 0.02,
                                                    "beta_h": 0.0, "beta_l": 0.0, "delta": 0.0}  # fmt: skip
    # Outside a --range: recorded at the nearest point (a base point evaluates the base itself).
    assert SearchSpace("global", ranges=["alpha_h=2:5"]).base_point(base)["alpha_h"] == 2.0
    arkv = TriStateConfig.from_preset("arkv")
    full_point = SearchSpace("global", ["tau", "gamma", "window"]).base_point(arkv)
    assert [full_point[f"tau{i}"] for i in (1, 2, 3)] == list(arkv.tau)
    assert (full_point["gamma"], full_point["window"]) == (arkv.gamma, arkv.window)

    assert SearchSpace("global").base_budgets(hfkv, 4) == [None]  # budget not searched: the base's own
    budgets = SearchSpace("global", ["budget"], ["budget=32:160"]).base_budgets(hfkv, 4)
    assert budgets[0] == 32 and budgets[-1] == 160 and len(budgets) == 4 and budgets == sorted(budgets)
    ratios = [b / a for a, b in zip(budgets, budgets[1:], strict=False)]
    assert max(ratios) / min(ratios) < 1.1  # geometric: as many points at low memory as at high
    least = least_valid_budget(lambda b: TriStateConfig.from_preset("hfkv", budget=b))
    clipped = SearchSpace("global", ["budget"], [f"budget={max(1, least // 4)}:{least}"]).base_budgets(hfkv, 4)
    assert clipped == [max(1, least // 4)]  # all raise to the least valid budget: queued once
    space = SearchSpace("global", ["budget"])
    assert space.base_overrides({"budget": 1}, hfkv) == {"budget": least}
    assert SearchSpace("global").base_overrides({"alpha_h": 1.0}, hfkv) == {}


def test_sampled_budgets_are_clipped_to_valid():
    base = TriStateConfig.from_preset("hfkv", alpha_h=1.0, alpha_l=0.02)
    space = SearchSpace("global", ["budget"])
    least = least_valid_budget(lambda b: TriStateConfig.from_preset("hfkv", budget=b))
    over = space.overrides({"alpha_h": 1.0, "alpha_l": 0.0, "budget": 1}, base, None)
    assert over["budget"] == least
    TriStateConfig.from_preset("hfkv", budget=least)
    with pytest.raises(ValueError):
        TriStateConfig.from_preset("hfkv", budget=least - 1)


def _trial(number, kl, mem):
    return create_trial(
        params={"alpha_h": float(number)},
        distributions={"alpha_h": FloatDistribution(0, 10)},
        values=[kl, mem],
        user_attrs={"metrics": {"kl": kl, "top1": 1 - kl, "memory_ratio": mem}},
    )


def test_pareto_front_and_selection_rules():
    trials = [_trial(i, kl, mem) for i, (kl, mem) in enumerate([(0.0, 1.0), (0.004, 0.6), (0.02, 0.4), (0.009, 0.5),
                                                                  (0.03, 0.7), (0.5, 0.2)])]  # fmt: skip
    for i, t in enumerate(trials):
        t.number = i
    front = pareto_front(trials, "kl")
    assert [t.number for t in front] == [5, 2, 3, 1, 0]  # trial 4 is dominated by 2 and 3
    ref = {"kl": 0.0, "top1": 1.0}
    assert select_trial(trials, "kl", ref, 0.01).number == 3  # least memory with kl <= 0.01
    assert select_trial(trials, "kl", ref, 0.001).number == 0
    assert select_trial(trials, "kl", ref, 0.01, max_memory_ratio=0.45).number == 2  # best kl under the cap
    assert select_trial(trials, "kl", ref, 0.01, min_quality=0.025).number == 2  # least memory with kl <= 0.025
    assert select_trial(trials, "top1", ref, 0.005).number == 1
    assert select_trial(trials, "kl", ref, 0.01, max_memory_ratio=0.1) is None
    # A trial holding more than the full cache is never shipped, whatever its quality or the rule.
    over = _trial(6, 0.0005, 1.12)
    over.number = 6
    assert select_trial([*trials, over], "kl", ref, 0.001).number == 0
    assert select_trial([over], "kl", ref, 0.01) is None
    assert select_trial([over], "kl", ref, 0.01, max_memory_ratio=2.0) is None
    assert select_trial([over], "kl", ref | {"memory_ratio": 1.0}, 0.01, min_quality=0.01) is None


def test_directions_and_spec_check():
    assert directions("kl", None, None) == ["minimize", "minimize"]
    assert directions("top1", 0.5, None) == ["maximize"]
    assert directions("accuracy", None, 0.3) == ["minimize"]
    with pytest.raises(ValueError, match="not both"):
        directions("kl", 0.5, 0.1)
    check_spec(None, {"a": 1}, "s")
    check_spec({"a": 1}, {"a": 1}, "s")
    with pytest.raises(SpecMismatch, match="a: stored 1 != now 2.*--study-name"):
        check_spec({"a": 1}, {"a": 2}, "s")


def test_storage_specs(tmp_path):
    s = st.open_storage(None, "demo", tmp_path)
    assert s.kind == "sqlite" and s.url == f"sqlite:///{tmp_path}/demo.db"
    j = st.open_storage(f"journal:{tmp_path}/j/x.txt", "demo")
    assert j.kind == "journal" and j.url == f"{tmp_path}/j/x.txt"
    assert st.open_storage(str(tmp_path / "y.log"), "demo").kind == "journal"
    with pytest.raises(ValueError, match="--storage='nowhere'"):
        st.open_storage("nowhere", "demo")
    assert st.redact("postgresql://bob:s3cret@db:5432/x") == "postgresql://bob:***@db:5432/x"
    assert st.redact("sqlite:///a.db") == "sqlite:///a.db"


def test_stale_trials_are_failed_and_retried_with_the_same_params(tmp_path):
    s = st.open_storage(f"journal:{tmp_path}/s.log", "demo")
    study = optuna.create_study(study_name="demo", storage=s.storage)
    trial = study.ask()
    x = trial.suggest_float("x", 0, 1)
    st.mark_started(study, trial._trial_id)
    assert st.fail_stale(study, grace_period=60, max_retry=1) == []  # fresh heartbeat: alive
    study._storage.set_trial_user_attr(trial._trial_id, st.HEARTBEAT, time.time() - 120)
    assert st.fail_stale(study, grace_period=60, max_retry=1) == [trial.number]
    c = st.counts(study)
    assert (c.failed, c.waiting, c.running) == (1, 1, 0)
    retry = study.ask()  # takes the queued retry
    assert retry.suggest_float("x", 0, 1) == x and retry.user_attrs["retry_of"] == trial.number
    st.mark_started(study, retry._trial_id)
    study._storage.set_trial_user_attr(retry._trial_id, st.HEARTBEAT, time.time() - 120)
    assert st.fail_stale(study, grace_period=60, max_retry=1) == [retry.number]
    assert st.counts(study).waiting == 0  # max_retry reached: not queued again
    assert study.trials[0].user_attrs["failed_reason"].startswith("stale")


def test_heartbeat_refreshes_a_running_trial(tmp_path):
    s = st.open_storage(f"journal:{tmp_path}/h.log", "demo")
    study = optuna.create_study(study_name="demo", storage=s.storage)
    trial = study.ask()
    st.mark_started(study, trial._trial_id)
    first = study.trials[0].user_attrs[st.HEARTBEAT]
    with st.Heartbeat(study._storage, trial._trial_id, interval=0.05):
        time.sleep(0.3)
    assert study.trials[0].user_attrs[st.HEARTBEAT] > first
    assert study.trials[0].state == TrialState.RUNNING


def _granularity_script():
    import importlib.util

    from tests.calibration_support import REPO

    spec = importlib.util.spec_from_file_location(
        "compare_granularity", REPO / "calibration" / "compare_granularity.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(granularity, points, setup="a"):
    trials = [
        {"number": i, "state": "COMPLETE", "metrics": {"kl": kl, "top1": 1 - kl, "memory_ratio": m}}
        for i, (m, kl) in enumerate(points)
    ]
    trials.append({"number": len(points), "state": "FAIL", "metrics": None})
    spec = {"model": setup, "objective": "fidelity", "space": {"granularity": granularity}}
    return {"study": granularity, "spec": spec, "reference": {"kl": 0.0}, "trials": trials}


def test_granularity_comparison_reads_fronts_at_equal_memory():
    mod = _granularity_script()
    g = _summary("global", [(0.2, 0.5), (0.5, 0.1), (1.0, 0.0)])
    h = _summary("head", [(0.3, 0.2), (0.5, 0.2), (0.9, 0.05)])
    assert mod.best_at(g["trials"][:3], "kl", 0.6) == 0.1 and mod.best_at(g["trials"][:3], "kl", 0.1) is None
    result = mod.compare({"global": g, "head": h}, ["kl", "top1"], n_levels=3)
    # common grid: from the larger minimum (0.3) to the smaller maximum (0.9)
    assert [r["memory_ratio"] for r in result["grid"]] == [0.3, 0.6, 0.9]
    assert [r["global:kl"] for r in result["grid"]] == [0.5, 0.1, 0.1]
    assert [r["head:kl"] for r in result["grid"]] == [0.2, 0.2, 0.05]
    assert result["wins"]["head vs global (kl)"] == {"better": 2, "equal": 0, "worse": 1}
    assert "**0.2000**" in mod.table(result)
    with pytest.raises(SystemExit, match="differs"):
        mod.compare({"global": g, "head": _summary("head", [(0.3, 0.2)], setup="b")}, ["kl"])
