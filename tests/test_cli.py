"""The console script: `hfkv --help` and subcommand discovery work without optional extras and import no
subcommand's module; `hfkv demo` marks its speed column when the machine was not quiet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hfkv.cli import SUBCOMMANDS, build_parser, main, requested_command


def test_help_lists_subcommands(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: hfkv" in capsys.readouterr().out


def test_module_entry_point_runs():
    res = subprocess.run([sys.executable, "-m", "hfkv.cli", "--version"], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "hfkv" in res.stdout


def test_demo_parser_has_documented_options():
    args = build_parser().parse_args(["demo", "--presets", "none", "--limit", "1"])
    assert args.command == "demo" and args.limit == 1


# ----------------------------------------------------------------------------- what building the parser imports
HEAVY = ("torch", "transformers", "lm_eval", "optuna")


def _modules_after(argv: list[str]) -> set[str]:
    """The modules a fresh interpreter holds after ``hfkv <argv>`` (``--help`` / ``--version`` exit)."""
    code = (
        "import sys\nfrom hfkv.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert "MODULES " in res.stderr, res.stderr
    return set(res.stderr.rsplit("MODULES ", 1)[1].split())


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_top_level_help_and_version_import_no_subcommand(argv):
    """`hfkv --help` took 20-29 s on a busy machine: every subcommand's module was imported to build the parser."""
    loaded = _modules_after(argv)
    assert not loaded & {*HEAVY, *(module for module, _ in SUBCOMMANDS.values())}


@pytest.mark.parametrize("command", ["demo", "bench", "eval", "calibrate"])
def test_subcommand_help_imports_only_its_own_module(command):
    loaded = _modules_after([command, "--help"])
    assert SUBCOMMANDS[command][0] in loaded
    others = {module for name, (module, _) in SUBCOMMANDS.items() if name != command}
    assert not loaded & others
    if command in ("demo", "bench"):
        assert not loaded & {"lm_eval", "optuna"}
    if command == "calibrate":  # the parser checks --range and --subjects with torch-free modules
        assert not loaded & {"torch", "transformers", "lm_eval", "optuna"}
    if command == "eval":  # lm-eval's argument definitions only: the evaluator, models and torch load in run()
        assert "lm_eval._cli.run" in loaded and not loaded & {"torch", "transformers", "lm_eval.evaluator", "optuna"}


def test_the_command_is_found_before_parsing():
    assert requested_command(["--debug", "bench", "--contexts", "512"]) == "bench"
    assert requested_command(["eval", "--tasks", "demo"]) == "eval"
    assert requested_command(["--help", "demo"]) is None  # --help comes first: the top-level help
    assert requested_command(["bnech"]) is None and requested_command([]) is None


def test_a_mistyped_command_is_answered_without_torch():
    code = (
        "import sys\nfrom hfkv.cli import main\nrc = main(['bnech'])\n"
        "sys.stderr.write('\\nRC %d TORCH %s' % (rc, 'torch' in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert "(did you mean 'bench'?)" in res.stderr and res.stderr.rstrip().endswith("RC 2 TORCH False")


def test_did_you_mean_has_one_definition_for_config_and_cli():
    """cli_args once kept a copy of config's did_you_mean (config imports torch): two rules that could drift."""
    from hfkv import cli_args, config, presets, suggest

    assert cli_args.did_you_mean is suggest.did_you_mean and config.did_you_mean is suggest.did_you_mean
    assert suggest.did_you_mean("hfvk", presets.PRESETS) == " (did you mean 'hfkv'?)"
    assert suggest.did_you_mean("bugdet", ["budget", "window"]) == " (did you mean 'budget'?)"
    assert suggest.did_you_mean("zzz", ["a", "b"]) == ""
    assert suggest.did_you_mean(3, [1, 3]) == " (did you mean '3'?)"  # non-strings compared as text
    assert cli_args.PRESETS == presets.PRESETS


def test_lazy_public_names_are_the_modules_own():
    import hfkv
    import hfkv.cache
    import hfkv.presets
    import hfkv.stats

    assert hfkv.TriStateCache is hfkv.cache.TriStateCache and hfkv.PRESETS is hfkv.presets.PRESETS
    assert hfkv.CacheStats is hfkv.stats.CacheStats and callable(hfkv.enable) and callable(hfkv.is_enabled)
    assert set(hfkv.__all__) <= set(dir(hfkv))
    with pytest.raises(AttributeError):
        hfkv.no_such_name  # noqa: B018


def test_calibration_package_imports_its_public_names_on_first_use():
    code = "import sys, hfkv.calibration\nprint(sorted(m for m in ('torch', 'optuna') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.stdout.strip() == "[]", res.stderr
    import hfkv.calibration as calibration
    import hfkv.calibration.data
    import hfkv.calibration.search

    assert calibration.SearchSpace is hfkv.calibration.search.SearchSpace
    assert calibration.load_problems is hfkv.calibration.data.load_problems
    assert set(calibration.__all__) <= set(dir(calibration))
    with pytest.raises(AttributeError):
        calibration.no_such_name  # noqa: B018


# ----------------------------------------------------------------------------- demo: the speed column's quiet rule
class _Loads:
    """A fake 1-minute load average and clock: ``readings`` in turn (the last one repeats), ``step_s`` apart."""

    def __init__(self, readings, step_s: float = 60.0):
        self.readings, self.step_s, self.now = list(readings), step_s, 0.0

    def load(self):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    def clock(self) -> float:
        self.now += self.step_s
        return self.now


def _watch(monkeypatch, readings, threads: int = 2, step_s: float = 60.0):
    from hfkv.evaluation import quiet
    from hfkv.evaluation.demo import LoadWatch

    fake = _Loads(readings, step_s)
    monkeypatch.setattr(quiet, "load_average", fake.load)
    return LoadWatch(threads, clock=fake.clock)


def test_demo_speed_comparable_when_only_its_own_threads_ran(monkeypatch):
    # two threads for a minute lift 0.1 to at most 0.1/e + 2 (1 - 1/e) = 1.30; 1.5 is within the 0.5 margin
    watch = _watch(monkeypatch, [0.1, 1.5, 1.7])
    watch.sample()
    watch.sample()
    assert watch.note() is None
    rec = watch.record()
    assert rec["speed_comparable"] and rec["load_average_before"] == 0.1 and rec["load_average_after"] == 1.7


@pytest.mark.parametrize(
    ("readings", "reason"),
    [
        ([1.83, 1.9], "load average was 1.83 before the run, not below 0.5: other processes shared the cores"),
        ([0.1, 3.5], "the load reached 3.50 during the run, 2.20 above what its 2 torch thread(s) explain"),
        ([0.1, 1.2, 3.5, 1.0], "the load reached 3.50 during the run"),  # a burst in the middle counts
        ([None], "no load average on this platform"),
    ],
)
def test_demo_speed_not_comparable_says_why(monkeypatch, readings, reason):
    watch = _watch(monkeypatch, readings)
    for _ in range(3):
        watch.sample()
    assert reason in watch.note()
    assert watch.record()["speed_comparable"] is False


def test_demo_table_marks_the_speed_column():
    from hfkv.evaluation.demo import format_table

    rows = [{"task": "kv_recall", "cache": "hfkv@80", "n": 2, "accuracy": 1.0, "compression": 7.2, "kv_kib": 175.5}]
    rows[0]["decode_tok_s"] = 9477.0
    plain = format_table(rows).splitlines()
    marked = format_table(rows, speed_note="the load reached 3.50 during the run").splitlines()
    assert plain[0].endswith(" decode tok/s") and "*" not in "".join(plain)
    assert marked[0].endswith("decode tok/s*") and len(marked[0]) == len(plain[0]) and marked[2] == plain[2]
    assert marked[-1] == (
        "* decode tok/s not comparable between rows: the load reached 3.50 during the run (run it alone on the machine)"
    )


def test_demo_run_on_a_busy_machine_marks_speed_and_records_it(monkeypatch, tmp_path, capsys):
    from hfkv.evaluation import quiet

    monkeypatch.setattr(quiet, "load_average", lambda: 1.83)
    out = tmp_path / "demo.json"
    argv = ["demo", "--tasks", "kv_recall", "--limit", "2", "--batch-size", "2", "--presets", "none"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode tok/s*" in printed and "* decode tok/s not comparable between rows: the 1-minute load" in printed
    run = json.loads(out.read_text())["run"]
    assert run["speed_comparable"] is False and "1.83 before the run" in run["speed_note"]
    assert run["load_average_before"] == 1.83 and run["max_load"] == 0.5
