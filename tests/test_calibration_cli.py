"""`hfkv calibrate` end to end on a tiny random model and the fixture: a config that loads and runs,
resuming, a SIGKILLed worker, several workers on one journal file or PostgreSQL study, --help."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfkv import TriStateCache, TriStateConfig
from hfkv.calibration.data import load_jsonl, select
from hfkv.calibration.objectives import FidelityObjective
from hfkv.cli import build_parser, main
from tests.calibration_support import FIXTURE, cli_args, postgres_server, save_tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small models: one thread is faster than two on a shared 2-core machine (and leaves the other core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _sqlite(tmp_path, name):
    return f"sqlite:///{tmp_path}/studies/{name}.db"


def _snapshot(study):
    return [(t.number, t.state, t.params, t.values) for t in study.get_trials(deepcopy=False)]


def test_three_trial_study_writes_a_config_that_loads_and_runs(tiny_dir, tmp_path):
    args = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", "s3", "--n-trials", 3, "--holdout", 2,
                    "--compare", "quant", "--match-steps", 2, "--holdout-levels", "none")  # fmt: skip
    assert main(args) == 0
    study = optuna.load_study(study_name="s3", storage=_sqlite(tmp_path, "s3"))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    # the base first: diffkv's own thresholds (and the base config itself, as the trial evaluated it)
    assert study.trials[0].params == {"alpha_h": 1.0, "alpha_h_off": False, "alpha_l": 0.02}
    assert study.trials[0].user_attrs["base_point"] == "diffkv" and study.trials[0].user_attrs["config"] == {}
    ref = study.user_attrs["reference"]
    assert (ref["kl"], ref["top1"], ref["memory_ratio"]) == (0.0, 1.0, 1.0)

    path = tmp_path / "configs" / "s3.yaml"
    cfg = TriStateConfig.from_yaml(path)
    prov = cfg.provenance
    chosen = study.trials[prov["study"]["trial"]]
    rows = load_jsonl(FIXTURE)
    assert prov["data"]["sha256"] == select(rows, 3, 0, holdout=2).hash
    assert prov["metrics"] == chosen.user_attrs["metrics"] and prov["params"] == chosen.params
    assert {"hfkv", "torch", "transformers", "optuna", "python"} <= set(prov["versions"]) and prov["date"]
    assert cfg.name == "s3" and cfg.window == 64  # the diffkv base, with the trial's thresholds
    assert prov["verdict"] == ("base" if chosen.number == 0 else "calibrated")
    assert (cfg.alpha_h, cfg.alpha_l) == (
        chosen.user_attrs["config"].get("alpha_h", 1.0),
        chosen.user_attrs["config"].get("alpha_l", 0.02),
    )
    # smallest memory within the default tolerance (0.01 nats)
    ok = [t for t in study.trials if t.user_attrs["metrics"]["kl"] <= 0.01]
    assert chosen.user_attrs["metrics"]["memory_ratio"] == min(t.user_attrs["metrics"]["memory_ratio"] for t in ok)

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    # the file reproduces the trial: same problems, same measurement
    sel = select(rows, 3, 0, holdout=2)
    again = FidelityObjective(model, tok, sel.calibration, max_solution_tokens=24).evaluate(cfg)
    assert again.to_dict() == pytest.approx(chosen.user_attrs["metrics"])
    # and it runs in generate like a preset
    enc = tok("Problem: 1+1?", return_tensors="pt")
    cache = TriStateCache(model, cfg)
    out = model.generate(**enc, past_key_values=cache, max_new_tokens=80, do_sample=False, eos_token_id=None)
    assert out.shape[1] == enc.input_ids.shape[1] + 80 and cache.stats().kv_bytes > 0

    out_dir = tmp_path / "studies" / "s3"
    for f in ("summary.json", "trials.csv", "pareto.png", "importance.png", "holdout.json", "holdout.png"):
        assert (out_dir / f).stat().st_size > 0, f
    assert (out_dir / "trials.csv").read_text().count("\n") == 4


def test_holdout_compares_at_two_memory_levels(tiny_dir, tmp_path, capsys):
    # Sequences of ~300 tokens so that 15% of DynamicCache is above the least budget the presets take;
    # chunks of 8 solution tokens per forward keep the ~25 evaluations of the comparison cheap.
    args = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", "lv", "--n-trials", 2, "--tolerance", 1,
                    "--n-problems", 1, "--holdout", 1, "--max-solution-tokens", 128, "--chunk", 8,
                    "--compare", "hfkv", "--match-steps", 5, "--holdout-levels", "0.3,0.15")  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    path = tmp_path / "studies" / "lv" / "holdout.json"
    result = json.loads(path.read_text())
    assert [lv["level"] for lv in result["levels"]] == [0.15, 0.3]
    assert "memory level 0.15 of DynamicCache" in out and "memory level 0.30 of DynamicCache" in out
    for lv in result["levels"]:
        rows = {r["config"]: r for r in lv["rows"]}
        hfkv = rows["hfkv"]  # its fp-token budget reaches both levels on these sequences
        assert lv["level"] - 0.05 <= hfkv["memory_ratio"] <= lv["level"], lv
        assert hfkv["kind"] == "preset" and {"kl", "top1"} <= set(hfkv) and hfkv["budget"] > 0
        if "lv" in rows:  # the selected config, its budget matched to the level like the presets'
            assert lv["level"] - 0.05 <= rows["lv"]["memory_ratio"] <= lv["level"], lv
            assert "hfkv" in lv["verdicts"]
        else:  # diffkv's token budget may not get that low: then the table says so
            assert lv["missing"]["lv"]["lowest_memory"] > lv["level"]
    # a finished study's report reuses the comparison
    assert main(args) == 0 and json.loads(path.read_text()) == result


def test_rerun_resumes_and_keeps_earlier_trials(tiny_dir, tmp_path, capsys):
    base = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", "r", "--seed", 1)
    assert main([*base, "--n-trials", "2"]) == 0
    study = optuna.load_study(study_name="r", storage=_sqlite(tmp_path, "r"))
    before = _snapshot(study)
    assert main([*base, "--n-trials", "4"]) == 0
    after = _snapshot(study)
    assert len(after) == 4 and after[:2] == before and all(s == TrialState.COMPLETE for _, s, _, _ in after)
    assert main([*base, "--n-trials", "4"]) == 0  # finished: nothing more to run
    assert _snapshot(study) == after
    capsys.readouterr()
    assert main([*base, "--n-trials", "4", "--n-problems", "4"]) == 2  # other data: refused, not mixed
    assert "different setup" in capsys.readouterr().err


def test_max_memory_ratio_is_a_constrained_single_objective(tiny_dir, tmp_path):
    args = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", "c", "--n-trials", 3,
                    "--max-memory-ratio", 0.8, "--sampler", "random")  # fmt: skip
    rc = main(args)
    study = optuna.load_study(study_name="c", storage=_sqlite(tmp_path, "c"))
    assert study.directions == [optuna.study.StudyDirection.MINIMIZE]
    for t in study.trials:
        m = t.user_attrs["metrics"]
        assert t.values == [m["kl"]] and t.user_attrs["constraint"] == [pytest.approx(m["memory_ratio"] - 0.8)]
    feasible = [t for t in study.trials if t.user_attrs["metrics"]["memory_ratio"] <= 0.8]
    if feasible:  # the best KL among configs under the memory cap
        assert rc == 0
        cfg = TriStateConfig.from_yaml(tmp_path / "configs" / "c.yaml")
        assert cfg.provenance["metrics"]["kl"] == min(t.user_attrs["metrics"]["kl"] for t in feasible)
    else:
        assert rc == 3 and not (tmp_path / "configs" / "c.yaml").exists()


def _study_exists(db: Path, name: str) -> bool:
    """Whether ``db`` already holds study ``name`` (read-only: never creates tables)."""
    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)) as con:
            return con.execute("SELECT 1 FROM studies WHERE study_name = ?", (name,)).fetchone() is not None
    except sqlite3.Error:  # no schema yet, or busy
        return False


def test_sigkill_of_the_worker_mid_trial_loses_no_finished_trial(tiny_dir, tmp_path):
    # Longer solutions than elsewhere (~1.5 s a trial): long enough to catch the worker mid-trial on a busy machine.
    args = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", "k", "--n-trials", 4,
                    "--heartbeat-interval", 1, "--grace-period", 3, "--max-solution-tokens", 64)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "hfkv.cli", *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    url, storage = _sqlite(tmp_path, "k"), None
    deadline, running = time.time() + 300, None
    try:
        while running is None:
            assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()[-2000:]}"
            assert time.time() < deadline, "no trial finished in time"
            time.sleep(0.05)
            try:
                # Open the storage only once the worker has created the schema and the study: RDBStorage
                # creates missing tables itself, and doing so beside the worker makes the worker fail.
                if storage is None and _study_exists(tmp_path / "studies" / "k.db", "k"):
                    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 2}})
                trials = optuna.load_study(study_name="k", storage=storage).get_trials()
            except Exception:  # not created yet, or the database is busy
                continue
            if not any(t.state == TrialState.COMPLETE for t in trials) or not any(
                t.state == TrialState.RUNNING for t in trials
            ):
                continue
            os.kill(proc.pid, signal.SIGSTOP)  # freeze it, then check it is really mid-trial
            try:
                trials = optuna.load_study(study_name="k", storage=storage).get_trials()
                running = next((t for t in trials if t.state == TrialState.RUNNING), None)
            except Exception:
                running = None
            if running is None:
                os.kill(proc.pid, signal.SIGCONT)
        finished = {t.number: (t.params, t.values) for t in trials if t.state == TrialState.COMPLETE}
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    assert main(args) == 0  # the same command resumes
    study = optuna.load_study(study_name="k", storage=_sqlite(tmp_path, "k"))
    trials = study.get_trials()
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 4
    for number, (params, values) in finished.items():
        t = trials[number]
        assert (t.state, t.params, t.values) == (TrialState.COMPLETE, params, values)
    killed = trials[running.number]
    assert killed.state == TrialState.FAIL and killed.user_attrs["failed_reason"].startswith("stale")
    retries = [t for t in trials if t.user_attrs.get("retry_of") == killed.number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    # The retry repeats what the killed trial had sampled (all, part or none of it: the kill may land
    # between two suggestions) and samples the rest.
    assert killed.params.items() <= retries[0].params.items()


def test_sigterm_fails_the_running_trial_and_exits(tiny_dir, tmp_path):
    args = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", "t", "--n-trials", 2,
                    "--max-solution-tokens", 64)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "hfkv.cli", *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    url, deadline = _sqlite(tmp_path, "t"), time.time() + 300
    try:
        while True:
            assert proc.poll() is None, f"finished before SIGTERM: {proc.stderr.read().decode()[-2000:]}"
            assert time.time() < deadline, "no trial started in time"
            time.sleep(0.05)
            try:
                trials = optuna.load_study(study_name="t", storage=url).get_trials()
            except Exception:
                continue
            if any(t.state == TrialState.RUNNING and t.params for t in trials):
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "re-run to resume" in proc.stderr.read().decode()
    trials = optuna.load_study(study_name="t", storage=url).get_trials()
    assert not any(t.state == TrialState.RUNNING for t in trials)  # nothing left for the grace period
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["failed_reason"] == "interrupted"


def test_sigterm_whose_exception_a_finalizer_swallowed_still_fails_the_trial_and_exits(tiny_dir, tmp_path, monkeypatch):
    """A handler run inside a finalizer loses its exception (the flaky CI exit 0 of the test above): still 143."""
    from hfkv.calibration import worker

    evaluate = worker._evaluate

    def signalled_in_a_finalizer(*a, **k):
        values = evaluate(*a, **k)

        class Finalized:
            def __del__(self):
                worker._on_sigterm(signal.SIGTERM, None)  # Python prints "Exception ignored in" and goes on

        Finalized()
        return values

    monkeypatch.setattr(worker, "_evaluate", signalled_in_a_finalizer)
    monkeypatch.setattr(worker, "_terminating", type(worker._terminating)())
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # this process's own handlers stay as they are
    args = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", "f", "--n-trials", 2,
                    "--max-solution-tokens", 16)  # fmt: skip
    assert main(args) == 143
    trials = optuna.load_study(study_name="f", storage=_sqlite(tmp_path, "f")).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL]
    assert trials[0].user_attrs["failed_reason"] == "interrupted"


def _two_workers(tiny_dir, tmp_path, storage_arg, name, n):
    """The command in this process (the parent does no trial) with two spawned worker processes."""
    args = cli_args(tiny_dir, tmp_path, "--base", "diffkv", "--study-name", name, "--storage", storage_arg,
                    "--n-workers", 2, "--threads", 1, "--n-trials", n, "--max-solution-tokens", 16)  # fmt: skip
    assert main(args) == 0


def _assert_exact(study, n):
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(n))  # nothing lost, nothing extra
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len({tuple(sorted(t.params.items())) for t in trials}) == n  # no trial evaluated twice
    workers = {t.user_attrs["worker"] for t in trials}
    assert 1 <= len(workers) <= 2 and all(w.rsplit(":", 1)[1] != str(os.getpid()) for w in workers)


def test_two_workers_on_a_journal_file_make_exactly_n_trials(tiny_dir, tmp_path):
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    journal = tmp_path / "study.log"
    _two_workers(tiny_dir, tmp_path, f"journal:{journal}", "j", 6)
    study = optuna.load_study(study_name="j", storage=JournalStorage(JournalFileBackend(str(journal))))
    _assert_exact(study, 6)


@pytest.fixture(scope="module")
def postgres_url():
    url = os.environ.get("HFKV_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    server = postgres_server()
    try:
        url = server.__enter__()
    except RuntimeError as exc:
        pytest.skip(f"PostgreSQL test: set HFKV_TEST_POSTGRES_URL or install the server (initdb, pg_ctl): {exc}")
    yield url
    server.__exit__(None, None, None)


def test_two_workers_share_a_postgresql_study(tiny_dir, tmp_path, postgres_url):
    name = f"pg-{uuid.uuid4().hex[:8]}"
    _two_workers(tiny_dir, tmp_path, postgres_url, name, 4)
    _assert_exact(optuna.load_study(study_name=name, storage=postgres_url), 4)


def test_offline_without_data_file_names_the_option(tiny_dir, tmp_path, capsys):
    rc = main(["calibrate", "--model", str(tiny_dir), "--studies-dir", str(tmp_path), "--no-progress"])
    assert rc == 2 and "--data-file" in capsys.readouterr().err


def test_help_documents_every_option(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    calibrate = sub.choices["calibrate"]
    options = [a for a in calibrate._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 30
    for a in options:
        assert a.help and len(a.help) > 15, a.option_strings
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for a in options:
        assert a.option_strings[0] in out
    assert "optuna-dashboard" in out and "resumes" in out


def test_storage_creation_retries_when_another_worker_is_creating_the_tables(tmp_path, monkeypatch):
    import sqlalchemy.exc

    from hfkv.calibration import storage as st

    real, calls = optuna.storages.RDBStorage, []

    def racing(url, **kw):  # the first construction loses the race to create the schema
        calls.append(url)
        if len(calls) == 1:
            raise sqlalchemy.exc.OperationalError("CREATE TABLE studies", {}, Exception("table studies already exists"))
        return real(url, **kw)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    opened = st.open_storage(None, "race", tmp_path)
    assert len(calls) == 2 and opened.kind == "sqlite"
    calls.clear()

    def broken(url, **kw):  # any other database error is not retried
        calls.append(url)
        raise sqlalchemy.exc.OperationalError("SELECT", {}, Exception("disk I/O error"))

    monkeypatch.setattr(optuna.storages, "RDBStorage", broken)
    with pytest.raises(sqlalchemy.exc.OperationalError, match="disk I/O"):
        st.open_storage(None, "other", tmp_path)
    assert len(calls) == 1
