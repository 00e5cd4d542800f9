"""What the calibration report says (issue 60): the held-out rows and lines follow the verdict, "cannot reach"
never contradicts the printed lowest memory, a trial with alpha_h off prints alpha_h=inf, and an --n-trials
that searches nothing is refused before anything is created. Fake objectives: no model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

import pytest

from hfkv.calibration import compare as cp
from hfkv.calibration import worker
from hfkv.calibration.cli import check_args
from hfkv.calibration.objectives import Evaluation
from hfkv.calibration.search import format_params
from hfkv.cli import build_parser, main
from hfkv.cli_args import UsageError
from hfkv.config import TriStateConfig
from tests.calibration_support import FakeObjective, cli_args


def _argv(tmp: Path, name: str, *extra) -> list[str]:
    return cli_args("testbed", tmp, "--study-name", name, *extra)  # the model is never loaded: the objective is fake


def _run(argv: list[str], fake: FakeObjective) -> int:
    with (
        mock.patch.object(worker, "make_objective", lambda *a, **k: fake),
        mock.patch.object(worker, "load", lambda *a, **k: (None, None)),
    ):
        return main(argv)


def test_a_base_verdict_is_labelled_as_the_base_in_the_held_out_comparison(tmp_path, capsys):
    # The base (hfkv) exact: no trial can beat it, the verdict is base, and the held-out rows must say so.
    fake = FakeObjective(3, base=TriStateConfig.from_preset("hfkv"), base_factor=0.0, length=400)
    argv = _argv(tmp_path, "b", "--search", "budget", "--range", "budget=24:400", "--n-trials", 5, "--tolerance", 0,
                 "--holdout", 1, "--compare", "hfkv", "quant", "--match-steps", 3,
                 "--holdout-levels", "0.3,0.6")  # fmt: skip
    assert _run(argv, fake) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "verdict: base: " in out
    held = out[out.index("held-out problems") :]
    assert "calibrated" not in held, held  # neither a row's kind nor a comparison line calls the base calibrated
    result = json.loads((tmp_path / "studies" / "b" / "holdout.json").read_text())
    selected = [r for r in result["rows"] if r["config"] == "b"]
    assert [r["kind"] for r in selected] == ["base (selected)"]
    assert re.search(r"^b +base \(selected\) ", held, re.M), held  # the printed row
    for preset in ("hfkv", "quant"):
        line = result["verdicts"][preset]
        # what was compared with what: the selected base and the preset, each at its budget and memory
        assert line.startswith("selected b@") and "(the base; kl " in line or "no budget tried" in line, line
    for lv in result["levels"]:
        assert all(r["kind"] != "calibrated" for r in lv["rows"])
        for name, line in lv["verdicts"].items():
            assert "calibrated" not in line, (name, line)
            if name == "hfkv":  # the base preset at the selected budget is the selected config itself
                assert "is the selected config itself (the base)" in line, line
    # trials with alpha_h off print it as off, not as the sampled placeholder
    trial_lines = [ln for ln in captured.err.splitlines() if ln.startswith("trial ")]
    assert len(trial_lines) == 5
    assert all("alpha_h_off" not in ln for ln in trial_lines), trial_lines
    assert all("alpha_h=inf" in ln for ln in trial_lines[:4]), trial_lines  # the four base points
    pareto = out[out.index("Pareto front") : out.index("verdict:")]
    assert "alpha_h_off" not in pareto


def test_a_calibrated_verdict_keeps_the_calibrated_label():
    fake = FakeObjective(4, length=400)
    selected = TriStateConfig.from_preset("hfkv", alpha_h=2.0, alpha_l=0.01, budget=150).to_dict()
    cfg = TriStateConfig.from_dict({**selected, "name": "mine", "provenance": {}})
    result = cp.compare(fake.evaluate, cfg, "kl", ["hfkv"], 400, 6, cp.selected_kind("calibrated"))
    assert [r["kind"] for r in result["rows"] if r["config"] == "mine"] == ["calibrated"]
    line = result["verdicts"]["hfkv"]
    assert line.startswith("selected mine@150 (calibrated; kl ") and " vs hfkv@" in line, line


def test_format_params_prints_an_unused_alpha_h_as_inf():
    assert format_params({"alpha_h": 5.0, "alpha_h_off": True, "alpha_l": 0.0, "budget": 32}) == (
        "alpha_h=inf alpha_l=0 budget=32"
    )
    assert format_params({"alpha_h": 2.74, "alpha_h_off": False, "alpha_l": 0.072}) == "alpha_h=2.74 alpha_l=0.072"


DENSE = 10**9


def _flat_below(floor: float, knee: int = 118):
    """An evaluation whose memory is ``floor`` up to budget ``knee`` and grows 0.001 a token above it: the
    lowest memory any budget reaches is ``floor``. The selected config (alpha_l 0.01) holds 0.61819."""

    def evaluate(cfg: TriStateConfig) -> Evaluation:
        if not cfg.compress:
            return Evaluation({"kl": 0.0, "top1": 1.0}, DENSE, DENSE, 1)
        if cfg.alpha_l == 0.01:
            return Evaluation({"kl": 0.01, "top1": 0.97}, round(0.61819 * DENSE), DENSE, 1)
        memory = floor + 0.001 * max(0, cfg.budget - knee)
        return Evaluation({"kl": 0.02, "top1": 0.95}, round(memory * DENSE), DENSE, 1)

    return evaluate


def test_a_memory_equal_at_the_printed_precision_is_reached():
    # 0.61823 prints as 0.6182, the selected config's 0.61819 too: "cannot reach 0.6182 (lowest: 0.6182)" was the
    # contradiction; at the printed precision the budget reaches it and is matched.
    selected = TriStateConfig.from_preset("hfkv", alpha_l=0.01, budget=118)
    result = cp.compare(_flat_below(0.61823), selected, "kl", ["hfkv"], 200, 10, cp.selected_kind("base"))
    matched = [r for r in result["rows"] if r["kind"] == "matched"]
    assert len(matched) == 1 and matched[0]["memory_ratio"] == pytest.approx(0.61823), result["verdicts"]
    assert "no budget tried" not in result["verdicts"]["hfkv"]


def test_a_memory_out_of_reach_shows_a_lowest_above_the_target():
    selected = TriStateConfig.from_preset("hfkv", alpha_l=0.01, budget=118)
    result = cp.compare(_flat_below(0.61826), selected, "kl", ["hfkv"], 200, 10, cp.selected_kind("base"))
    line = result["verdicts"]["hfkv"]
    assert line.startswith("no budget tried reaches the selected config's memory 0.6182 (lowest: 0.6183 at"), line
    for level in cp.compare_levels(_flat_below(0.61826), selected, "kl", ["hfkv"], [0.5, 0.6182], 400, 10):
        for missing in level["missing"].values():  # the printed lowest is always above the printed level
            lowest, target = f"{missing['lowest_memory']:.4f}", f"{level['level']:.4f}"
            assert lowest > target and f"(lowest: {lowest} at budget" in missing["message"]


@pytest.mark.parametrize(
    ("extra", "minimum"),
    [
        (("--search", "budget", "--n-trials", 3), 5),  # four base points (--base-points 4)
        (("--search", "budget", "--base-points", 2, "--n-trials", 2), 3),
        (("--n-trials", 1), 2),  # the base once, at its own budget
    ],
)
def test_n_trials_that_only_run_base_points_are_refused(tmp_path, extra, minimum):
    args = build_parser().parse_args(_argv(tmp_path, "n", *extra))
    with pytest.raises(UsageError) as exc:
        check_args(args)
    assert exc.value.option == "--n-trials"
    n = extra[-1]
    assert exc.value.message.startswith(f"{n} searches nothing") and f"at least {minimum}" in exc.value.message
    check_args(build_parser().parse_args(_argv(tmp_path, "n", *extra[:-1], minimum)))  # the minimum searches
    check_args(build_parser().parse_args(_argv(tmp_path, "n", "--no-warm-start", "--n-trials", 1)))
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_n_trials_zero_is_refused_before_a_study_exists(tmp_path, capsys):
    assert main(_argv(tmp_path, "z", "--n-trials", 0)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hfkv calibrate: error: --n-trials: '0' must be a positive"), err
    assert not list(tmp_path.iterdir())  # no storage, no study
