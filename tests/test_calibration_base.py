"""The base is a candidate: every study holds the base config itself (queued once, first), and what the
report ships is never worse on the calibration problems than the best base point at equal or lower
memory. Proved with a fake objective (no model), over many random studies and landscapes."""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import optuna
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from optuna.trial import TrialState

from hfkv.calibration import report as rp
from hfkv.calibration import storage as st
from hfkv.calibration import worker
from hfkv.calibration.objectives import METRICS
from hfkv.calibration.search import BASE_POINT, SearchSpace
from hfkv.cli import build_parser, main
from hfkv.config import TriStateConfig
from tests.calibration_support import FIXTURE, FakeObjective


def _argv(tmp: Path, name: str, *extra) -> list[str]:
    return [
        "calibrate",
        "--model", "testbed",  # never loaded: the objective is fake
        "--data-file", str(FIXTURE),
        "--n-problems", "3",
        "--max-solution-tokens", "24",  # the data's solutions: nothing to generate (no model here)
        "--pruner", "none",  # counted trials below; the property test draws the pruner (a later option wins)
        "--storage", f"journal:{tmp}/{name}.log",
        "--study-name", name,
        "--studies-dir", str(tmp / "studies"),
        "--config-dir", str(tmp / "configs"),
        "--no-progress",
        *map(str, extra),
    ]  # fmt: skip


def _args(tmp: Path, name: str, *extra):
    return build_parser().parse_args(_argv(tmp, name, *extra))


def _run_study(args, fake: FakeObjective) -> optuna.Study:
    """The real worker loop (claiming, queued base points, ``_evaluate``) with ``fake`` as the objective."""
    with mock.patch.object(worker, "make_objective", lambda *a, **k: fake):
        worker.run_worker(args, 0, loaded=(None, None), progress=False)
    return optuna.load_study(study_name=args.study_name, storage=worker.prepare(args).storage.storage)


def _mem(t) -> float:
    return t.user_attrs["metrics"]["memory_ratio"]


def _q(t, metric: str) -> float:
    """Quality as a loss (lower is better) whatever the metric's direction."""
    return (1.0 if METRICS[metric][1] == "minimize" else -1.0) * t.user_attrs["metrics"][metric]


def _base_config(t, fake: FakeObjective, base: TriStateConfig) -> bool:
    """Whether trial ``t`` evaluated exactly the base (its budget aside)."""
    cfg = fake.evaluated[f"trial{t.number}"]
    return dataclasses.replace(cfg, name=base.name, budget=base.budget) == dataclasses.replace(base, provenance={})


RULES = hs.sampled_from(
    [
        ("tolerance", ()),
        ("tolerance", ("--tolerance", 0.0)),
        ("tolerance", ("--tolerance", 0.02)),
        ("max", ("--max-memory-ratio", 0.4)),
        ("max", ("--max-memory-ratio", 0.8)),
        ("min", ("--min-quality", 0.02)),
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=hs.integers(0, 2**31 - 1),
    base_name=hs.sampled_from(["hfkv", "diffkv"]),
    budget=hs.booleans(),
    n_trials=hs.integers(1, 8),
    base_points=hs.integers(1, 4),
    rule=RULES,
    metric=hs.sampled_from(["kl", "top1"]),
    base_factor=hs.sampled_from([0.0, 0.3, 1.0, 3.0]),
    sampler=hs.sampled_from(["random", "tpe"]),
    pruner=hs.sampled_from(["none", "median"]),
)
def test_the_shipped_config_is_never_worse_than_the_best_base_point_at_its_memory(
    seed, base_name, budget, n_trials, base_points, rule, metric, base_factor, sampler, pruner
):
    kind, rule_args = rule
    if kind == "min" and metric == "top1":
        rule_args = ("--min-quality", 0.92)  # top1 = 1 - 4 kl in the fake: the same bar as kl <= 0.02
    extra = ["--base", base_name, "--n-trials", n_trials, "--base-points", base_points, "--seed", seed % 1000,
             "--metric", metric, "--sampler", sampler, "--pruner", pruner, *rule_args,
             *(["--search", "budget", "--range", "budget=24:400"] if budget else [])]  # fmt: skip
    base = TriStateConfig.from_preset(base_name)
    fake = FakeObjective(seed, base=base, base_factor=base_factor)
    with tempfile.TemporaryDirectory() as tmp:
        args = _args(Path(tmp), "p", *extra)
        study = _run_study(args, fake)
        trials = rp.finished(study)
        pruned = study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
        reference = study.user_attrs["reference"]

    # The base is in the study, first, as itself, at the budgets the search explores (and never pruned).
    budgets = SearchSpace("global", ["budget"] if budget else [], args.range, base).base_budgets(base, base_points)
    expected = min(n_trials, len(budgets))
    assert len(trials) + len(pruned) == n_trials and (pruner == "median" or not pruned)
    assert not any(rp.is_base_point(t) for t in pruned)
    assert [rp.is_base_point(t) for t in trials[:expected]] == [True] * expected
    assert sum(rp.is_base_point(t) for t in trials) == expected
    for t in trials[:expected]:
        assert _base_config(t, fake, base)
    if budget:
        assert [t.params["budget"] for t in trials[:expected]] == budgets[:expected]

    tolerance = args.tolerance if args.tolerance is not None else rp.DEFAULT_TOLERANCE[metric]
    choice = rp.choose(trials, metric, reference, tolerance, args.max_memory_ratio, args.min_quality)
    bases = [t for t in trials if rp.is_base_point(t) and _mem(t) <= reference["memory_ratio"]]
    if choice.trial is None:
        # Nothing shipped: then no base point was eligible either (the base is always considered).
        assert rp.select_trial(bases, metric, reference, tolerance, args.max_memory_ratio, args.min_quality) is None
        return
    shipped = choice.trial
    at_or_below = [b for b in bases if _mem(b) <= _mem(shipped)]
    assert all(_q(shipped, metric) <= _q(b, metric) for b in at_or_below)  # never worse than the base
    assert choice.verdict == ("base" if rp.is_base_point(shipped) else "calibrated")
    if choice.verdict == "calibrated":  # strictly better: a tie goes to the base
        assert all(_q(shipped, metric) < _q(b, metric) for b in at_or_below)
    # and the selection rule still holds for what is shipped
    assert _mem(shipped) <= reference["memory_ratio"]
    if args.max_memory_ratio is not None:
        assert _mem(shipped) <= args.max_memory_ratio
    elif args.min_quality is not None:
        assert rp.quality_ok(metric, shipped.user_attrs["metrics"][metric], args.min_quality)
    else:
        assert rp.quality_loss(metric, shipped.user_attrs["metrics"][metric], reference[metric]) <= tolerance


def _trial(number: int, kl: float, mem: float, base: bool):
    t = optuna.trial.create_trial(
        params={"alpha_h": float(number)},
        distributions={"alpha_h": optuna.distributions.FloatDistribution(0, 10)},
        values=[kl, mem],
        user_attrs={"metrics": {"kl": kl, "top1": 1 - kl, "memory_ratio": mem}, "config": {"budget": 10 * number}}
        | ({BASE_POINT: "hfkv"} if base else {}),
    )
    t.number = number
    return t


def test_choose_prefers_the_base_on_a_tie_and_reports_the_numbers():
    ref = {"kl": 0.0, "top1": 1.0, "memory_ratio": 1.0}
    tie = [_trial(0, 0.005, 0.5, True), _trial(1, 0.005, 0.5, False)]
    assert rp.choose(tie[::-1], "kl", ref, 0.01).trial.number == 0  # equal quality and memory: the base
    # Under a memory cap the best quality wins; a calibrated point that a base point matches loses to it.
    cap = [_trial(0, 0.004, 0.3, True), _trial(1, 0.004, 0.35, False), _trial(2, 0.02, 0.2, False)]
    choice = rp.choose(cap, "kl", ref, 0.01, max_memory_ratio=0.4, base_name="hfkv")
    assert (choice.trial.number, choice.verdict) == (0, "base")
    assert "no calibrated config beats the base (hfkv)" in choice.message() and "budget 0" in choice.message()
    won = rp.choose([_trial(0, 0.02, 0.3, True), _trial(1, 0.004, 0.35, False)], "kl", ref, 0.01)
    rec = won.record()
    assert (won.verdict, rec["selected"]["trial"], rec["best_base_at_or_below"]["trial"]) == ("calibrated", 1, 0)
    assert rec["best_base_at_or_below"]["kl"] == 0.02 and "beats the best base point" in rec["message"]
    alone = rp.choose([_trial(0, 0.001, 0.9, True), _trial(1, 0.004, 0.35, False)], "kl", ref, 0.01)
    assert (
        alone.verdict == "calibrated" and alone.base_best is None and "every base point holds more" in (alone.message())
    )
    assert yaml.safe_load(yaml.safe_dump(rec)) == rec  # fit for the config's provenance


def test_the_base_is_queued_once_however_many_workers_open_the_study(tmp_path):
    argv = ("--base", "hfkv", "--search", "budget", "--range", "budget=24:400", "--base-points", 3, "--n-trials", 5)
    errors: list[BaseException] = []

    def opener():
        try:
            worker.open_study(worker.prepare(_args(tmp_path, "w", *argv)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    args = _args(tmp_path, "w", *argv)
    study = optuna.load_study(study_name="w", storage=worker.prepare(args).storage.storage)
    queued = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert len(queued) == 3 and all(t.user_attrs[BASE_POINT] == "hfkv" for t in queued)
    assert len({t.system_attrs["fixed_params"]["budget"] for t in queued}) == 3

    # Resumed (twice) and extended: the base points run first and are never queued again.
    fake = FakeObjective(1, base=TriStateConfig.from_preset("hfkv"))
    _run_study(_args(tmp_path, "w", *argv[:-1], 2), fake)
    study = _run_study(args, fake)
    study = _run_study(_args(tmp_path, "w", *argv[:-1], 7), fake)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 7
    assert [rp.is_base_point(t) for t in trials] == [True] * 3 + [False] * 4


def test_a_small_study_leaves_base_points_queued_and_runs_them_when_extended(tmp_path):
    argv = ("--search", "budget", "--range", "budget=24:400", "--base-points", 4)
    fake = FakeObjective(2, base=TriStateConfig.from_preset("hfkv"))
    study = _run_study(_args(tmp_path, "s", *argv, "--n-trials", 2), fake)
    c = st.counts(study)
    assert (c.complete, c.waiting) == (2, 2)  # exactly --n-trials finished; the rest of the base waits
    study = _run_study(_args(tmp_path, "s", *argv, "--n-trials", 5), fake)
    trials = study.get_trials(deepcopy=False)
    assert [rp.is_base_point(t) for t in trials] == [True] * 4 + [False]
    assert st.counts(study).complete == 5


def test_a_killed_base_point_is_retried_as_the_base(tmp_path):
    args = _args(tmp_path, "k", "--search", "budget", "--range", "budget=24:400", "--base-points", 2)
    study = worker.open_study(worker.prepare(args))
    trial = study.ask()  # the first base point; killed before it suggested anything
    st.mark_started(study, trial._trial_id)
    study._storage.set_trial_user_attr(trial._trial_id, st.HEARTBEAT, time.time() - 1000)
    assert st.fail_stale(study, grace_period=60, max_retry=1) == [trial.number]
    retry = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))[-1]
    first = study.trials[trial.number]
    assert retry.user_attrs[BASE_POINT] == "hfkv" and retry.user_attrs["retry_of"] == trial.number
    assert retry.system_attrs["fixed_params"] == first.system_attrs["fixed_params"]


@pytest.mark.parametrize(
    ("base_factor", "tolerance", "verdict"),
    [(0.0, 0.0, "base"), (50.0, 1.0, "calibrated")],  # the base exact (KL 0) / far worse than any other point
)
def test_the_cli_says_which_and_writes_the_verdict_into_the_config(tmp_path, capsys, base_factor, tolerance, verdict):
    base = TriStateConfig.from_preset("hfkv")
    fake = FakeObjective(3, base=base, base_factor=base_factor)
    argv = _argv(tmp_path, "v", "--search", "budget", "--range", "budget=24:400", "--n-trials", 8,
                 "--tolerance", tolerance)  # fmt: skip
    with (
        mock.patch.object(worker, "make_objective", lambda *a, **k: fake),
        mock.patch.object(worker, "load", lambda *a, **k: (None, None)),
    ):
        assert main(argv) == 0
    out = capsys.readouterr().out
    cfg = TriStateConfig.from_yaml(tmp_path / "configs" / "v.yaml")
    prov = cfg.provenance
    assert prov["verdict"] == verdict and f"verdict: {verdict}: " in out
    evidence = prov["verdict_evidence"]
    assert evidence["selected"]["trial"] == prov["study"]["trial"] and evidence["base_points"] == 4
    study = optuna.load_study(study_name="v", storage=worker.prepare(build_parser().parse_args(argv)).storage.storage)
    if verdict == "base":
        shipped = study.trials[prov["study"]["trial"]]
        assert rp.is_base_point(shipped) and "no calibrated config beats the base (hfkv)" in out
        # the base config, at the budget of the base point shipped (the memory it was selected at)
        assert dataclasses.replace(cfg, name="hfkv", provenance={}) == dataclasses.replace(
            base, budget=shipped.user_attrs["config"]["budget"]
        )
        assert (tmp_path / "configs" / "v.yaml").read_text().startswith("# The base config 'hfkv'")
    else:
        below = [t for t in study.trials if rp.is_base_point(t) and _mem(t) <= prov["metrics"]["memory_ratio"]]
        assert all(prov["metrics"]["kl"] < t.user_attrs["metrics"]["kl"] for t in below)
        assert (cfg.alpha_h, cfg.alpha_l) != (base.alpha_h, base.alpha_l)  # the calibrated thresholds
        assert "calibrated (trial" in out
