"""``hfkv bench``: the largest-batch search, the timing loop's token stream, the written files and ratios,
resuming, bad input, the architecture shapes, and a cache on a model whose layers are offloaded by accelerate."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch
from transformers import DynamicCache

import hfkv
from hfkv.evaluation import bench, quiet
from hfkv.evaluation.bench import decode_step, fill_cache, interleaved_decode, largest_fitting, random_prompt
from hfkv.evaluation.methods import parse_method
from hfkv.evaluation.shapes import SHAPES, build_random_like, config_for, get_shape
from hfkv.storage import cache_bytes
from tests.models import tiny_model


# ------------------------------------------------------------------------------------ largest batch
def _counting(limit: int):
    calls: list[int] = []

    def fits(b: int) -> bool:
        calls.append(b)
        return b <= limit

    return fits, calls


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 5, 8, 13, 63, 64, 65, 100, 255, 256, 1000])
@pytest.mark.parametrize("cap", [1, 7, 64, 256])
def test_largest_fitting_equals_a_linear_scan(limit, cap):
    fits, calls = _counting(limit)
    expected = max([b for b in range(1, cap + 1) if b <= limit], default=0)
    assert largest_fitting(fits, cap) == expected
    assert max(calls) <= cap and min(calls) >= 1
    # doubling then bisection: at most 2 * ceil(log2(cap)) + 2 trials, never the same batch twice
    assert len(calls) <= 2 * max(1, (cap - 1).bit_length()) + 2
    assert len(calls) == len(set(calls))


def test_largest_fitting_start_and_bad_cap():
    fits, calls = _counting(40)
    assert largest_fitting(fits, 256, start=16) == 40
    assert calls[0] == 16
    with pytest.raises(ValueError, match="cap=0"):
        largest_fitting(fits, 0)


# ------------------------------------------------------------------------------------ timing loop
def test_fill_and_decode_steps_follow_greedy_generate():
    """The benchmark's prefill + single-token steps are the same computation as ``generate`` (greedy)."""
    model = tiny_model("llama")
    ids = random_prompt(model.config.vocab_size, 2, 24)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache(config=model.config))
    cache = DynamicCache(config=model.config)
    tok = fill_cache(model, cache, ids, chunk=10)  # chunked prefill: same tokens
    got = [tok]
    for i in range(5):
        tok = decode_step(model, cache, tok, 24 + i)
        got.append(tok)
    assert torch.equal(torch.cat(got, 1), ref[:, 24:])


def test_interleaved_decode_steps_every_cache_equally():
    model = tiny_model("llama")
    ids = random_prompt(model.config.vocab_size, 1, 40)
    methods = [parse_method(s) for s in ("dynamic", "evict@24:window=8")]
    caches = {m.label: m.make_cache(model) for m in methods}
    tokens = {name: fill_cache(model, c, ids) for name, c in caches.items()}
    seen: list[str] = []
    times = interleaved_decode(model, caches, tokens, 40, steps=4, warmup=1, after_step=lambda n, c: seen.append(n))
    assert {n: len(t) for n, t in times.items()} == {"dynamic": 4, "evict@24:window=8": 4}
    assert all(t > 0 for ts in times.values() for t in ts)
    assert seen == ["dynamic", "evict@24:window=8"] * 5  # one step of each, in turns, warm-up included
    assert caches["dynamic"].get_seq_length() == 45
    assert caches["evict@24:window=8"].get_seq_length() == 45


def test_interleaved_decode_goes_on_from_each_caches_own_position():
    model = tiny_model("llama")
    ids = random_prompt(model.config.vocab_size, 1, 40)
    caches = {name: DynamicCache(config=model.config) for name in ("a", "b")}
    tokens = {name: fill_cache(model, c, ids) for name, c in caches.items()}
    for i in range(3):  # "b" decodes alone first, as gpu_check's caches do before their turns
        tokens["b"] = decode_step(model, caches["b"], tokens["b"], 40 + i)
    interleaved_decode(model, caches, tokens, {"a": 40, "b": 43}, steps=3, warmup=0)
    for name, steps in (("a", 3), ("b", 6)):  # the same steps, alone: same rotated keys at the same positions
        alone = DynamicCache(config=model.config)
        tok = fill_cache(model, alone, ids)
        for i in range(steps):
            tok = decode_step(model, alone, tok, 40 + i)
        assert torch.equal(alone.layers[0].keys, caches[name].layers[0].keys), name


# ------------------------------------------------------------------------------------ the command
ARGS = [
    *("--random-like", "cpu-small", "--random-layers", "2", "--dtype", "fp32"),
    *("--methods", "dynamic,static,quanto-int4,evict,quant@none", "--budgets", "48"),
    *("--contexts", "64,128", "--decode-steps", "3", "--warmup", "1", "--no-progress", "--name", "t"),
    *("--threads", "1,2"),  # every group at 1 and 2 torch threads
]


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """A quiet machine for every run here (the load-average check itself: tests/test_quiet.py)."""
    monkeypatch.setattr(quiet, "load_average", lambda: 0.05)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, frozen_heap):
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quiet, "load_average", lambda: 0.05)
        threads = torch.get_num_threads()
        assert bench.main([*ARGS, "--out-dir", str(out)]) == 0
        assert torch.get_num_threads() == threads  # set per group, restored after the last
    return out


def test_bench_writes_json_csv_plot(bench_run):
    result = json.loads((bench_run / "t.json").read_text())
    assert result["args"]["sdpa"] == bench.BASELINE_SDPA  # the baselines' SDPA without cuDNN's per-length plans
    assert result["device"] and result["model"]["random_like"] == "cpu-small" and result["model"]["layers"] == 2
    assert result["hfkv_version"] == hfkv.__version__ and result["dtype"] == "fp32"
    assert [(g["threads"], g["context"], g["batch"]) for g in result["groups"]] == [
        (1, 64, 1),
        (1, 128, 1),
        (2, 64, 1),
        (2, 128, 1),
    ]
    labels = ["dynamic", "static", "quanto-int4", "evict@48", "quant@none"]
    for g in result["groups"]:
        assert [r["method"] for r in g["rows"]] == labels
        assert {r["threads"] for r in g["rows"]} == {g["threads"]}
        # the run's thread counts, cores and loads before / after, quiet at both ends
        q = g["quiet"]
        assert q["threads"] == [1, 2] and q["cpu_count"] == os.cpu_count() and q["max_load"] == 0.5
        assert q["load_before"] == q["load_after"] == 0.05 and q["quiet_before"] and q["quiet_after"]
        assert q["busy"] is False and q["force_busy"] is False
    assert result["busy"] is False and result["quiet"] == result["groups"][0]["quiet"]
    assert result["args"]["threads"] == [1, 2]
    assert "torch thread" not in result["device"]  # the thread count is per group
    with open(bench_run / "t.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4 * len(labels) and rows[0]["method"] == "dynamic"
    assert [r["threads"] for r in rows] == ["1"] * 10 + ["2"] * 10 and {r["quiet"] for r in rows} == {"True"}
    assert (bench_run / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_ratios_are_to_the_dynamic_cache_of_the_same_group(bench_run):
    result = json.loads((bench_run / "t.json").read_text())
    for g in result["groups"]:
        rows = {r["method"]: r for r in g["rows"]}
        dyn = rows["dynamic"]
        assert dyn["memory_ratio"] == dyn["compression"] == dyn["decode_speedup_median"] == 1.0
        # a DynamicCache holds 2 (K, V) x layers x KV heads x head_dim x 4 bytes per token
        shape = get_shape("cpu-small")
        tokens = g["context"] + 1 + 3  # prompt + warm-up step + timed steps
        assert dyn["kv_bytes"] == 2 * 2 * shape.kv_heads * shape.dim * 4 * tokens
        assert dyn["peak_kind"] == "cache_bytes_held" and dyn["peak_bytes"] == dyn["kv_bytes"]
        for r in rows.values():
            assert r["memory_ratio"] == pytest.approx(r["kv_bytes"] / dyn["kv_bytes"])
            assert r["compression"] == pytest.approx(dyn["kv_bytes"] / r["kv_bytes"])
            assert r["decode_speedup_median"] == pytest.approx(dyn["decode_ms_median"] / r["decode_ms_median"])
            assert r["prefill_speedup"] == pytest.approx(dyn["prefill_s"] / r["prefill_s"])
            assert r["decode_tok_s"] == pytest.approx(1e3 / r["decode_ms_median"])
            assert r["peak_bytes"] >= r["kv_bytes"]
        assert rows["quanto-int4"]["compression"] > 2  # 4-bit codes + scales (the residual is still empty)
        assert rows["quant@none"]["compression"] > 1  # K4V2 outside its window
        assert rows["static"]["kv_bytes"] >= dyn["kv_bytes"]  # allocated for the whole run up front
    # evict@48 holds at most its budget: bytes stop growing with the context
    big = {r["method"]: r for r in result["groups"][1]["rows"]}
    small = {r["method"]: r for r in result["groups"][0]["rows"]}
    assert big["evict@48"]["kv_bytes"] == small["evict@48"]["kv_bytes"]
    assert big["evict@48"]["compression"] > small["evict@48"]["compression"] > 1


def test_bench_resumes_and_force_remeasures(bench_run, monkeypatch, tmp_path, frozen_heap):
    (tmp_path / "t.json").write_text((bench_run / "t.json").read_text())
    measured: list[tuple[int, int]] = []
    real = bench.bench_group

    def spy(model, methods, context, batch, args, bar=None):
        measured.append((context, batch))
        return real(model, methods, context, batch, args, bar)

    monkeypatch.setattr(bench, "bench_group", spy)
    assert bench.main([*ARGS, "--out-dir", str(tmp_path), "--no-plot"]) == 0
    assert measured == []  # both groups are in t.json with every method
    assert bench.main([*ARGS, "--contexts", "64,96", "--out-dir", str(tmp_path), "--no-plot"]) == 0
    assert measured == [(96, 1)] * 2  # at 1 and at 2 threads
    result = json.loads((tmp_path / "t.json").read_text())
    assert [(g["threads"], g["context"]) for g in result["groups"]] == [(n, c) for n in (1, 2) for c in (64, 96, 128)]
    assert bench.main([*ARGS, "--contexts", "64", "--force", "--out-dir", str(tmp_path), "--no-plot"]) == 0
    assert measured == [(96, 1)] * 2 + [(64, 1)] * 2
    assert bench.main([*ARGS, "--contexts", "64", "--threads", "1", "--force", "--out-dir", str(tmp_path)]) == 0
    assert measured == [(96, 1)] * 2 + [(64, 1)] * 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--contexts", "0"], "--contexts: '0' must be a positive integer"),
        (["--batch-sizes", "two"], "--batch-sizes: 'two' is not a positive integer"),
        (["--decode-steps", "0"], "--decode-steps: '0' must be a positive integer"),
        (["--random-like", "llama-9"], "--random-like: 'llama-9' is not a shape"),
        (["--methods", "nope"], "--methods: 'nope' is not a preset"),
    ],
)
def test_bench_bad_options_are_named(argv, message, tmp_path, capsys):
    """More bad command lines of every subcommand: tests/test_cli_errors.py."""
    assert bench.main(["--random-like", "cpu-small", "--out-dir", str(tmp_path), *argv]) == 2
    assert f"hfkv bench: error: {message}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


# ------------------------------------------------------------------------------------ shapes
def test_shapes_match_published_kv_sizes():
    # bf16 KV bytes per token of the public configs: Llama-3.1-8B 128 KiB, Llama-3.1-70B 320 KiB,
    # Qwen2.5-7B 56 KiB, SmolLM2-135M 30 layers x 3 KV heads x 64 x 2 x 2 = 23,040 bytes
    assert SHAPES["llama-3.1-8b"].kv_bytes_per_token() == 128 * 1024
    assert SHAPES["llama-3.1-70b"].kv_bytes_per_token() == 320 * 1024
    assert SHAPES["qwen2.5-7b"].kv_bytes_per_token() == 56 * 1024
    assert SHAPES["smollm2-135m"].kv_bytes_per_token() == 23040
    cfg = config_for("llama-3.1-8b", layers=2)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (2, 8, 128, 128256)


def test_random_like_builds_the_named_shape():
    model = build_random_like("smollm2-135m", layers=1, dtype=torch.bfloat16, max_positions=4096)
    text = model.config
    assert (text.model_type, text.num_hidden_layers, text.num_key_value_heads, text.hidden_size) == ("llama", 1, 3, 576)
    assert model.dtype == torch.bfloat16
    cache = DynamicCache(config=model.config)
    fill_cache(model, cache, random_prompt(text.vocab_size, 1, 5))
    assert cache_bytes(cache) == 5 * SHAPES["smollm2-135m"].kv_bytes_per_token() // 30  # one of 30 layers


# ------------------------------------------------------------------------------------ device_map
def test_cache_on_a_model_with_accelerate_offloaded_layers(tmp_path):
    """``device_map`` with a layer offloaded to disk (its weights on ``meta`` until its forward): every
    TriStateLayer's storage lives where that layer's keys are computed, and generation is unchanged."""
    from accelerate import dispatch_model

    model = tiny_model("llama")
    ids = random_prompt(model.config.vocab_size, 2, 64)
    cfg = hfkv.TriStateConfig.from_preset("hfkv", budget=40)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=hfkv.TriStateCache(model, cfg))
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map |= {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = dispatch_model(tiny_model("llama"), device_map=device_map, offload_dir=str(tmp_path))
    assert offloaded.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    cache = hfkv.TriStateCache(offloaded, cfg)
    out = offloaded.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)
    assert cache.stats().compression_ratio > 1.2  # tokens were quantized / evicted on the offloaded layer too
    for layer in cache.layers:
        assert layer.device == torch.device("cpu")
        assert all(t.device == torch.device("cpu") for t in layer.held_tensors())


def test_sdpa_backends_limit_what_torch_may_pick():
    """The baseline's SDPA backends are a real restriction: on a CPU, 'efficient' alone has no kernel,
    'math' alone gives default SDPA's result, and a wrong name is refused naming it."""
    from hfkv.evaluation.bench import sdpa_backends

    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with sdpa_backends("math"):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(got, want)
    with sdpa_backends("efficient"), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with sdpa_backends("default"):
        torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), want)
    with pytest.raises(ValueError, match="'flash,fast'.*fast not allowed"):
        sdpa_backends("flash,fast")


def test_bench_names_a_bad_sdpa_backend(tmp_path, capsys):
    assert bench.main([*ARGS, "--out-dir", str(tmp_path), "--sdpa", "flash,cudnn9"]) == 2
    err = capsys.readouterr().err
    assert "--sdpa" in err and "cudnn9 not allowed" in err and not list(tmp_path.iterdir())
