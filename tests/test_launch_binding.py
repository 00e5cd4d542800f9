"""eval/launch_binding.py: every Triton launch of a policy interval recorded with its step's kind, and Triton's binding
of each timed with the suite's own Triton (the committed figures use the GPU machine's, 3.6, from .aot-triton)."""

from __future__ import annotations

import pytest

DECODE = {"_partial_kernel", "_score_kernel", "_combine_kernel"}


def _module():
    from eval import launch_binding  # here: importing it sets TRITON_INTERPRET

    return launch_binding


@pytest.mark.slow
def test_launches_are_recorded_by_step_and_their_binding_timed(tmp_path):
    mod = _module()
    path = tmp_path / "launches.pt"
    mod.record(path, context=512, batch=1, budget=64)
    res = mod.time_binding(path, repeats=3)
    by_phase: dict[str, dict[str, dict]] = {}
    for k in res["kernels"]:
        by_phase.setdefault(k["phase"], {})[k["kernel"]] = k
        assert k["us_per_launch"] > 0 and k["arguments"] > 0
    # a plain step launches the decode kernels once each; the policy step those and the run's own kernels
    assert set(by_phase["step"]) == DECODE and res["launches_per_layer_step"] == 3
    run = {name: k for name, k in by_phase["policy_step"].items() if name not in DECODE}
    assert DECODE <= set(by_phase["policy_step"]) and {"_candidates_kernel", "_plan_kernel"} <= set(run)
    assert res["launches_per_policy_run"] == sum(k["launches"] for k in run.values())
    assert res["us_per_policy_run"] == pytest.approx(sum(k["us_per_launch"] * k["launches"] for k in run.values()))
    steps = sum(k["launches"] for k in by_phase["step"].values()) / 3  # plain steps recorded: interval - 1
    assert res["us_per_layer_step"] == pytest.approx(
        sum(k["us_per_launch"] * k["launches"] for k in by_phase["step"].values()) / steps
    )
    # the same plain steps through hfkv's bound sites: each kernel bound once, then its calls checked, not rebound
    bound = {k["kernel"]: k for k in res["bound"]["kernels"]}
    assert set(bound) == DECODE
    for name, k in bound.items():
        assert k["launches"] == by_phase["step"][name]["launches"] and k["us_per_launch"] > 0
        assert 0 < k["same_objects"] <= k["arguments"] < by_phase["step"][name]["arguments"]  # positional ones
    # the query and the new key and value, and the output, are new tensors at every step
    assert bound["_partial_kernel"]["same_objects"] <= bound["_partial_kernel"]["arguments"] - 3
    assert bound["_combine_kernel"]["same_objects"] < bound["_combine_kernel"]["arguments"]
    assert res["bound"]["us_per_layer_step"] == pytest.approx(
        sum(k["us_per_launch"] * k["launches"] for k in bound.values()) / steps
    )


def test_a_missing_triton_is_named(tmp_path, capsys):
    mod = _module()
    assert mod.main(["--triton-path", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "--triton-path" in capsys.readouterr().err
