"""eval/host_overhead.py at a toy size: launches are counted, host time measured, fields present.

The committed figures come from a quiet machine at Llama-3.1-8B's shape and 32k tokens; this only
checks that the measurement counts what it says (the three decode kernels, the window write's torch
ops, no policy run in a timed step) and refuses what it must (a busy machine, several thread counts).
"""

from __future__ import annotations

import pytest

from eval import host_overhead as ho
from hfkv.kernels.environment import interpreter_on


@pytest.mark.skipif(not interpreter_on(), reason="launches are recorded in Triton's interpreter (CPU)")
def test_measure_counts_launches_and_host_time_at_a_toy_size():
    r = ho.measure(context=160, shape_name="cpu-small", budget=48, cycles=2, warmup_cycles=1, rounds=3, policy_cycles=2)
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
    # then timed: each run's host path replayed without its kernels (the replay checks it took the run's path)
    assert pol["host_us_timed_runs"] == 2 and pol["host_us_per_layer"] > 0 and pol["sort_us_per_layer"] > 0


@pytest.mark.skipif(not interpreter_on(), reason="launches are recorded in Triton's interpreter (CPU)")
def test_a_replayed_policy_run_must_take_the_runs_path():
    """The policy run's host time is a replay on a copy of the layer, kernels not run and host reads answered with
    the run's: a replay that launches other kernels, or leaves other host numbers (tables, pool, tier peak, ring,
    counters) than the run left, is refused, and one that takes the same path leaves the layer as the run did."""
    from hfkv.attention.interface import hfkv_attention

    cache, layer, info = ho.build_layer(160, 1, "cpu-small", "hfkv", 48)
    scaling = info["head_dim"] ** -0.5
    with ho.recorded_triton_launches() as names:
        ho.RUN_ALL[0] = True
        try:
            for k, v, q in ho.decode_inputs(1, info, layer.cfg.interval - 1):  # up to the step before a policy run
                cache.update(k, v, 0)
                hfkv_attention(None, q, k, v, None, scaling=scaling)
            before = ho.host_numbers(layer)
            with pytest.raises(RuntimeError, match="read more than the run"):  # a "run" that does nothing
                ho.replayed_policy_run(layer, lambda: None, (), {}, names)
            assert ho.host_numbers(layer) == before and not ho.REPLAYING[0]  # the replay ran on a copy
            run = type(layer).run_policy
            out, seconds, sorting = ho.replayed_policy_run(layer, lambda: run(layer), (), {}, names)
            assert out is None and seconds > 0 and sorting > 0 and ho.host_numbers(layer) != before
            assert names and not ho.REPLAYING[0]
            for k, v, q in ho.decode_inputs(1, info, layer.cfg.interval - 1, seed=2):  # the next run's step
                cache.update(k, v, 0)
                hfkv_attention(None, q, k, v, None, scaling=scaling)

            def run_and_grow():  # the run, then a host number of its own that a replay cannot reproduce
                run(layer)
                layer.steps_since_policy += 1

            with pytest.raises(RuntimeError, match="another path"):
                ho.replayed_policy_run(layer, run_and_grow, (), {}, names)
        finally:
            ho.RUN_ALL[0] = False


def test_main_refuses_a_busy_machine_and_several_thread_counts(tmp_path, capsys, monkeypatch):
    from hfkv.evaluation import quiet

    monkeypatch.setattr(quiet, "load_average", lambda: 3.0)
    out = tmp_path / "h.json"
    assert ho.main(["--out", str(out)]) == 2
    assert "busy machine" in capsys.readouterr().err
    assert ho.main(["--threads", "1,2", "--out", str(out)]) == 2
    assert "--threads" in capsys.readouterr().err
    assert not out.exists()
