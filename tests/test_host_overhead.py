"""eval/host_overhead.py at a toy size: launches are counted, host time measured, fields present.

The committed figures come from a quiet machine at Llama-3.1-8B's shape and 32k tokens; this only
checks that the measurement counts what it says (the three decode kernels, the window write's torch
ops, no policy run in a timed step) and refuses what it must (a busy machine, several thread counts).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hfkv.kernels.backend import interpreter_on

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("host_overhead", REPO / "eval" / "host_overhead.py")
ho = importlib.util.module_from_spec(_spec)
sys.modules["host_overhead"] = ho
_spec.loader.exec_module(ho)


@pytest.mark.skipif(not interpreter_on(), reason="launches are recorded in Triton's interpreter (CPU)")
def test_measure_counts_launches_and_host_time_at_a_toy_size():
    r = ho.measure(context=160, shape_name="cpu-small", budget=48, cycles=2, warmup_cycles=1, rounds=3)
    between = r["steps_between_restores"]
    assert between == 7  # the hfkv preset's interval 8: the 8th step after a policy run runs the next
    assert r["timed_steps"] == 3 * 2 * between and r["policy_runs_in_timed_steps"] == 0
    rounds = sorted(r["host_us_per_layer_rounds"])
    assert len(rounds) == 3 and r["host_us_per_layer"] == rounds[1]  # the median of the rounds' medians
    by_kernel = r["launches_by_kernel"]
    # One launch of each decode kernel for all parts (the ring and the tiers holding tokens).
    assert by_kernel == {"_partial_kernel": 1, "_combine_kernel": 1, "_score_kernel": 1}
    assert r["triton_launches_per_layer"] == sum(by_kernel.values())
    assert r["torch_launches_per_layer"] == 0  # the window write is in the partial launch (push_deferred)
    assert r["launches_per_layer"] == r["triton_launches_per_layer"] + r["torch_launches_per_layer"]
    assert 0 < r["host_us_per_layer"] and r["host_us_per_layer_p20_p80"][0] <= r["host_us_per_layer_p20_p80"][1]
    assert set(r["targets"]) == {"launches_per_layer", "host_us_per_layer"}
    assert r["targets"]["launches_per_layer"]["met"] == (r["launches_per_layer"] <= 3)
    assert r["tokens_held"]["quantized"] > 0 and r["shape"]["kv_heads"] == 2
    pol = r["policy_run"]  # counted on runs after the timed steps
    assert pol["runs"] == 2 and pol["torch_launches_per_layer"] > r["launches_per_layer"]
    assert pol["host_syncs_per_layer"] == sum(pol["host_syncs_by_op"].values()) >= 1  # it sizes moves on the host


def test_main_refuses_a_busy_machine_and_several_thread_counts(tmp_path, capsys, monkeypatch):
    from hfkv.evaluation import quiet

    monkeypatch.setattr(quiet, "load_average", lambda: 3.0)
    out = tmp_path / "h.json"
    assert ho.main(["--out", str(out)]) == 2
    assert "busy machine" in capsys.readouterr().err
    assert ho.main(["--threads", "1,2", "--out", str(out)]) == 2
    assert "--threads" in capsys.readouterr().err
    assert not out.exists()
