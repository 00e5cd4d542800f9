"""eval/encode_bench.py's dry run: the encode launch-shape sweep a GPU lease runs must not rot between leases."""

from __future__ import annotations

import json


def test_encode_bench_dry_run_times_every_shape_of_every_tier_format(tmp_path):
    from eval import encode_bench as mod

    assert mod.main(["--out", str(tmp_path), "--dry-run", "--rows", "1,4", "--warps", "1,4", "--tokens", "20"]) == 0
    out = json.loads((tmp_path / "encode_bench.json").read_text())
    assert [(f["key"], f["value"]) for f in out["formats"]] == list(mod.FORMATS)
    for f in out["formats"]:
        assert [(s["rows"], s["warps"]) for s in f["shapes"]] == [(1, 1), (1, 4), (4, 1), (4, 4)]
        assert all(s["ms"] > 0 for s in f["shapes"]) and f["fastest"] in f["shapes"]
        assert f["speedup_over_default"] >= 1.0  # the default launch is among the shapes
    assert mod.main(["--out", str(tmp_path), "--rows", "1"]) == 2  # no CUDA here: refused, named
