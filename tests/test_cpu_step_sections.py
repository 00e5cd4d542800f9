"""eval/cpu_step_sections.py refuses what it cannot honour: one file holds one thread count's sections."""

from __future__ import annotations

import pytest
import torch


def test_several_thread_counts_are_refused_by_name(tmp_path, capsys):
    mod = _module()
    with pytest.raises(SystemExit) as exc:
        mod.main(["--threads", "1,2", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "--threads=1,2: one thread count per run" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _module():
    from eval import cpu_step_sections

    return cpu_step_sections


def test_sections_land_where_each_cache_spends_them_and_give_the_models_floor(tmp_path):
    """DynamicCache's step is split into its attention, its concatenation and the model's own work (the floor no
    cache goes below); hfkv's attention, once it compresses, is its kernel, never SDPA."""
    import json

    out = tmp_path / "s.json"
    mod = _module()
    assert mod.main(["--specs", "dynamic", "hfkv@64", "--context", "96", "--steps", "8", "--threads", "1",
                     "--force-busy", "--out", str(out)]) == 0  # fmt: skip
    got = json.loads(out.read_text())
    dyn, hf = got["ms_per_step"]["dynamic"], got["ms_per_step"]["hfkv@64"]  # 64: compresses the 96 tokens
    assert dyn["sdpa"] > 0 and dyn["dynamic_update"] > 0 and dyn["paged_attention_cpu"] == 0
    assert hf["paged_attention_cpu"] > 0 and hf["sdpa"] == 0 and hf["dynamic_update"] == 0
    assert got["model_floor_ms"] == pytest.approx(dyn["step"] - dyn["sdpa"] - dyn["dynamic_update"])
    assert got["free_attention_bound"] == pytest.approx(dyn["step"] / got["model_floor_ms"])
    assert got["free_attention_bound"] > 1
    assert got["model"] == "cpu-small" and got["dtype"] == "fp32"
    assert len(got["source_digest"]) == 16 and "git_commit" in got  # which code the figures measured
    # cpu-small: 8 layers, 8 query heads on 2 KV heads of 64; DynamicCache holds the prompt, 8 warm-up and 8 steps
    assert dyn["held_tokens"] == (96 + 8 + 8) * 8 * 2
    assert dyn["attention_macs"] == dyn["held_tokens"] * 4 * 64 * 2
    assert 0 < hf["held_tokens"] <= dyn["held_tokens"]
    assert got["fp32_peak_gmacs"] > 0.1
    bound = got["attend_all"]
    assert bound["hfkv@64"]["mac_floor_ms"] == pytest.approx(hf["attention_macs"] / got["fp32_peak_gmacs"] / 1e6)
    assert bound["hfkv@64"]["attend_all_bound"] == pytest.approx(
        dyn["step"] / (got["model_floor_ms"] + bound["hfkv@64"]["mac_floor_ms"])
    )
    assert bound["hfkv@64"]["attend_all_bound"] < got["free_attention_bound"]


def test_held_tokens_leave_out_the_evicted():
    """A cache that evicted holds fewer tokens than its length: what the kernel attends to, summed over layers and
    heads, is what cache.stats() counts outside the evicted state."""
    from hfkv import TriStateCache
    from hfkv.evaluation.bench import fill_cache, random_prompt
    from hfkv.evaluation.shapes import build_random_like

    model = build_random_like("cpu-small", max_positions=512)
    cache = TriStateCache(model, "evict", budget=48)
    with torch.inference_mode():
        fill_cache(model, cache, random_prompt(model.config.vocab_size, 1, 160), 64)
    held = _module().held_tokens(cache, 8, 2)
    per_layer = [sum(n for k, n in layer.totals().items() if k != "evicted") for layer in cache.stats().layers]
    assert held == sum(per_layer) < 160 * 8 * 2
    assert all(n <= 48 * 2 + 2 * 16 for n in per_layer)  # budget per head, plus what the window may add


def test_no_attend_all_bound_without_a_dynamic_row():
    got = _module().attend_all_bounds({"hfkv@1024": {"step": 10.0, "attention_macs": 2e9}}, gmacs=40.0)
    assert got == {"hfkv@1024": {"mac_floor_ms": pytest.approx(50.0)}}


def test_no_bound_without_a_dynamic_row():
    assert _module().free_attention_bound({"hfkv@1024": {"step": 10.0}}) == {}
