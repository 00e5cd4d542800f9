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


def _module():
    spec = importlib.util.spec_from_file_location("cpu_step_sections", REPO / "eval" / "cpu_step_sections.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sections_land_where_each_cache_spends_them_and_give_the_models_floor(tmp_path):
    """DynamicCache's step is split into its attention, its concatenation and the model's own work (the floor no
    cache goes below); hfkv's attention is its kernel, never SDPA."""
    import json

    out = tmp_path / "s.json"
    mod = _module()
    assert mod.main(["--specs", "dynamic", "hfkv@1024", "--context", "96", "--steps", "8", "--threads", "1",
                     "--force-busy", "--out", str(out)]) == 0  # fmt: skip
    got = json.loads(out.read_text())
    dyn, hf = got["ms_per_step"]["dynamic"], got["ms_per_step"]["hfkv@1024"]
    assert dyn["sdpa"] > 0 and dyn["dynamic_update"] > 0 and dyn["paged_attention_cpu"] == 0
    assert hf["paged_attention_cpu"] > 0 and hf["sdpa"] == 0 and hf["dynamic_update"] == 0
    assert got["model_floor_ms"] == pytest.approx(dyn["step"] - dyn["sdpa"] - dyn["dynamic_update"])
    assert got["free_attention_bound"] == pytest.approx(dyn["step"] / got["model_floor_ms"])
    assert got["free_attention_bound"] > 1
    assert got["model"] == "cpu-small" and got["dtype"] == "fp32"
    assert len(got["source_digest"]) == 16 and "git_commit" in got  # which code the figures measured


def test_no_bound_without_a_dynamic_row():
    assert _module().free_attention_bound({"hfkv@1024": {"step": 10.0}}) == {}
