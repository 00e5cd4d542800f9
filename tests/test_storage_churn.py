"""eval/storage_churn.py at a toy size: per policy run, the layers whose pool or page tables changed shape,
against a recount from each layer's shapes taken around every run."""

from __future__ import annotations

import importlib

from hfkv.evaluation.bench import decode_step


def test_storage_churn_counts_what_each_policy_run_changed(monkeypatch):
    from eval import storage_churn as sc
    from hfkv.loading import load_model

    model, tok = load_model("testbed", dtype="float32")
    shapes = []  # every layer's shapes before the first step and after each policy run, beside the script's count

    def layer_shapes(cache):
        return [(layer.tiers.pool.data.shape, *(t.shape for t in layer.tiers.tables)) for layer in cache.layers]

    def recording_step(model, cache, tokens, position):
        if not shapes:
            shapes.append(layer_shapes(cache))
        out = decode_step(model, cache, tokens, position)
        if cache.layers[0].steps_since_policy == 0:
            shapes.append(layer_shapes(cache))
        return out

    monkeypatch.setattr("hfkv.evaluation.bench.decode_step", recording_step)
    # a budget the prompt does not fill: the first runs grow the pool
    r = sc.measure(model, tok, "hfkv@48:interval=4,dense_phase=False", context=40, steps=40)
    assert r["policy_runs"] == len(shapes) - 1 == len(r["runs"]) == 10
    pairs = list(zip(shapes[:-1], shapes[1:], strict=True))
    changed = [sum(a != b for a, b in zip(x, y, strict=True)) for x, y in pairs]
    assert [run["layers_changed"] for run in r["runs"]] == changed
    grown = [sum(a[0] != b[0] for a, b in zip(x, y, strict=True)) for x, y in pairs]
    assert [run["pool_grown"] for run in r["runs"]] == grown and grown[0] > 0
    assert r["runs_changing_no_layer"] == changed.count(0)


def test_eval_scripts_name_a_bad_option_and_exit_2(capsys):
    """The two counting scripts report a bad command line as one line naming the option, before any model loads."""
    cases = (("storage_churn", "--steps"), ("policy_launches", "--batch"))
    for name, option in cases:
        assert importlib.import_module(f"eval.{name}").main([option, "0", "--out", "x.json"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"eval/{name}.py: error: {option}") and err.count("\n") == 1
