"""The stand-in demo runs every preset through generate and reports what the cache holds."""

from __future__ import annotations

from hfkv.random_demo import run_random_demo


def test_random_demo_prints_a_row_per_preset(capsys):
    presets = ["evict", "quant", "streaming", "arkv", "diffkv", "hfkv"]
    assert run_random_demo(presets, budget=64, prompt_len=96, new_tokens=4) == 0
    out = capsys.readouterr().out
    table = out.split("-" * 20, 1)[1]  # rows follow the header rule
    rows = [line.split()[0] for line in table.splitlines() if len(line.split()) == 8]
    assert rows == ["dynamic", *presets]
    assert "random-weight" in out
