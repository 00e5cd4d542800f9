"""eval/archive/interleave_probe.py's dry run: the probe that showed the in-turns baseline's slowdown still runs on a
CPU."""

from __future__ import annotations

import json


def test_interleave_probe_dry_run_times_each_section_as_designed(tmp_path):
    from eval.archive import interleave_probe as mod

    argv = ["--out", str(tmp_path), "--dry-run", "--context", "96", "--steps", "4", "--block", "2", "--sdpa", "math"]
    assert mod.main(argv) == 0
    out = json.loads((tmp_path / "interleave_probe.json").read_text())
    assert out["sdpa"] == "math" and out["context"] == 96
    for section in ("alone", "turns", "turns_gc_off", "blocks", "alone_again"):
        caches = out[section]
        assert set(caches) == {"dynamic", "hfkv@1024"}, section
        for c in caches.values():
            assert c["steps"] == 4 and len(c["ms"]) == 4 and min(c["ms"]) > 0
            assert c["ms_median"] <= max(c["ms"]) and "num_device_alloc_per_step" in c
