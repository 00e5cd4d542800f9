"""eval/policy_profile.py's dry run: the profile a GPU lease relies on must not rot between leases."""

from __future__ import annotations

import json


def _policy_profile():
    from eval import policy_profile

    return policy_profile


def test_policy_profile_dry_run_labels_the_policy_sections(tmp_path):
    mod = _policy_profile()
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
    from hfkv.layer.policy_runner import PolicyRunner
    from hfkv.storage.moves import Moves

    assert PolicyRunner.run.__qualname__ == "PolicyRunner.run" and Moves.apply.__qualname__ == "Moves.apply"


def test_section_kernels_follow_their_launch_not_the_device_clock():
    """A section's device time is the kernels launched inside it (itself and its CPU descendants, nested sections
    counted in each), by name; a kernel whose device run falls inside another section's host range stays with the
    section that launched it."""
    from types import SimpleNamespace as NS

    mod = _policy_profile()

    def ev(name, start, end, kernels=(), children=()):
        return NS(name=name, time_range=NS(start=start, end=end), kernels=[NS(name=k, duration=d) for k, d in kernels],
                  cpu_children=list(children))  # fmt: skip

    sort = ev("aten::sort", 12, 13, [("radix", 30.0)])
    append = ev("hfkv::append_tokens", 20, 90, [("encode", 50.0)])
    apply = ev("hfkv::apply", 15, 95, [("plan", 10.0)], [append])
    classify = ev("hfkv::classify", 10, 14, [("scan", 40.0), ("scan", 20.0)], [sort])
    # the device runs classify's kernels while the host waits in append_tokens: their own events lie there
    device_side = ev("scan", 30, 70, [])
    table = mod.section_table([classify, sort, apply, append, device_side], policy_runs=2)
    assert table["classify"]["kernels_ms_per_policy_run"] == {"scan": 0.03, "radix": 0.015}
    assert table["classify"]["device_ms_per_policy_run"] == 0.045
    assert table["append_tokens"]["kernels_ms_per_policy_run"] == {"encode": 0.025}
    assert table["apply"]["device_ms_per_policy_run"] == 0.03  # its own 10 us and append_tokens' 50, per run


def test_timed_launches_time_each_kernel_by_name_and_put_the_launch_back():
    """Every launch through the timed class is counted under its kernel's name, a failing launch too, and the class's
    own ``run`` is back afterwards (a stand-in for Triton's JITFunction, whose launches need a GPU)."""
    from types import SimpleNamespace as NS

    mod = _policy_profile()

    class Kernel:
        def __init__(self, name):
            self.fn = NS(__name__=name)

        def run(self, *args, grid=None, **kwargs):
            if args and args[0] == "bad":
                raise ValueError(args[0])
            return grid

    class Site:  # a bound launch site: its first call goes through the kernel's run, the later ones bypass it
        def __init__(self, fn):
            self.fn, self.bound_launches = fn, 0

        def __call__(self, *args):
            if args == ("first",):
                return self.fn.run(grid=(1,))
            self.bound_launches += 1

    own, own_call = Kernel.run, Site.__call__
    plan, scan, partial = Kernel("_plan_kernel"), Kernel("_scan_kernel"), Site(Kernel("_partial_kernel"))
    totals: dict[str, list[float]] = {}
    with mod.timed_launches(totals, owner=Kernel, sites=Site):
        assert plan.run(1, grid=(3,)) == (3,) and scan.run(grid=(1,)) == (1,) and plan.run(grid=(2,)) == (2,)
        try:
            scan.run("bad")
        except ValueError:
            pass
        partial("first")  # through Triton: counted by run
        partial(1)
        partial(2)
    assert Kernel.run is own and Site.__call__ is own_call
    assert {k: len(v) for k, v in totals.items()} == {
        "_plan_kernel": 2, "_scan_kernel": 2, "_partial_kernel": 1, "_partial_kernel (bound)": 2,
    }  # fmt: skip
    table = mod.launch_table({"a": [1e-6, 3e-6, 2e-6], "b": [1e-3], "c": []})
    assert list(table) == ["b", "a"]  # the costliest first, nothing for a kernel never launched
    assert table["a"]["launches"] == 3 and abs(table["a"]["us_median"] - 2.0) < 1e-9
    assert abs(table["a"]["us_mean"] - 2.0) < 1e-9 and abs(table["b"]["ms_total"] - 1.0) < 1e-9
