"""eval/policy_profile.py's dry run: the profile a GPU lease relies on must not rot between leases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_policy_profile_dry_run_labels_the_policy_sections(tmp_path):
    spec = importlib.util.spec_from_file_location("policy_profile", REPO / "eval" / "policy_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path), "--dry-run"]) == 0
    out = json.loads((tmp_path / "policy_profile.json").read_text())
    # the timed steps include policy runs and plain steps, each marked
    assert any(s["policy"] for s in out["steps"]) and any(not s["policy"] for s in out["steps"])
    assert len(out["run_policy_ms_per_layer"]) == out["layers"] and min(out["run_policy_ms_per_layer"]) > 0
    # the profiled step ran the policy once per layer, inside which the sections nest
    sections = out["sections"]
    assert sections["run_policy"]["calls"] == out["layers"]
    assert {"candidates", "classify", "apply"} <= set(sections)
    assert sections["classify"]["host_ms_per_policy_run"] <= sections["run_policy"]["host_ms_per_policy_run"]
    # the labels are taken off again
    from hfkv.cache import TriStateLayer

    assert TriStateLayer.run_policy.__qualname__ == "TriStateLayer.run_policy"
