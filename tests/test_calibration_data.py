"""Calibration data: the fixture's schema, reproducible sampling, hashes and clear errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hfkv.calibration.data import (
    SUBJECTS,
    DataUnavailableError,
    data_hash,
    load_jsonl,
    load_math_train,
    parse_subjects,
    select,
)
from tests.calibration_support import FIXTURE


def test_fixture_covers_all_subjects_and_levels():
    rows = load_jsonl(FIXTURE)
    assert 30 <= len(rows) <= 60
    assert set(Counter(r.type for r in rows)) == set(SUBJECTS.values())
    assert {r.level_number for r in rows} == {1, 2, 3, 4, 5}
    assert all(r"\boxed{" in r.solution for r in rows)
    assert len({r.problem for r in rows}) == len(rows)


def test_selection_is_reproducible_disjoint_and_filtered():
    rows = load_jsonl(FIXTURE)
    a = select(rows, 10, seed=3, holdout=5)
    b = select(rows, 10, seed=3, holdout=5)
    c = select(rows, 10, seed=4, holdout=5)
    assert a.calibration == b.calibration and a.holdout == b.holdout and a.hash == b.hash
    assert a.hash != c.hash
    assert not {p.problem for p in a.calibration} & {p.problem for p in a.holdout}
    assert len(a.calibration) == 10 and len(a.holdout) == 5
    # growing --n-problems keeps the earlier problems (a prefix of the same shuffle)
    assert select(rows, 12, seed=3, holdout=5).calibration[:10] == a.calibration
    f = select(rows, None, seed=0, levels=[1, 2], subjects=["Number Theory", "geometry"])
    assert f.calibration and all(
        p.level_number in (1, 2) and p.type in ("Number Theory", "Geometry") for p in f.calibration
    )
    assert len(f.calibration) == f.available


def test_hash_changes_with_any_field():
    rows = load_jsonl(FIXTURE)[:3]
    h = data_hash(rows)
    changed = [rows[0].__class__(rows[0].problem, rows[0].level, rows[0].type, rows[0].solution + " ")] + rows[1:]
    assert data_hash(changed) != h and data_hash(rows[::-1]) != h and data_hash(rows) == h


def test_bad_rows_name_the_problem(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"problem": "x", "level": "Level 1", "type": "Algebra"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: missing field\(s\) \['solution'\]"):
        load_jsonl(p)
    p.write_text('{"problem": "x",\n')
    with pytest.raises(ValueError, match="d.jsonl:1: not valid JSON"):
        load_jsonl(p)
    with pytest.raises(FileNotFoundError, match="--data-file"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_bad_options_are_named():
    rows = load_jsonl(FIXTURE)
    with pytest.raises(ValueError, match="--subjects: 'calculus'"):
        parse_subjects(["calculus"])
    with pytest.raises(ValueError, match="--levels"):
        select(rows, 3, 0, levels=[6])
    with pytest.raises(ValueError, match="--holdout 40 \\+ --n-problems 20 need 60"):
        select(rows, 20, 0, holdout=40)


def test_math_offline_error_names_data_file(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(DataUnavailableError, match="--data-file"):
        load_math_train(["algebra"])
