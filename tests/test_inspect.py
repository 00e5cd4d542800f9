"""hfkv.inspect: every frame, trace and summary is checked against what the cache itself holds."""

from __future__ import annotations

import html
import json
import math
import os

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LogitsProcessorList

import hfkv
from hfkv import inspect as hi
from hfkv.states import EVICTED, MID, ORIGINAL, QUANTIZED, STATE_NAMES, WINDOW
from hfkv.stats_html import fmt_count, fmt_share
from tests.models import left_padded_batch, tiny_model

# Small windows and budgets so every preset moves tokens out of the window within a short generation.
PRESET_OVERRIDES = {
    "full": {},
    "evict": {"budget": 24, "window": 8},
    "quant": {"window": 8},
    "streaming": {"budget": 16},
    "arkv": {"budget": 24, "window": 8, "obs_window": 8, "interval": 4},
    "diffkv": {"window": 8, "obs_window": 8, "alpha_l": 0.5},
    "hfkv": {"budget": 24, "window": 8, "obs_window": 8, "interval": 4},
}
# The states each preset must produce on that run: the comparisons below are not vacuous.
MUST_SEE = {
    "evict": {"evicted", "original"},
    "quant": {"quantized"},
    "streaming": {"evicted", "original"},
    "arkv": {"evicted", "quantized"},
    "diffkv": {"quantized"},
    "hfkv": {"evicted", "quantized"},
}
NEW_TOKENS = 10


def _model():
    # A larger init makes attention peaked, as in trained models, so thresholds and OQ ratios bite.
    return tiny_model("llama", initializer_range=0.2)


def _run(model, preset: str, new: int = NEW_TOKENS):
    """(cache, its MemoryTrace) after a greedy generation on a left-padded batch of three prompts."""
    ids, mask = left_padded_batch(lengths=(48, 40, 29))
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(preset, **PRESET_OVERRIDES[preset]))
    trace = hi.MemoryTrace(cache)
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=cache,
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([trace]),
    )
    return cache, trace


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def runs(model):
    return {p: _run(model, p)[0] for p in hfkv.PRESETS}


@pytest.mark.parametrize("preset", hfkv.PRESETS)
def test_state_map_and_frames_count_what_stats_counts(runs, preset):
    cache = runs[preset]
    st_ = cache.stats()
    tidy = st_.to_dataframe()
    assert list(tidy.columns) == ["layer", "row", "kv_head", "state", "tokens"]
    per_head = tidy.pivot_table(index=["layer", "row", "kv_head"], columns="state", values="tokens", observed=True)
    # every (layer, row, KV head) adds up to the layer's logical length
    lengths = {ls.layer: ls.logical_length for ls in st_.layers}
    sums = tidy.groupby(["layer", "row", "kv_head"])["tokens"].sum()
    assert len(sums) and all(n == lengths[layer] for (layer, _, _), n in sums.items())
    layers = hi.compressed_layers(cache)
    assert layers == ([] if preset == "full" else [0, 1])
    seen = set()
    for row in range(3):
        grid = hi.state_grid(cache, row)
        heads = hi.head_frame(cache, row)
        tokens = hi.token_frame(cache, row, prompt_length=48)
        assert list(grid.index) == [(layer, h) for layer in layers for h in range(2)]
        assert len(heads) == len(grid)
        for (layer, h), codes in grid.iterrows():
            want = per_head.loc[(layer, row, h)]
            codes = codes.to_numpy()
            got = {
                "window": int((codes == WINDOW).sum()),
                "original": int((codes == ORIGINAL).sum()),
                "mid": int((codes == MID).sum()),
                "quantized": int((codes == QUANTIZED).sum()),
                "evicted": int((codes == EVICTED).sum()),
            }
            assert got == {name: int(want[name]) for name in got}, (preset, row, layer, h)
            seen |= {name for name, n in got.items() if n and name != "window"}
            head = heads[(heads["layer"] == layer) & (heads["head"] == h)].iloc[0]
            assert {name: int(head[name]) for name in got} == got
            assert head["kept"] == got["window"] + got["original"] + got["mid"] + got["quantized"]
            hi_n, lo_n = cache.thresholds(layer)
            assert head["alpha_h_n"] == float(hi_n[h]) and head["alpha_l_n"] == float(lo_n[h])
            # the long frame is the same map, position by position, with the cache's own scores
            sel = tokens[(tokens["layer"] == layer) & (tokens["head"] == h)]
            np.testing.assert_array_equal(sel["code"].to_numpy(), codes)
            assert list(sel["state"].astype(str)) == [hi.STATE_LABELS[c] for c in codes]
            scores = cache.token_scores(layer)[row, h].numpy()
            np.testing.assert_array_equal(sel["score"].to_numpy(), scores)
            assert np.isnan(scores[codes == EVICTED]).all() and not np.isnan(scores[codes != EVICTED]).any()
            assert (sel["part"] == np.where(sel["position"] < 48, "prompt", "generated")).all()
            assert len(sel) == cache.get_seq_length()
    assert MUST_SEE.get(preset, set()) <= seen, (preset, seen)

    frame = hi.layer_frame(cache)
    totals = per_head.groupby("layer")[["window", *STATE_NAMES]].sum()
    for _, r in frame.iterrows():
        assert {n: r[n] for n in totals.columns} == totals.loc[r["layer"]].to_dict()
        ls = st_.layers[int(r["layer"])]
        assert (r["kv_bytes"], r["dense_bytes"], r["tokens"]) == (ls.kv_bytes, ls.dense_bytes, ls.logical_length)
        assert r["compression"] == pytest.approx(ls.dense_bytes / ls.kv_bytes)
    oq = cache.oq_ratios()
    if oq is None:
        assert frame["oq_ratio"].isna().all()
    else:
        assert frame["oq_ratio"].tolist() == pytest.approx([float(oq[i].mean()) for i in frame["layer"]])


def test_preset_full_has_no_compressed_layers_but_still_frames(runs):
    cache = runs["full"]
    assert hi.state_grid(cache).empty and hi.head_frame(cache).empty and hi.token_frame(cache).empty
    frame = hi.layer_frame(cache)
    assert (frame["compression"] == 1.0).all() and not frame["compressed"].any()


def test_memory_trace_is_one_entry_per_forward_pass_and_matches_a_manual_loop(model):
    cfg = hfkv.TriStateConfig.from_preset("hfkv", **PRESET_OVERRIDES["hfkv"])
    cache = hfkv.TriStateCache(model, cfg)
    trace = hi.MemoryTrace(cache)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    out = model.generate(
        input_ids=ids,
        past_key_values=cache,
        max_new_tokens=30,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([trace]),
    )
    new = out.shape[1] - ids.shape[1]
    assert new == 30 and len(trace) == new  # prefill + 29 decode steps: one entry per generated token
    frame = trace.frame()
    assert frame["step"].tolist() == list(range(new))
    assert frame["tokens"].tolist() == [ids.shape[1] + i for i in range(new)]
    assert trace.kv_bytes[-1] == cache.stats().kv_bytes
    assert frame["dense_bytes"].iloc[-1] == cache.stats().dense_bytes

    # The same greedy decode by hand, reading stats() after every forward pass.
    manual = hfkv.TriStateCache(model, cfg)
    want = []
    logits = model(input_ids=ids, past_key_values=manual).logits
    for step in range(new):
        st_ = manual.stats()
        tot = {n: sum(ls.totals()[n] for ls in st_.layers) for n in hi.STATE_ORDER}
        want.append({"kv_bytes": st_.kv_bytes, "dense_bytes": st_.dense_bytes, **tot})
        if step == new - 1:
            break
        nxt = logits[:, -1:].argmax(-1)
        logits = model(input_ids=nxt, position_ids=torch.tensor([[ids.shape[1] + step]]), past_key_values=manual).logits
    got = frame[["kv_bytes", "dense_bytes", *hi.STATE_ORDER]].to_dict("records")
    assert got == want
    assert len(set(frame["kv_bytes"])) > 1 or frame["evicted"].iloc[-1] > 0  # the run really compressed
    assert frame["dense_bytes"].iloc[-1] > frame["kv_bytes"].iloc[-1]


def test_memory_trace_of_a_dynamic_cache_is_what_dense_bytes_predicts(model):
    ids, mask = left_padded_batch(lengths=(48, 40, 29))
    dense = DynamicCache(config=model.config)
    dense_trace = hi.MemoryTrace(dense)
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=dense,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([dense_trace]),
    )
    _, tri_trace = _run(model, "hfkv")
    dense_frame = dense_trace.frame()
    assert len(dense_frame) == NEW_TOKENS and dense_frame["dense_bytes"].isna().all()
    # measured from DynamicCache's tensors == the TriStateCache's dense_bytes, at every step
    assert dense_frame["kv_bytes"].tolist() == tri_trace.frame()["dense_bytes"].tolist()
    with pytest.raises(TypeError, match="transformers Cache"):
        hi.MemoryTrace(object())


def test_cache_html_contains_the_numbers(runs):
    cache = runs["hfkv"]
    st_ = cache.stats()
    text = cache._repr_html_()
    assert text == hi.cache_html(cache)  # the public name, re-exported from hfkv.stats_html
    assert html.escape(cache.config.summary()) in text
    assert html.escape(st_.budget_text()) in text and "fp_tokens per KV head" in text
    assert f"{st_.kv_bytes:,} B" in text and f"{st_.dense_bytes:,} B" in text
    assert f"{st_.compression_ratio:.2f}x" in text
    assert f"{cache.get_seq_length():,} tokens" in text
    for ls in st_.layers:
        row = text.split(f"<tr><td>{ls.layer}</td>", 1)[1].split("</tr>", 1)[0]
        cells = [c.split("</td>")[0] for c in row.split("<td>")[1:]]
        t = ls.totals()
        n = 4 + len(hi.STATE_ORDER)
        # token counts per KV head: the mean over 3 rows x 2 KV heads
        assert cells[:n] == [
            f"{ls.logical_length:,}",
            f"{ls.kv_bytes:,}",
            f"{ls.dense_bytes:,}",
            f"{ls.dense_bytes / ls.kv_bytes:.2f}x",
            *(fmt_count(t[n] / 6) for n in hi.STATE_ORDER),
        ]
        assert cells[n] == ", ".join(f"{float(r):.3f}" for r in cache.oq_ratios()[ls.layer])
    assert "mean over 3 rows x 2 KV heads" in text
    everything = sum(sum(ls.totals().values()) for ls in st_.layers)
    for name in hi.STATE_ORDER:
        assert f"{name} {fmt_share(sum(ls.totals()[name] for ls in st_.layers) / everything)}" in text
    # CacheStats and LayerStats render the same numbers (without the config line and OQ ratios)
    stats_text = st_._repr_html_()
    assert f"{st_.kv_bytes:,} B" in stats_text and f"{st_.compression_ratio:.2f}x" in stats_text
    assert "OQ ratio" in text and "OQ ratio" not in stats_text
    layer_text = st_.layers[1]._repr_html_()
    assert f"<td>{st_.layers[1].kv_bytes:,}</td>" in layer_text and "<tr><td>0</td>" not in layer_text


def test_html_escapes_and_handles_an_empty_cache(model):
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict"), name="<b>mine</b>")
    text = cache._repr_html_()
    assert "&lt;b&gt;mine&lt;/b&gt;" in text and "<b>mine</b>" not in text
    assert "empty: nothing cached yet" in text
    with pytest.raises(ValueError, match="cache is empty"):
        hi.state_grid(cache)


def test_row_and_cache_type_errors_name_the_value(runs):
    with pytest.raises(ValueError, match=r"row=3 is out of range: the cache holds batch rows 0\.\.2"):
        hi.head_frame(runs["hfkv"], 3)
    with pytest.raises(ValueError, match="row=-1"):
        hi.token_frame(runs["hfkv"], -1)
    with pytest.raises(TypeError, match="expected a hfkv.TriStateCache, got DynamicCache"):
        hi.layer_frame(DynamicCache())


def test_layer_frame_of_stats_sums_the_per_head_frame(runs):
    st_ = runs["arkv"].stats()
    per_layer = st_.layer_frame()
    tidy = st_.to_dataframe()
    summed = tidy.pivot_table(index="layer", columns="state", values="tokens", aggfunc="sum", observed=True)
    summed = summed.reset_index()[["layer", "window", *STATE_NAMES]].rename_axis(columns=None)
    pd.testing.assert_frame_equal(per_layer[["layer", "window", *STATE_NAMES]], summed, check_dtype=False)
    assert per_layer["kv_bytes"].sum() == st_.kv_bytes and per_layer["dense_bytes"].sum() == st_.dense_bytes


def _brute_front(m, a):
    out = []
    for i in range(len(m)):
        if math.isnan(m[i]) or math.isnan(a[i]):
            out.append(False)
            continue
        dominated = any(
            not (math.isnan(m[j]) or math.isnan(a[j]))
            and m[j] <= m[i]
            and a[j] >= a[i]
            and (m[j] < m[i] or a[j] > a[i])
            for j in range(len(m))
        )
        out.append(not dominated)
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.1, 0.2, 0.3, 0.5, 1.0, math.nan]), st.sampled_from([0.0, 0.5, 0.9, 1.0, math.nan])
        ),
        min_size=1,
        max_size=12,
    )
)
def test_pareto_front_equals_brute_force(points):
    frame = pd.DataFrame(points, columns=["memory_ratio", "accuracy"], index=[f"r{i}" for i in range(len(points))])
    got = hi.pareto_front(frame)
    assert list(got.index) == list(frame.index)
    assert got.tolist() == _brute_front(*zip(*points, strict=True))


def test_pareto_front_hand_case_and_errors():
    frame = pd.DataFrame({"mem": [1.0, 0.2, 0.2, 0.5, 0.1], "acc": [1.0, 0.9, 0.9, 0.95, 0.0]})
    assert hi.pareto_front(frame, memory="mem", accuracy="acc").tolist() == [True, True, True, True, True]
    frame.loc[5] = [0.6, 0.9]  # more memory than 0.5, less accuracy: dominated
    assert not hi.pareto_front(frame, memory="mem", accuracy="acc")[5]
    with pytest.raises(KeyError, match="'memory_ratio' not in the frame"):
        hi.pareto_front(frame)


def test_load_sweep_filters_and_labels(tmp_path):
    rows = [
        {"task": "kv_recall", "method": "dynamic", "preset": "dynamic", "budget": None, "dtype": "bf16"},
        {"task": "kv_recall", "method": "evict@80", "preset": "evict", "budget": 80, "dtype": "bf16"},
        {"task": "kv_recall", "method": "hfkv", "preset": "hfkv", "budget": 80, "dtype": "fp32"},
        {"task": "arith_cot", "method": "hfkv", "preset": None, "budget": 160, "dtype": "bf16"},
    ]
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(r | {"accuracy": 0.5, "memory_ratio": 0.25}) + "\n" for r in rows))
    frame = hi.load_sweep(path, task="kv_recall", dtype="bf16")
    assert frame["label"].tolist() == ["dynamic", "evict@80"]  # the budget is not appended twice
    assert frame["family"].tolist() == ["dynamic", "evict"]
    assert hi.load_sweep(path, task="arith_cot")["label"].tolist() == ["hfkv@160"]
    assert hi.load_sweep(path)["family"].tolist()[-1] == "hfkv"  # no preset: the method
    with pytest.raises(ValueError, match=r"task='gsm8k' has no rows; tasks present: \['arith_cot', 'kv_recall'\]"):
        hi.load_sweep(path, task="gsm8k")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task": "kv_recall", "method": "x", "accuracy": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"lack column\(s\) \['memory_ratio'\]"):
        hi.load_sweep(bad)


def test_testbed_sweep_rows_are_what_evaluate_measures():
    from hfkv.loading import load_model
    from hfkv.testbed import load_test_set
    from hfkv.testbed.protocol import evaluate

    model, tok = load_model("testbed")
    frame = hi.testbed_sweep(model, tok, "kv_recall", [("evict", 48)], limit=4, batch_size=4)
    assert frame["label"].tolist() == ["DynamicCache", "evict@48"]
    data = load_test_set("kv_recall")[:4]
    for (_, row), (preset, budget) in zip(frame.iterrows(), [(None, None), ("evict", 48)], strict=True):
        want = evaluate(model, tok, "kv_recall", data, preset, budget, batch_size=4)
        assert row["accuracy"] == want["accuracy"] and row["n"] == 4
        assert row["compression"] == pytest.approx(want["compression"])
        assert row["memory_ratio"] == pytest.approx(1 / want["compression"])
    assert frame["memory_ratio"].iloc[0] == 1.0 and frame["memory_ratio"].iloc[1] < 0.5
    assert frame["dtype"].tolist() == ["fp32", "fp32"]
    with pytest.raises(ValueError, match="preset='nope'"):
        hi.testbed_sweep(model, tok, configs=[("nope", 80)])
    with pytest.raises(ValueError, match="budget=40 must be > window"):
        hi.testbed_sweep(model, tok, configs=[("diffkv", 40)])
    with pytest.raises(ValueError, match="limit=0"):
        hi.testbed_sweep(model, tok, configs=[], limit=0)
    with pytest.raises(ValueError, match="task='nope'"):
        hi.testbed_sweep(model, tok, task="nope")


def test_save_figure_writes_a_png_atomically(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    assert hi.save_figure(fig, None, "x") is None
    path = hi.save_figure(fig, tmp_path / "figs", "line")
    assert path == os.path.join(tmp_path / "figs", "line.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "figs") == ["line.png"]  # no temp file left
    with pytest.raises(ValueError, match="name='a/b'"):
        hi.save_figure(fig, tmp_path, "a/b")
    plt.close(fig)
