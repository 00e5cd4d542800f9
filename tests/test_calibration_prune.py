"""Long generations and cheaper trials: the model's own greedy solutions are generated once per study (however
many workers, however often it is resumed) and teacher-forced by every trial; trials are pruned over problems,
recorded as pruned and never selected; the options that choose them are checked up front."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from pathlib import Path
from unittest import mock

import optuna
import pytest
import torch
from optuna.trial import TrialState

from hfkv.calibration import report as rp
from hfkv.calibration import storage as st
from hfkv.calibration import worker
from hfkv.calibration.cli import check_args
from hfkv.calibration.data import load_jsonl
from hfkv.calibration.objectives import FidelityObjective, encode, generate_solutions
from hfkv.calibration.search import SpecMismatch
from hfkv.cli import build_parser, main
from hfkv.cli_args import UsageError
from hfkv.config import TriStateConfig
from hfkv.loading import load_model
from tests.calibration_support import FIXTURE, FakeObjective, save_tiny


def _argv(tmp: Path, name: str, *extra) -> list[str]:
    return [
        "calibrate",
        "--model", "testbed",  # never loaded: the objective is fake
        "--data-file", str(FIXTURE),
        "--n-problems", "3",
        "--storage", f"journal:{tmp}/{name}.log",
        "--study-name", name,
        "--studies-dir", str(tmp / "studies"),
        "--config-dir", str(tmp / "configs"),
        "--no-progress",
        *map(str, extra),
    ]  # fmt: skip


def _args(tmp: Path, name: str, *extra):
    return build_parser().parse_args(_argv(tmp, name, *extra))


class Spy:
    """Stands in for :func:`generate_solutions` (no model): counts its calls, slow enough for workers to race."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, model, tok, problems, max_new_tokens, fmt="auto", n_shots=0, progress=False):
        with self.lock:
            self.calls += 1
        time.sleep(0.3)
        return [[(7 * i + j) % 250 for j in range(max_new_tokens - i)] for i in range(len(problems))]


def _patched(fake, spy, seen, barrier=None):
    """The spy as the generator, ``fake`` as the objective; what each worker teacher-forces lands in ``seen``.
    Patched once around all workers (a patch per thread would be undone by the first thread to finish).
    With ``barrier``, each worker waits there after building its objective, so every worker builds one
    before any runs a trial (else a fast worker may finish the study before another starts)."""

    def make(ctx, model, tok, problems, solutions=None):
        seen.append(solutions)
        if barrier is not None:
            barrier.wait()
        return fake

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(worker, "generate_solutions", spy))
    stack.enter_context(mock.patch.object(worker, "make_objective", make))
    return stack


def _run(args, fake, spy, seen):
    with _patched(fake, spy, seen):
        worker.run_worker(args, 0, loaded=(None, None), progress=False)


# --------------------------------------------------------------------------- generated solutions
def test_solutions_are_generated_once_per_study_across_workers_and_resumes(tmp_path):
    spy, seen, errors = Spy(), [], []
    fake = FakeObjective(4, base=TriStateConfig.from_preset("hfkv"))
    argv = ("--pruner", "none", "--max-new-tokens", 40)

    def one_worker(index):
        try:
            worker.run_worker(_args(tmp_path, "g", *argv, "--n-trials", 4), index, loaded=(None, None), progress=False)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with _patched(fake, spy, seen, threading.Barrier(2, timeout=120)):
        threads = [threading.Thread(target=one_worker, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors
    assert spy.calls == 1  # two workers, one generation
    assert len(seen) == 2 and seen[0] == seen[1] and [len(s) for s in seen[0]] == [40, 39, 38]

    # Resumed and extended: read back, never generated again.
    _run(_args(tmp_path, "g", *argv, "--n-trials", 6), fake, spy, seen)
    assert spy.calls == 1 and seen[-1] == seen[0]
    study = optuna.load_study(study_name="g", storage=worker.prepare(_args(tmp_path, "g", *argv)).storage.storage)
    assert st.counts(study).complete == 6
    manifest = study.user_attrs[f"{worker.SOLUTIONS}:calibration"]
    assert manifest["lengths"] == [40, 39, 38] and manifest["max_new_tokens"] == 40
    spec = study.user_attrs["spec"]["evaluation"]
    assert spec["solutions"] == "generated" and spec["max_new_tokens"] == 40 and spec["max_solution_tokens"] is None

    # Solutions generated for another length are another study: refused, not mixed.
    with pytest.raises(SpecMismatch, match="different setup"):
        worker.open_study(worker.prepare(_args(tmp_path, "g", "--pruner", "none", "--max-new-tokens", 41)))


def test_incomplete_stored_solutions_are_regenerated(tmp_path):
    """A worker killed while storing them leaves no (valid) manifest: the next one generates them again."""
    spy, seen = Spy(), []
    args = _args(tmp_path, "i", "--pruner", "none", "--max-new-tokens", 12, "--n-trials", 1)
    ctx = worker.prepare(args)
    study = worker.open_study(ctx)
    study.set_user_attr(f"{worker.SOLUTIONS}:calibration:0", [1, 2, 3])  # a part, no manifest
    _run(args, FakeObjective(1), spy, seen)
    assert spy.calls == 1 and [len(s) for s in seen[0]] == [12, 11, 10]
    study.set_user_attr(f"{worker.SOLUTIONS}:calibration:1", [9])  # tampered: the hash no longer matches
    with mock.patch.object(worker, "generate_solutions", spy):
        again = worker.ensure_solutions(ctx, study, None, None, ctx.selection.calibration)
    assert spy.calls == 2 and again == seen[0]


def test_reference_solutions_generate_nothing(tmp_path):
    spy, seen = Spy(), []
    _run(_args(tmp_path, "r", "--pruner", "none", "--max-solution-tokens", 24, "--n-trials", 1), FakeObjective(2),
         spy, seen)  # fmt: skip
    assert spy.calls == 0 and seen == [None]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    path = save_tiny(tmp_path_factory.mktemp("tiny") / "model", chat=True)
    return load_model(str(path))


def test_generated_solutions_respect_the_length_bound_and_are_teacher_forced(tiny):
    model, tok = tiny
    problems = load_jsonl(FIXTURE)[:2]
    sols = generate_solutions(model, tok, problems, 9, "chat")
    assert len(sols) == 2 and all(1 <= len(s) <= 9 for s in sols)
    # what generate wrote after the chat prompt, token for token
    items = encode(tok, problems, "chat", 0, None, sols)
    for it, s in zip(items, sols, strict=True):
        assert it.ids[0, it.prompt_len :].tolist() == s
        again = model.generate(it.ids[:, : it.prompt_len], max_new_tokens=9, do_sample=False,
                               pad_token_id=tok.pad_token_id)  # fmt: skip
        assert again[0, it.prompt_len :].tolist()[: len(s)] == s
    obj = FidelityObjective(model, tok, problems, solutions=sols, prompt="chat")
    assert obj.longest() == max(it.ids.shape[1] for it in items)
    assert obj.evaluate(TriStateConfig.from_preset("full")).quality == {"kl": 0.0, "top1": 1.0}
    plain = generate_solutions(model, tok, problems[:1], 5, "plain", n_shots=1)
    assert 1 <= len(plain[0]) <= 5


# --------------------------------------------------------------------------- pruning
class Worsening(FakeObjective):
    """Every trial after the base point is worse than all before it, at more memory: a pruner's clear case."""

    def _evaluate(self, cfg):
        from hfkv.calibration.objectives import Evaluation

        k = int(cfg.name.removeprefix("trial")) if cfg.name.startswith("trial") else 0
        dense = 1_000_000
        if not cfg.compress:
            return Evaluation({"kl": 0.0, "top1": 1.0}, dense, dense, 1)
        kl, mem = 0.001 * (k + 1), min(0.9, 0.05 * (k + 1))
        return Evaluation({"kl": kl, "top1": 1 - kl}, round(mem * dense), dense, 1)


@pytest.mark.parametrize(
    ("pruner", "extra"),
    [("median", ()), ("median", ("--max-memory-ratio", 0.95)), ("none", ())],
)
def test_pruned_trials_are_recorded_as_pruned_and_never_selected(tmp_path, capsys, pruner, extra):
    fake = Worsening(0, n_problems=8)
    argv = _argv(tmp_path, "p", "--max-solution-tokens", 24, "--n-problems", 8, "--n-trials", 10,
                 "--sampler", "random", "--tolerance", 1.0, "--pruner", pruner, *extra)  # fmt: skip
    with (
        mock.patch.object(worker, "make_objective", lambda *a, **k: fake),
        mock.patch.object(worker, "load", lambda *a, **k: (None, None)),
    ):
        assert main(argv) == 0
    study = optuna.load_study(study_name="p", storage=worker.prepare(build_parser().parse_args(argv)).storage.storage)
    trials = study.get_trials(deepcopy=False)
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    # nothing lost, nothing extra: --n-trials counts complete and pruned trials
    assert len(trials) == 10 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    if pruner == "none":
        assert not pruned
        return
    # the first 5 finished trials are the pruner's yardstick; after them every (worse) trial is stopped
    assert [t.number for t in pruned] == list(range(5, 10))
    warmup = worker.pruner_settings(8)[1]
    for t in pruned:
        assert "metrics" not in t.user_attrs and fake.steps[f"trial{t.number}"] == warmup + 1  # stopped early
        assert sorted(map(int, t.user_attrs[worker.RUNNING])) == list(range(warmup + 1))
        if extra:  # single objective: Optuna's own trial.report / should_prune
            assert sorted(t.intermediate_values) == list(range(warmup + 1))
    assert all(fake.steps[f"trial{t.number}"] == 8 for t in trials if t.state == TrialState.COMPLETE)
    summary = json.loads((tmp_path / "studies" / "p" / "summary.json").read_text())
    assert summary["counts"]["pruned"] == 5 and summary["counts"]["complete"] == 5
    prov = TriStateConfig.from_yaml(tmp_path / "configs" / "p.yaml").provenance
    assert study.trials[prov["study"]["trial"]].state == TrialState.COMPLETE
    assert {t.number for t in rp.finished(study)}.isdisjoint(t.number for t in pruned)
    assert re.search(r"trial 5 \[p\]: pruned \(at problem \d", capsys.readouterr().err)


def test_base_points_are_never_pruned(tmp_path):
    fake = Worsening(0, n_problems=8)
    args = _args(tmp_path, "b", "--max-solution-tokens", 24, "--n-problems", 8, "--n-trials", 9, "--sampler",
                 "random", "--search", "budget", "--range", "budget=24:400", "--base-points", 4)  # fmt: skip
    ctx = worker.prepare(args)
    study = worker.open_study(ctx)
    for budget in (30, 40, 50, 60):  # four more base points, queued after the study's own: worse and worse
        study.enqueue_trial(ctx.space.base_point(ctx.base) | {"budget": budget}, user_attrs={"base_point": "hfkv"})
    with mock.patch.object(worker, "make_objective", lambda *a, **k: fake):
        worker.run_worker(args, 0, loaded=(None, None), progress=False)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials[:8]] == [TrialState.COMPLETE] * 8 and all(rp.is_base_point(t) for t in trials[:8])
    assert trials[8].state == TrialState.PRUNED and not rp.is_base_point(trials[8])


def test_hyperband_runs_a_single_objective_study(tmp_path):
    fake = Worsening(0, n_problems=6)
    args = _args(tmp_path, "h", "--max-solution-tokens", 24, "--n-problems", 6, "--n-trials", 8, "--sampler",
                 "random", "--pruner", "hyperband", "--max-memory-ratio", 0.95)  # fmt: skip
    with mock.patch.object(worker, "make_objective", lambda *a, **k: fake):
        worker.run_worker(args, 0, loaded=(None, None), progress=False)
    study = optuna.load_study(study_name="h", storage=worker.prepare(args).storage.storage)
    c = st.counts(study)
    assert c.finished == 8 and c.failed == 0 and c.complete >= 1
    assert isinstance(worker.make_pruner("hyperband", 6), optuna.pruners.HyperbandPruner)


def test_pruner_factory():
    median = worker.make_pruner("median", 200)
    assert isinstance(median, optuna.pruners.MedianPruner)
    assert (median._n_startup_trials, median._n_warmup_steps) == (5, 50)
    assert worker.pruner_settings(3) == (5, 1)
    assert isinstance(worker.make_pruner("none", 10), optuna.pruners.NopPruner)
    assert isinstance(worker.make_pruner("median", 10, n_objectives=2), optuna.pruners.NopPruner)  # own rule there
    with pytest.raises(ValueError, match="--pruner"):
        worker.make_pruner("sha", 10)


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("argv", "option", "words"),
    [
        (["--pruner", "medain"], "--pruner", "median"),
        (["--pruner", "hyperband"], "--pruner", "--max-memory-ratio"),
        (["--max-solution-tokens", "48", "--max-new-tokens", "512"], "--max-solution-tokens", "--max-new-tokens"),
    ],
)
def test_bad_pruner_and_solution_options_are_refused_in_one_line(argv, option, words, tmp_path, capsys):
    rc = main(["calibrate", "--model", "testbed", "--data-file", str(FIXTURE), "--studies-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"hfkv calibrate: error: {option}: ") and words in err[0]
    assert not list(tmp_path.iterdir())  # no storage, no data written


def test_allowed_combinations_pass_the_checks():
    ok = ["calibrate", "--model", "testbed", "--data-file", str(FIXTURE)]
    parse = build_parser().parse_args
    check_args(parse([*ok, "--pruner", "hyperband", "--min-quality", "0.1"]))
    check_args(parse([*ok, "--max-solution-tokens", "48"]))
    check_args(parse([*ok, "--max-new-tokens", "2048"]))
    check_args(parse([*ok, "--objective", "accuracy", "--max-new-tokens", "64"]))
    with pytest.raises(UsageError):
        check_args(parse([*ok, "--pruner", "hyperband"]))
    args = parse(ok)
    assert (args.pruner, worker.solution_source(args), worker.max_new_tokens(args)) == ("median", "generated", 1024)
    args = parse([*ok, "--objective", "accuracy"])
    assert (worker.solution_source(args), worker.max_new_tokens(args)) == (None, 512)


def test_a_study_on_a_real_model_teacher_forces_its_own_generations(tmp_path, tiny):
    """End to end on the tiny model: generated once (calibration and held-out problems), then reused by the
    report; the config's provenance says which solutions were measured."""
    model_dir = tmp_path / "model"
    save_tiny(model_dir, chat=True)
    argv = ["calibrate", "--model", str(model_dir), "--data-file", str(FIXTURE), "--n-problems", 2,
            "--holdout", 1, "--max-new-tokens", 12, "--chunk", 4, "--base", "diffkv", "--n-trials", 2,
            "--tolerance", 1, "--compare", "quant", "--match-steps", 1, "--holdout-levels", "none",
            "--studies-dir", tmp_path / "studies", "--config-dir", tmp_path / "configs", "--no-progress"]  # fmt: skip
    argv = list(map(str, argv))
    calls = []
    real = worker.generate_solutions

    def counted(*a, **k):
        calls.append(len(a[2]))
        return real(*a, **k)

    with mock.patch.object(worker, "generate_solutions", counted):
        assert main(argv) == 0
        assert main(argv) == 0  # the report again: nothing generated twice
    assert calls == [2, 1]  # the calibration problems, then the held-out one
    prov = TriStateConfig.from_yaml(tmp_path / "configs" / "model-fidelity-global.yaml").provenance
    assert prov["evaluation"]["solutions"] == "generated" and prov["evaluation"]["max_new_tokens"] == 12
    study = optuna.load_study(
        study_name="model-fidelity-global", storage=f"sqlite:///{tmp_path}/studies/model-fidelity-global.db"
    )
    assert all(1 <= n <= 12 for n in study.user_attrs[f"{worker.SOLUTIONS}:calibration"]["lengths"])
    assert len(study.user_attrs[f"{worker.SOLUTIONS}:holdout"]["lengths"]) == 1
