"""The figure scripts under eval/ run end to end at toy sizes and write what the notes quote."""

from __future__ import annotations

import json
import runpy
import sys

import pytest


def test_cpu_cache_figures_writes_ratios(tmp_path, monkeypatch):
    out = tmp_path / "figures.json"
    argv = [
        "cpu_cache_figures.py",
        *("--prompt", "80", "--new-tokens", "4", "--budget", "64", "--long-context", "160"),
        *("--short-context", "40", "--steps", "3", "--timed", "hfkv,evict", "--out", str(out)),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path("eval/cpu_cache_figures.py", run_name="__main__")
    result = json.loads(out.read_text())
    rows = {r["cache"]: r for r in result["memory"]}
    assert rows["dynamic"]["compression_ratio"] == 1.0
    for name in ("evict", "quant", "hfkv"):
        assert rows[name]["kv_bytes"] > 0
        assert rows[name]["compression_ratio"] == pytest.approx(rows[name]["dense_bytes"] / rows[name]["kv_bytes"])
    assert rows["quant"]["compression_ratio"] > 1.0  # everything outside the window is K4V2
    for label, ctx in (("long", 160), ("short", 40)):
        entry = result[f"decode_{label}"]
        assert entry["context"] == ctx
        for name in ("hfkv", "evict"):
            t = entry[name]
            assert t["speedup_median"] == pytest.approx(entry["dynamic_ms_median"] / t["ms_median"])
