"""eval/cpu_step_sections.py refuses what it cannot honour: one file holds one thread count's sections."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_several_thread_counts_are_refused_by_name(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("cpu_step_sections", REPO / "eval" / "cpu_step_sections.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--threads", "1,2", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "--threads=1,2: one thread count per run" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
