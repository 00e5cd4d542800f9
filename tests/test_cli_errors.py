"""Bad command lines of every ``hfkv`` subcommand: exit status 2, one line on stderr naming the option and the
value, nothing loaded or built. In-process (``hfkv.cli.main``) with the loaders replaced by recorders, so the
table runs in seconds; one subprocess checks that the console shows no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hfkv.loading
import hfkv.testbed.tasks
from hfkv.cli import build_parser, main
from hfkv.evaluation import bench

NOWHERE = "/nonexistent/model-dir"


@pytest.fixture
def loads(monkeypatch):
    """Every way a subcommand loads a model or builds its data, recorded (and refused) instead."""
    import transformers

    calls: list[str] = []

    def recorder(name):
        def record(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called")

        return record

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recorder("from_pretrained"))
    monkeypatch.setattr(hfkv.loading, "load_model", recorder("load_model"))
    monkeypatch.setattr(hfkv.testbed.tasks, "load_test_set", recorder("load_test_set"))
    monkeypatch.setattr(bench, "load_bench_model", recorder("load_bench_model"))
    monkeypatch.setattr(bench, "bench_group", recorder("bench_group"))
    try:
        from lm_eval.config.evaluate_config import EvaluatorConfig

        from hfkv.evaluation import lm_eval_model as lm

        monkeypatch.setattr(lm.HFLM, "_create_model", recorder("HFLM._create_model"))
        monkeypatch.setattr(EvaluatorConfig, "process_tasks", recorder("lm-eval tasks"))
    except ImportError:
        pass
    try:
        from hfkv.calibration import storage, worker

        monkeypatch.setattr(worker, "load_problems", recorder("calibration data"))
        monkeypatch.setattr(storage, "open_storage", recorder("optuna storage"))
    except ImportError:
        pass
    return calls


def run(argv: list[str], capsys) -> tuple[int, list[str]]:
    """``hfkv <argv>`` in this process: (exit status, stderr lines)."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # --help / --version
        rc = exc.code
    err = capsys.readouterr().err
    return rc, err.strip().splitlines()


def test_the_recorders_see_a_valid_command_load(loads, capsys, tmp_path, monkeypatch):
    """The fixture would notice a load: a valid command line reaches it (and fails there, as a run error)."""
    from hfkv.evaluation import quiet

    monkeypatch.setattr(quiet, "load_average", lambda: 0.0)  # bench times only on a quiet machine
    assert run(["demo", "--presets", "none", "--limit", "1"], capsys)[0] == 1
    assert run(["bench", "--random-like", "cpu-small", "--out-dir", str(tmp_path)], capsys)[0] == 1
    assert loads == ["from_pretrained", "load_bench_model"]


def assert_refused(argv: list[str], option: str, value: str, loads, capsys) -> str:
    rc, lines = run(argv, capsys)
    assert rc == 2, (argv, lines)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"hfkv {argv[0]}: error: "), line
    assert option in line and value in line, (option, value, line)
    assert "Traceback" not in line
    assert loads == [], f"{loads} ran before the argument error"
    return line


# ----------------------------------------------------------------------------------------- demo
DEMO = [
    (["--budgets", "abc"], "--budgets", "'abc'"),
    (["--budgets", "80,0"], "--budgets", "'0'"),
    (["--presets", "evict,hfvk"], "--presets", "'hfvk'"),
    (["--presets", "diffkv", "--budgets", "48"], "--presets/--budgets", "diffkv@48"),
    (["--tasks", "kv_recal"], "--tasks", "'kv_recal'"),
    (["--limit", "ten"], "--limit", "'ten'"),
    (["--limit", "0"], "--limit", "'0'"),
    (["--batch-size", "-1"], "--batch-size", "'-1'"),
    (["--threads", "x"], "--threads", "'x'"),
    (["--device", "cuda:99"], "--device", "'cuda:99'"),
    (["--device", "gpu"], "--device", "'gpu'"),
    (["--model", NOWHERE], "--model", NOWHERE),
    (["--limt", "3"], "--limit", "--limt"),
]


@pytest.mark.parametrize(("argv", "option", "value"), DEMO, ids=[" ".join(a) for a, _, _ in DEMO])
def test_demo_refuses_before_loading(argv, option, value, loads, capsys):
    assert_refused(["demo", *argv], option, value, loads, capsys)


# ---------------------------------------------------------------------------------------- bench
BENCH = [
    (["--methods", "dynamic,hfvk"], "--methods", "'hfvk'"),
    (["--methods", "hfkv:bugdet=5"], "--methods", "'bugdet'"),
    (["--methods", "hfkv:quantized.kye=fp8"], "--methods", "'quantized.kye'"),
    (["--methods", "hfkv@abc"], "--methods", "'abc'"),
    (["--methods", "quanto-int3"], "--methods", "quanto-int3"),
    (["--methods", "hfkv:alpha_h=-1"], "--methods", "alpha_h=-1"),
    (["--methods", "diffkv", "--budgets", "32"], "--methods", "diffkv@32"),
    (["--methods", "missing.yaml"], "--methods", "'missing.yaml'"),
    (["--budgets", "1k"], "--budgets", "'1k'"),
    (["--contexts", "0"], "--contexts", "'0'"),
    (["--batch-sizes", "two"], "--batch-sizes", "'two'"),
    (["--decode-steps", "0"], "--decode-steps", "'0'"),
    (["--warmup", "-1"], "--warmup", "'-1'"),
    (["--random-like", "llama-9"], "--random-like", "'llama-9'"),
    (["--random-layers", "2"], "--random-layers", "--random-like"),
    (["--model", NOWHERE], "--model", NOWHERE),
    (["--dtype", "bf61"], "--dtype", "'bf61'"),
    (["--max-batch-context", "100"], "--max-batch-context", "100"),
    (["--threads", "0"], "--threads", "'0'"),
    (["--threads", "1,al"], "--threads", "'al'"),
    (["--max-load", "-1"], "--max-load", "-1"),
    (["--wait-quiet", "soon"], "--wait-quiet", "'soon'"),
    (["--methodz", "dynamic"], "--methods", "--methodz"),
]


@pytest.mark.parametrize(("argv", "option", "value"), BENCH, ids=[" ".join(a) for a, _, _ in BENCH])
def test_bench_refuses_before_loading(argv, option, value, loads, capsys, tmp_path):
    assert_refused(["bench", "--out-dir", str(tmp_path), *argv], option, value, loads, capsys)
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------- eval
EVAL = [
    (["--model_args", "pretrained=hfkv/testbed/model,hfkv_config=hfkv@80,bugdet=5"], "--model_args", "'bugdet'"),
    (["--model_args", "pretrianed=hfkv/testbed/model"], "--model_args", "'pretrianed'"),
    (["--model_args", "pretrained=testbed,hfkv_config=hfvk@80"], "--model_args", "'hfvk'"),
    (["--model_args", "pretrained=testbed,alpha_h=-1"], "--model_args", "alpha_h=-1"),
    (["--model_args", "pretrained=testbed,hfkv.bugdet=3"], "--model_args", "'bugdet'"),
    (["--model_args", "pretrained=testbed,quantized.kye=fp8"], "--model_args", "'quantized.kye'"),
    (["--model_args", "pretrained=testbed,hfkv_config=dynamic,budget=5"], "--model_args", "dynamic"),
    (["--model_args", f"pretrained={NOWHERE}"], "--model_args pretrained", NOWHERE),
    (["--model", "hfvk"], "--model", "'hfvk'"),
    (["--model_args", "pretrained"], "--model_args", "'pretrained'"),
    (["--model", "hf", "--model_args", f"pretrained={NOWHERE}"], "--model_args pretrained", NOWHERE),
]


@pytest.mark.parametrize(("argv", "option", "value"), EVAL, ids=[" ".join(a) for a, _, _ in EVAL])
def test_eval_refuses_before_loading(argv, option, value, loads, capsys):
    pytest.importorskip("lm_eval")
    assert_refused(["eval", *argv, "--tasks", "testbed", "--include_path", "eval/tasks"], option, value, loads, capsys)


def test_eval_needs_tasks_and_names_unknown_ones(loads, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    assert_refused(["eval", "--model_args", "pretrained=testbed"], "--tasks", "no task given", loads, capsys)
    from lm_eval.config.evaluate_config import EvaluatorConfig

    def not_found(self, metadata=None):  # what lm-eval raises for a name it cannot match (before any model)
        raise ValueError("Tasks not found: testbd")

    monkeypatch.setattr(EvaluatorConfig, "process_tasks", not_found)
    assert_refused(
        ["eval", "--model_args", "pretrained=testbed", "--tasks", "testbd"], "--tasks", "testbd", loads, capsys
    )


def test_hfkv_model_refuses_unknown_model_args_before_loading(loads):
    """The same check holds for simple_evaluate(model="hfkv", model_args=...), which bypasses the command line."""
    pytest.importorskip("lm_eval")
    from hfkv.evaluation.lm_eval_model import HFKVLM, check_model_args

    with pytest.raises(ValueError, match=r"unknown key 'bugdet' \(did you mean 'budget'\?\)"):
        HFKVLM(pretrained=NOWHERE, hfkv_config="hfkv@80", bugdet=5)
    assert loads == []
    # HFLM's own arguments, from_pretrained's, overrides, tier keys and hfkv.<field> all pass
    method = check_model_args(
        {
            "pretrained": "testbed",
            "hfkv_config": "hfkv@80",
            "dtype": "float32",
            "batch_size": 4,
            "attn_implementation": "eager",
            "alpha_h": 0.8,
            "quantized.key": "fp8",
            "hfkv.backend": "torch",
            "backend": "causal",
        }
    )
    assert method.config.alpha_h == 0.8 and method.config.backend == "torch"


# ------------------------------------------------------------------------------------ calibrate
CALIBRATE = [
    (["--range", "foo=0:1"], "--range", "'foo=0:1'"),
    (["--range", "alpha_h=3:1"], "--range", "alpha_h=3"),
    (["--range", "tau1=1:3"], "--range", "'tau1'"),
    (["--search", "taus"], "--search", "'taus'"),
    (["--base", "hfvk"], "--base", "'hfvk'"),
    (["--base", "full"], "--base", "full"),
    (["--compare", "hfkv", "evcit"], "--compare", "'evcit'"),
    (["--metric", "top1", "--objective", "accuracy"], "--metric", "'top1'"),
    (["--objective", "fidel"], "--objective", "'fidel'"),
    (["--n-trials", "-1"], "--n-trials", "'-1'"),
    (["--n-shots", "7"], "--n-shots", "'7'"),
    (["--subjects", "algebr"], "--subjects", "'algebr'"),
    (["--grace-period", "10", "--heartbeat-interval", "30"], "--grace-period", "10"),
    (["--max-memory-ratio", "0"], "--max-memory-ratio", "0"),
    (["--dtype", "bf61"], "--dtype", "'bf61'"),
    (["--model", NOWHERE], "--model", NOWHERE),
]


@pytest.mark.parametrize(("argv", "option", "value"), CALIBRATE, ids=[" ".join(a) for a, _, _ in CALIBRATE])
def test_calibrate_refuses_before_data_or_model(argv, option, value, loads, capsys, tmp_path):
    pytest.importorskip("optuna")
    base = ["calibrate", "--model", "testbed", "--data-file", "calibration/data/math_fixture.jsonl"]
    assert_refused([*base, "--studies-dir", str(tmp_path), *argv], option, value, loads, capsys)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------- did you mean
@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["demo", "--presets", "evict,hfvk"], "(did you mean 'hfkv'?)"),
        (["demo", "--tasks", "kv_recal"], "(did you mean 'kv_recall'?)"),
        (["demo", "--limt", "3"], "(did you mean '--limit'?)"),
        (["demoo"], "(did you mean 'demo'?)"),
        (["bench", "--methods", "dynamic,hfvk"], "(did you mean 'hfkv'?)"),
        (["bench", "--methods", "evict@512:head_adaptve=True"], "(did you mean 'head_adaptive'?)"),
        (["eval", "--model_args", "pretrained=testbed,bugdet=5", "--tasks", "testbed"], "(did you mean 'budget'?)"),
        (["eval", "--model_args", "pretrianed=testbed", "--tasks", "testbed"], "(did you mean 'pretrained'?)"),
        (["calibrate", "--model", "testbed", "--range", "alpha_hh=0:1"], "(did you mean 'alpha_h'?)"),
    ],
)
def test_near_misses_get_a_did_you_mean(argv, suggestion, loads, capsys):
    if argv[0] == "eval":
        pytest.importorskip("lm_eval")
    rc, lines = run(argv, capsys)
    assert rc == 2 and len(lines) == 1 and suggestion in lines[0], lines


# --------------------------------------------------------------------------- errors while running
def test_an_error_while_running_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    import transformers

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    rc, lines = run(["demo", "--limit", "1", "--presets", "none"], capsys)
    assert rc == 1 and lines == ["hfkv demo: disk on fire (--debug shows the traceback)"]
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["--debug", "demo", "--limit", "1", "--presets", "none"])
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["demo", "--limit", "1", "--presets", "none", "--debug"])


def test_console_shows_one_line_and_no_traceback():
    res = subprocess.run(
        [sys.executable, "-m", "hfkv.cli", "demo", "--budgets", "abc"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "hfkv demo: error: --budgets: 'abc' is not a positive integer (comma-separated budgets, e.g. 80,160)"
    ]


# ----------------------------------------------------------------------------------------- help
def _subparsers():
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_every_option_has_help_and_defaults_read_as_typed():
    parser, subs = _subparsers()
    for name, p in [("hfkv", parser), *subs.items()]:
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (name, action.option_strings)
    out = subs["bench"].format_help()
    assert "(default: dynamic,hfkv,evict,quant)" in out and "['" not in out


def test_eval_help_is_hfkvs_own(capsys):
    pytest.importorskip("lm_eval")
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hfkv eval --model hfkv --model_args pretrained=testbed,hfkv_config=hfkv@80" in out
    assert "lm-eval run --model" not in out and "--tasks" in out and "--debug" in out
