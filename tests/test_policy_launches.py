"""eval/policy_launches.py at a toy size: a policy run's launches and host reads are counted by section, the
decode step's own work is not, and the Triton backend's moves are planned on the device (no sort, no nonzero)."""

from __future__ import annotations

import pytest

from hfkv.kernels.environment import interpreter_on


@pytest.mark.skipif(not interpreter_on(), reason="Triton launches are counted in the interpreter (CPU)")
def test_policy_run_launches_are_counted_by_section(tmp_path):
    from eval import policy_launches as pl  # here: importing it sets TRITON_INTERPRET

    out = tmp_path / "pl.json"
    assert pl.main(["--context", "96", "--batch", "2", "--runs", "1", "--method", "hfkv@32:backend=triton",
                    "--out", str(out)]) == 0  # fmt: skip
    r = __import__("json").loads(out.read_text())
    sec = r["sections"]
    assert r["moves_planned_on_device"] and r["runs_counted"] == 1 and r["tier_count_changes_per_run"][0] > 0
    # the run's parts, each launching what it should; the step's attention and the model are not counted
    assert sec["candidates"]["triton_kernels"] == {"_candidates_kernel": 1.0} and sec["candidates"]["torch"] == 0
    # the moves planned: counted and paged after the step before's attention (a run ahead), placed at the run's step
    assert {"_changes_kernel", "_pages_kernel"} <= set(sec["run_ahead"]["triton_kernels"])
    assert "_plan_kernel" in sec["run_policy"]["triton_kernels"] and sec["run_policy"]["host_reads"] == 1
    assert sec["run_ahead"]["host_reads"] == 0 and r["host_reads_per_run"] == 1  # the run's one read, a step late
    assert "attend" not in sec and "model" not in sec
    assert not any(k in s["triton_kernels"] for s in sec.values() for k in pl.DECODE_KERNELS)
    # planned moves: no nonzero or sort outside the allocation, and the run's reads add up
    for name, s in sec.items():
        assert "nonzero" not in s["reads"] and "nonzero_numpy" not in s["reads"], name
        if name != "classify":
            assert "sort" not in s["torch_ops"], name
    assert r["host_reads_per_run"] == sum(s["host_reads"] for s in sec.values()) >= 1
    assert r["launches_per_run"] == r["torch_launches_per_run"] + r["triton_launches_per_run"]
