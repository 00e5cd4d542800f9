"""Held-out evidence at several memory levels: the option's validation, and the matching of every method
to each level by budget (fake objective: no model; the tiny model runs it in test_calibration_cli.py)."""

from __future__ import annotations

import dataclasses

import pytest

from hfkv.calibration import compare as cp
from hfkv.cli import main
from hfkv.config import TriStateConfig
from tests.calibration_support import FIXTURE, FakeObjective


def test_levels_parse_sorted_and_distinct():
    assert cp.parse_levels("0.30,0.15") == [0.15, 0.3]
    assert cp.parse_levels("0.1 0.2,0.5") == [0.1, 0.2, 0.5]
    assert cp.parse_levels("none") == []
    bad_levels = [
        ("0.15", "1 distinct level"),
        ("0.2,0.2", "1 distinct level"),
        ("0.15,1.5", "1.5 is not"),
        ("0,0.3", "0 is not"),
        ("0.15,abc", "'abc' is not a number"),
        ("0.1,nan", "nan is not"),
    ]
    for bad, what in bad_levels:
        with pytest.raises(ValueError, match=what) as exc:
            cp.parse_levels(bad)
        assert str(exc.value).startswith(f"--holdout-levels={bad!r}") and "(0, 1]" in str(exc.value)


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        (["--holdout", "2", "--holdout-levels", "0.15,1.5"], "1.5"),
        (["--holdout", "2", "--holdout-levels", "0.3"], "0.3"),
        (["--holdout-levels", "0.15,0.3"], "0.15,0.3"),  # without held-out problems to measure on
    ],
)
def test_bad_levels_are_refused_in_one_line_before_anything_runs(argv, value, capsys, tmp_path):
    rc = main(["calibrate", "--model", "testbed", "--data-file", str(FIXTURE), "--studies-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("hfkv calibrate: error: --holdout-levels: ") and value in err[0]
    assert "allowed" in err[0]
    assert not list(tmp_path.iterdir())  # no storage, no data written


def test_every_method_is_matched_to_each_level_by_budget():
    fake = FakeObjective(5, length=400)
    selected = dataclasses.replace(
        TriStateConfig.from_preset("hfkv", alpha_h=2.0, alpha_l=0.01, budget=300), name="mine"
    )
    levels = cp.compare_levels(fake.evaluate, selected, "kl", ["hfkv", "diffkv", "quant"], [0.15, 0.3], 400, steps=8)
    assert [lv["level"] for lv in levels] == [0.15, 0.3]
    for lv in levels:
        rows = {r["config"]: r for r in lv["rows"]}
        assert rows["full"]["memory_ratio"] == 1.0
        for name in ("mine", "hfkv", "diffkv", "quant"):
            if name in rows:  # matched: at most the level, and close to it (budget steps are ~0.003 here)
                assert lv["level"] - 0.02 <= rows[name]["memory_ratio"] <= lv["level"], (name, lv)
                again = fake.evaluate(
                    TriStateConfig.from_preset(name, budget=rows[name]["budget"])
                    if name != "mine"
                    else dataclasses.replace(selected, budget=rows[name]["budget"])
                )
                assert again.memory_ratio == rows[name]["memory_ratio"]  # the row is that budget's measurement
            else:  # not reachable: said so, with the lowest memory found above the level
                assert lv["missing"][name]["lowest_memory"] > lv["level"]
        assert {"mine", "hfkv"} <= set(rows)  # fp-token budgets reach both levels
        assert set(lv["verdicts"]) == set(rows) - {"full", "mine"}
    table = cp.level_tables(levels)
    assert table.count("memory level") == 2 and "0.15" in table and "0.30" in table
    assert all(h in table for h in ("method", "budget", "kl", "top1", "memory"))


def test_budgets_the_model_refuses_count_as_too_small():
    """A budget the config accepts may be too small for the model's records: bisect above it, do not fail."""
    fake = FakeObjective(6, length=400)
    refused: list[int] = []

    def evaluate(cfg):
        if cfg.budget is not None and cfg.budget < 60:
            refused.append(cfg.budget)
            raise ValueError(f"TriStateConfig.budget={cfg.budget} (fp_tokens per KV head) leaves 0 bytes ...")
        return fake.evaluate(cfg)

    points, chosen = cp.match_budget(evaluate, "hfkv", 0.3, start=40, steps=8)
    assert refused and chosen is not None and chosen["budget"] >= 60 and chosen["memory_ratio"] <= 0.3
    assert all(p["budget"] >= 60 for p in points)

    def broken(cfg):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):  # any other error is not swallowed
        cp.match_budget(broken, "hfkv", 0.3, start=40, steps=8)


def test_memoized_evaluations_survive_an_interruption(tmp_path):
    """Each held-out evaluation is kept on disk as it finishes: a second run with the same context asks for
    none again, a different context (other problems, model, objective) for all, and a line cut short by
    the interruption is skipped while later ones still append."""
    from hfkv.calibration.objectives import Evaluation

    calls: list[int] = []

    def evaluate(cfg: TriStateConfig) -> Evaluation:
        calls.append(cfg.budget)
        return Evaluation({"kl": 1.0 / cfg.budget, "top1": 0.5}, 10 * cfg.budget, 10_000, 6)

    path = tmp_path / "evals.jsonl"
    configs = [TriStateConfig.from_preset("hfkv", budget=b) for b in (32, 64, 128)]
    ctx = {"holdout_sha256": "abc", "spec": {"model": "tiny"}}
    first = cp.memoized(evaluate, path, ctx)
    got = [first(c) for c in configs[:2]] + [first(configs[0])]
    assert calls == [32, 64]
    again = cp.memoized(evaluate, path, ctx)
    assert [again(c).to_dict() for c in configs[:2]] == [g.to_dict() for g in got[:2]] and calls == [32, 64]
    with path.open("a") as fh:  # an interruption in the middle of writing a line
        fh.write('{"context": "cut sh')
    resumed = cp.memoized(evaluate, path, ctx)
    resumed(configs[0]), resumed(configs[2])
    assert calls == [32, 64, 128]
    assert cp.memoized(evaluate, path, ctx)(configs[2]).quality == {"kl": 1.0 / 128, "top1": 0.5}
    assert calls == [32, 64, 128]  # the line after the cut one was written whole
    other = cp.memoized(evaluate, path, {"holdout_sha256": "def", "spec": {"model": "tiny"}})
    other(configs[0])
    assert calls == [32, 64, 128, 32]
